"""Batched evaluation (--batch-size) and resumable runs, on tiny random models (CPU, no downloads)."""
from __future__ import annotations

import json

import pytest
import torch

import tilespec.verify.kernels  # noqa: F401  (Triton interpreter on CPU before anything imports triton)
from tilespec.bench.config import EvalConfig
from tilespec.bench.quality import evaluate, find_run, resumable, write_results

from engine_models import layer_skip, tiny_lm


class ToyTokenizer:
    """Word-level toy tokenizer over a 128-token vocabulary; prompts of different lengths (left padding)."""

    def __call__(self, text):
        return {"input_ids": [3 + (sum(map(ord, w)) % 120) for w in text.split()][:24] or [3]}

    def decode(self, ids, skip_special_tokens=True):
        return " ".join(f"w{i}" for i in ids if i >= 3)


DOCS = [dict(id=str(i), document=" ".join(f"word{j * (i + 1)}" for j in range(3 + 2 * i)), reference=f"w{10 + i} w20")
        for i in range(4)]


def cfg_of(**kw):
    base = dict(task="summarization", dataset="xsum", methods=("hf", "tiled", "fused"), target="tiny",
                draft="tiny:layers=1", max_new_tokens=8, temperature=0.0, studies=("main",), gamma=3, max_gamma=6)
    base.update(kw)
    return EvalConfig(**base)


@pytest.fixture(scope="module")
def pair():
    target = tiny_lm(0, logit_scale=4.0)
    return target, layer_skip(target, 1), ToyTokenizer()


def quiet(*a, **k):
    pass


@pytest.mark.slow
def test_batched_greedy_equals_batch_one_and_exact_methods_equal_hf(pair):
    one = evaluate(cfg_of(batch_size=1), models=pair, examples=DOCS, log=quiet)
    three = evaluate(cfg_of(batch_size=3), models=pair, examples=DOCS, log=quiet)
    assert three["batch_size"] == 3 and three["config"]["batch_size"] == 3 and "protocol_note" in three
    assert one["batch_size"] == 1 and "protocol_note" not in one
    for rec in (one, three):
        rows = rec["methods"]
        assert rec["n"] == len(DOCS)
        for m in ("tiled", "fused"):
            assert rows[m]["texts"] == rows["hf"]["texts"]
            assert rows[m]["identical_to_baseline"] == 1.0
    for m in ("hf", "tiled", "fused"):
        assert three["methods"][m]["texts"] == one["methods"][m]["texts"]
        assert three["methods"][m]["batch_size"] == 3 and one["methods"][m]["batch_size"] == 1
    # raw chunks: 4 examples in chunks of 3 -> [0, 1, 2], [3]; seeds seed + i per example
    chunks = three["raw"]["fused"]
    assert [c["idx"] for c in chunks] == [[0, 1, 2], [3]]
    assert [c["seeds"] for c in chunks] == [[0, 1, 2], [3]]
    assert [c["stats"]["requests"] for c in chunks] == [3, 1]
    assert sum(len(s.split()) for c in chunks for s in c["sequences"]) == three["methods"]["fused"]["new_tokens"]


@pytest.mark.slow
def test_batched_sampling_is_keyed_per_row(pair):
    """T = 1 in a batch: tiled and fused draw from the same counter-based streams keyed by (seed + i, position), so
    inside one batched run they emit the same tokens per example; a second run (fused alone) repeats them exactly.
    (Across batch sizes only the law is the same: the shared γ schedule changes the draft proposals.)"""
    kw = dict(temperature=1.0, methods=("tiled", "fused"), batch_size=3)
    a = evaluate(cfg_of(**kw), models=pair, examples=DOCS, log=quiet)
    assert a["methods"]["tiled"]["texts"] == a["methods"]["fused"]["texts"]
    b = evaluate(cfg_of(**dict(kw, methods=("fused",))), models=pair, examples=DOCS, log=quiet)   # fused alone
    assert b["methods"]["fused"]["texts"] == a["methods"]["fused"]["texts"]


def test_cut_off_run_resumes_without_redoing_examples(pair, tmp_path, monkeypatch):
    path = tmp_path / "eval.json"
    cfg = cfg_of(batch_size=2, methods=("hf", "fused"))
    saved = []

    class Killed(Exception):
        pass

    def on_update(rec):
        write_results(path, rec)
        saved.append(rec)
        if len(saved) == 1:                 # killed after the first chunk was written
            raise Killed

    with pytest.raises(Killed):
        evaluate(cfg, models=pair, examples=DOCS, log=quiet, on_update=on_update)
    prev = find_run(path, cfg)
    assert prev is not None and resumable(prev, cfg, [d["id"] for d in DOCS]) is None
    assert [c["idx"] for c in prev["raw"]["fused"]] == [[0, 1]] and prev["n"] == 2

    from tilespec.bench import harness
    decoded = []
    original = harness.decode_chunk

    def spy(dec, task, chunk, idx, seeds, limit):
        decoded.append((dec.method, list(idx)))
        return original(dec, task, chunk, idx, seeds, limit)

    monkeypatch.setattr(harness, "decode_chunk", spy)
    rec = evaluate(cfg, models=pair, examples=DOCS, log=quiet, previous=prev)
    assert decoded == [("hf", [2, 3]), ("fused", [2, 3])]      # only the missing examples, once per method
    assert rec["n"] == len(DOCS) and rec["resumed"] == 1 and "main" in rec["stages_done"]
    assert [c["idx"] for c in rec["raw"]["fused"]] == [[0, 1], [2, 3]]
    fresh = evaluate(cfg, models=pair, examples=DOCS, log=quiet)
    for m in ("hf", "fused"):
        assert rec["methods"][m]["texts"] == fresh["methods"][m]["texts"]
        assert rec["methods"][m]["new_tokens"] == fresh["methods"][m]["new_tokens"]
    write_results(path, rec)
    assert len(json.loads(path.read_text())["runs"]) == 1       # replaced, not duplicated
    # other settings or other examples: not resumed
    assert "settings differ" in resumable(prev, cfg_of(batch_size=3, methods=("hf", "fused")), [d["id"] for d in DOCS])
    assert "examples differ" in resumable(prev, cfg, ["0", "1"])


def test_batch_size_is_validated():
    with pytest.raises(ValueError, match="batch_size"):
        cfg_of(batch_size=0)


def test_capacity_buckets_match_the_engine(pair):
    """warmup.capacity_bucket / shape_groups predict the (capacity, B) of the runners the engine builds for each
    chunk (compile="native": shared, rounded runners on CPU), so the warm-up captures the timed shapes."""
    from tilespec.engine.leases import _COMPILED_RUNNERS, release_compiled
    from tilespec.bench.harness import make_decoder
    from tilespec.bench.tasks import TextTask
    from tilespec.bench.warmup import batch_inputs, capacity_bucket, shape_groups

    target, draft, tok = pair
    cfg = cfg_of(methods=("hf",), compile="native", max_new_tokens=4)
    task = TextTask(tok)
    prepared = [task.prepare(d, "cpu", torch.float32) for d in DOCS * 2]       # 8 inputs, chunks of 3: 3, 3, 2
    groups = shape_groups(prepared, 3, cfg.max_new_tokens, cfg.max_gamma)
    assert sorted(len(g) for g in groups) == [2, 3]
    release_compiled()
    dec = make_decoder(target, draft, "hf", cfg)
    for i in range(0, len(prepared), 3):
        ids, feats = batch_inputs(prepared[i:i + 3])
        dec.generate(input_ids=ids, max_new_tokens=cfg.max_new_tokens, seed=0)
    built = {(k[2], k[3]) for k in _COMPILED_RUNNERS if k[1] == "target"}
    predicted = {(capacity_bucket(max(len(p.ids) for p in g), cfg.max_new_tokens, cfg.max_gamma, len(g)), len(g))
                 for g in groups}
    release_compiled()
    assert built == predicted
