"""Paired bootstrap of metric differences (used by the report's sampling-noise table)."""
import pytest

pytest.importorskip("rouge_score")
pytest.importorskip("jiwer")

from tilespec.bench.metrics import paired_bootstrap, rouge1, wer  # noqa: E402

REFS = ["the cat sat on the mat", "a dog ran in the park today", "rain is expected over the weekend",
        "the market closed higher on friday", "scientists found water on the moon"] * 4


def test_identical_outputs_give_a_zero_interval():
    for metric in ("rouge1", "wer"):
        assert paired_bootstrap(metric, REFS, REFS, REFS) == (0.0, 0.0, 0.0)


def test_point_estimate_is_the_metric_difference_and_a_clear_gap_excludes_zero():
    worse = [r.split()[0] + " banana" for r in REFS]
    d, lo, hi = paired_bootstrap("rouge1", worse, REFS, REFS)
    assert d == pytest.approx(rouge1(REFS, REFS) - rouge1(worse, REFS))
    assert 0 < lo <= d <= hi
    d, lo, hi = paired_bootstrap("wer", REFS, worse, REFS)
    assert d == pytest.approx(wer(worse, REFS) - wer(REFS, REFS))
    assert 0 < lo <= d <= hi


def test_multi_reference_rouge_and_bad_input():
    refs = [[r, "unrelated words entirely"] for r in REFS]
    assert paired_bootstrap("rouge1", REFS, REFS, refs)[0] == 0.0
    with pytest.raises(ValueError):
        paired_bootstrap("rouge1", REFS[:3], REFS, REFS)
    with pytest.raises(ValueError):
        paired_bootstrap("bleu", REFS, REFS, REFS)
