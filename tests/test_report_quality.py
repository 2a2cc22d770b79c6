"""Paper-scale quality table: ROUGE-1/2/L or WER with bootstrap intervals, recomputed from committed outputs."""
import pytest

from tilespec.bench.metrics import bootstrap_ci, rouge1, rouge_per_example
from bench.report.quality import method_quality, quality_table


def test_rouge_per_example_matches_rouge1_and_orders_types():
    preds, refs = ["the cat sat on the mat", "a dog ran"], ["the cat sat", ["a dog barked", "a dog ran home"]]
    per = rouge_per_example(preds, refs)
    assert set(per) == {"rouge1", "rouge2", "rougeL"}
    assert sum(per["rouge1"]) / 2 == pytest.approx(rouge1(preds, refs))
    assert all(r2 <= r1 + 1e-12 for r1, r2 in zip(per["rouge1"], per["rouge2"]))


def test_bootstrap_ci_brackets_the_value_and_is_zero_width_for_constant_scores():
    v, lo, hi = bootstrap_ci("rouge1", [0.1, 0.2, 0.3, 0.4, 0.5] * 20)
    assert lo < v < hi and v == pytest.approx(0.3)
    assert bootstrap_ci("rouge2", [0.25] * 10) == (0.25, 0.25, 0.25)
    # WER pieces are (errors, words): the corpus ratio, not the mean of ratios
    assert bootstrap_ci("wer", [(1, 10), (0, 30)])[0] == pytest.approx(1 / 40)
    with pytest.raises(ValueError, match="at least one example"):
        bootstrap_ci("rouge1", [])
    with pytest.raises(ValueError, match="no bootstrap for metric 'bleu'"):
        bootstrap_ci("bleu", [0.1, 0.2])


def test_rouge_per_example_rejects_mismatched_lengths_and_remembers_scores():
    with pytest.raises(ValueError, match="2 predictions for 1 references"):
        rouge_per_example(["a b", "c d"], ["a b"])
    first = rouge_per_example(["a b c"], [["a b", "b c"]])
    assert rouge_per_example(["a b c"], [["a b", "b c"]]) is first     # scored once, reused


def test_quality_table_rows_for_text_and_asr_runs():
    text = dict(_source="eval-scale-H100-xsum-t1-x.json", dataset="xsum", target="t", draft="d", metric="rouge1",
                config={"temperature": 1.0}, environment={"device": "NVIDIA H100 80GB HBM3"},
                references=["the cat sat", "a dog ran"],
                methods={"hf": {"texts": ["the cat sat", "a dog"]}, "sigmoid": {"texts": ["cat", "dog"]},
                         "fused": {}})   # no texts: no row
    asr = dict(text, _source="eval-scale-H100-asr-t0-x.json", dataset="ljspeech", metric="wer",
               references=["hello world", "good morning"], methods={"hf": {"texts": ["hello world", "good evening"]}})
    assert method_quality(text, "fused") == {}
    q = method_quality(asr, "hf")
    assert q["wer"][0] == pytest.approx(0.25)
    lines = quality_table([text, asr, dict(text, _source="eval-H100-old.json")])   # only eval-scale files
    rows = [x for x in lines if x.startswith("| XSum") or x.startswith("| LJSpeech")]
    assert len(rows) == 3
    assert "| sigmoid (NOT exact) | 2 |" in rows[1]
    assert "| hf | 2 | 0.900 [0.800, 1.000] |" in rows[0]   # ROUGE-1 F1 1.0 and 0.8
    assert "| – | – | – | 0.250 [" in rows[2]
