"""Draft heads (tilespec.heads + engine/drafters/head.py) on tiny random targets: training raises acceptance, drafts
are exact (greedy equality, sequence law at T=1 with filters), checkpoints round-trip and belong to one target."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from tilespec.engine import SpeculativeDecoder
from tilespec.engine.drafters import HeadDrafter, resolve_drafter
from tilespec.exactness.stats import fit_test
from tilespec.heads import DraftHead, HeadMismatch, HeadNotFound, config_for, load_head, target_identity
from tilespec.training import train_head
from tilespec.verify import SamplingParams

from engine_models import exact_sequence_law, random_prompts, tiny_lm

GREEDY = SamplingParams(temperature=0.0)
VOCAB = 64


def _prompts(n: int, seed: int, length: int = 8) -> list:
    return random_prompts(n, seed, length, VOCAB)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A 4-layer random target and a head trained on its own responses for 200 steps (~8 s on one core)."""
    torch.set_num_threads(1)
    target = tiny_lm(0, "qwen2", vocab=VOCAB, layers=4, logit_scale=4.0)
    folder = tmp_path_factory.mktemp("head")
    head, info = train_head(target, target_name="tiny", out=folder, prompts=_prompts(64, 1), max_new_tokens=40,
                            gen_batch=32, seq_len=48, draft_vocab=48, ttt_steps=3, batch=8, lr=3e-3, warmup=20,
                            max_steps=200, eval_every=0, resume=False, compile=False, progress=False,
                            log=lambda m: None)
    return target, head, info, folder


def _fresh(target, like: DraftHead) -> DraftHead:
    return DraftHead(like.cfg, vocab_ids=like.vocab_ids).init_from(target).bind(target).eval().requires_grad_(False)


@pytest.mark.slow
def test_training_raises_the_heads_acceptance_on_the_targets_text(trained):
    target, head, info, _ = trained
    test = _prompts(8, 2)
    alpha = {}
    for temp in (0.0, 1.0):
        for name, h in (("untrained", _fresh(target, head)), ("trained", head)):
            dec = SpeculativeDecoder(target, HeadDrafter(h), gamma=3, sampling=SamplingParams(temperature=temp))
            alpha[name, temp] = dec.generate(test, max_new_tokens=40, seed=3).stats.alpha
    assert alpha["untrained", 0.0] < 0.05 and alpha["trained", 0.0] > 0.15, alpha
    assert alpha["trained", 1.0] > alpha["untrained", 1.0] + 0.15, alpha
    assert info["held_out"]["alpha_per_step"][0] > 0.4 and info["steps"] == 200


def test_held_out_acceptance_by_temperature_predicts_the_engines(trained):
    """The manifest's per-depth α at T (exact speculative sampling's sum of minima on held-out rows) is what the
    engine then accepts: τ(1) = 1 + α_1 against the engine's tokens per forward with γ = 1, at T = 0, 0.7 and 1."""
    from tilespec.heads.store import read_manifest

    target, head, info, folder = trained
    manifest = read_manifest(folder)
    assert manifest["alpha_by_temperature"] == info["alpha_by_temperature"] == info["held_out"]["alpha_by_temperature"]
    assert set(manifest["tau_by_temperature"]) == {"0", "0.7", "1"}
    assert manifest["alpha_by_temperature"]["0"] == info["held_out"]["alpha_per_step"]
    for key, temp in (("0", 0.0), ("0.7", 0.7), ("1", 1.0)):
        dec = SpeculativeDecoder(target, HeadDrafter(head), gamma=1, sampling=SamplingParams(temperature=temp))
        measured = dec.generate(_prompts(16, 2), max_new_tokens=40, seed=3).stats.block_efficiency
        assert measured == pytest.approx(1 + info["alpha_by_temperature"][key][0], abs=0.1), (key, measured)


@pytest.mark.parametrize("compile", [False, "native"])
@pytest.mark.parametrize("draft", ["head", "head+ngram"])
def test_greedy_head_drafts_equal_target_only(trained, compile, draft):
    target, head, _, _ = trained
    prompts = _prompts(3, 4, length=6) + [[5, 6, 7, 5, 6, 7, 5, 6]]
    ref = SpeculativeDecoder(target, None, sampling=GREEDY, compile=compile).generate(prompts, max_new_tokens=24)
    context = "ngram" if draft == "head+ngram" else None
    dec = SpeculativeDecoder(target, HeadDrafter(head, context=context), gamma=4, sampling=GREEDY, compile=compile)
    out = dec.generate(prompts, max_new_tokens=24)
    assert out.sequences == ref.sequences
    assert out.stats.drafted > 0 and out.stats.accepted > 0 and out.stats.drafter == draft


def test_greedy_head_drafts_with_requests_ending_early(trained):
    """An EOS ends one request mid-batch: the eager path drops its row (the head's cache and state too)."""
    target, head, _, _ = trained
    prompts = _prompts(3, 8, length=5)
    ref = SpeculativeDecoder(target, None, sampling=GREEDY).generate(prompts, max_new_tokens=20)
    eos = ref.sequences[1][6]
    ref = SpeculativeDecoder(target, None, sampling=GREEDY, eos_token_id=eos).generate(prompts, max_new_tokens=20)
    out = SpeculativeDecoder(target, HeadDrafter(head), gamma=3, sampling=GREEDY,
                             eos_token_id=eos).generate(prompts, max_new_tokens=20)
    assert out.sequences == ref.sequences and out.finish_reasons == ref.finish_reasons
    assert "eos" in out.finish_reasons


LAW_VOCAB, LENGTH, N = 6, 3, 6000
LAW_PROMPT = [1, 4, 2, 1, 4, 3, 5, 1, 4]


@pytest.mark.parametrize("compile,sampling", [
    (False, SamplingParams(temperature=1.0, top_k=4)),
    pytest.param("native", SamplingParams(temperature=0.8, top_p=0.9), marks=pytest.mark.slow),   # ~20 s
])
def test_head_drafted_sequences_follow_the_target_law(compile, sampling):
    """A random head over a reduced draft vocabulary (q = 0 outside it): the sequence law is still the target's."""
    target = tiny_lm(10, vocab=LAW_VOCAB, logit_scale=6.0)
    head = DraftHead(config_for(target, draft_vocab=4), vocab_ids=torch.tensor([0, 2, 3, 5]))
    torch.manual_seed(1)
    with torch.no_grad():
        for p in head.parameters():
            p.add_(0.3 * torch.randn_like(p))
    head.bind(target).eval().requires_grad_(False)
    dec = SpeculativeDecoder(target, HeadDrafter(head), gamma=2, sampling=sampling, eos_token_id=[], compile=compile)
    out = dec.generate([LAW_PROMPT] * N, max_new_tokens=LENGTH, seed=2024)
    s = out.stats
    assert 200 < s.accepted < s.drafted - 200                  # accepts and rejects
    index = [int(np.ravel_multi_index(q, [LAW_VOCAB] * LENGTH)) for q in out.sequences]
    law = exact_sequence_law(target, sampling, LAW_PROMPT, LAW_VOCAB, LENGTH)
    result = fit_test(np.bincount(index, minlength=LAW_VOCAB ** LENGTH), law)
    assert result.impossible == 0
    assert result.p_value > 1e-6, result


def test_checkpoint_round_trip_and_identity(trained):
    target, head, info, folder = trained
    loaded = load_head(folder, target)
    assert torch.equal(loaded.vocab_ids, head.vocab_ids.cpu())
    for (name, a), b in zip(head.state_dict().items(), loaded.state_dict().values()):
        assert torch.equal(a.cpu(), b.cpu()), name
    assert loaded.manifest["target_id"] == target_identity(target) and loaded.manifest["steps"] == info["steps"]
    prompts = _prompts(2, 5)
    a = SpeculativeDecoder(target, HeadDrafter(head), gamma=3, sampling=GREEDY).generate(prompts, max_new_tokens=16)
    b = SpeculativeDecoder(target, str(folder), gamma=3, sampling=GREEDY).generate(prompts, max_new_tokens=16)
    assert a.sequences == b.sequences and a.stats.accepted == b.stats.accepted


def test_a_head_for_another_target_is_refused(trained):
    _, _, _, folder = trained
    other = tiny_lm(7, "qwen2", vocab=VOCAB, layers=4)
    with pytest.raises(HeadMismatch, match="trained for target 'tiny'"):
        load_head(folder, other)
    with pytest.raises(HeadMismatch):
        SpeculativeDecoder(other, str(folder))


def test_a_missing_head_says_how_to_train_one(tmp_path, monkeypatch):
    monkeypatch.setenv("TILESPEC_HOME", str(tmp_path))
    target = tiny_lm(0, "qwen2", vocab=VOCAB, layers=2)
    target.tilespec_name = "tiny-model"
    with pytest.raises(HeadNotFound, match="tilespec draft train --target tiny-model"):
        SpeculativeDecoder(target, "head")
    assert isinstance(resolve_drafter("head+ngram"), HeadDrafter)


def test_native_features_match_transformers_hidden_states():
    """The native runtime hands the head the same hidden states as transformers' output_hidden_states."""
    from tilespec.engine.native.runner import NativeRunner
    from tilespec.engine.state import prefill_mask

    target = tiny_lm(3, "qwen2", vocab=VOCAB, layers=4)
    ids = torch.tensor(_prompts(2, 6))
    ref = target(input_ids=ids, output_hidden_states=True).hidden_states
    runner = NativeRunner(target, 16, mode="native")
    pos = torch.arange(ids.shape[1])[None].expand(2, -1)
    _, feats = runner.forward(ids, pos, prefill_mask(torch.ones_like(ids, dtype=torch.bool), 16), 0,
                              capture=(1, 3))
    torch.testing.assert_close(feats, torch.cat([ref[1], ref[3]], dim=-1), atol=1e-4, rtol=1e-4)


def test_training_time_test_sees_what_drafting_sees():
    """ttt_forward's step-k output at position e equals the head drafting k - 1 tokens past a committed prefix
    (its own outputs as features, its cache holding the prefix's real entries and the earlier drafted ones)."""
    from tilespec.engine.state import chunk_mask, prefill_mask

    target = tiny_lm(3, "qwen2", vocab=VOCAB, layers=4)
    head = DraftHead(config_for(target), vocab_ids=None).bind(target).eval().requires_grad_(False)
    torch.manual_seed(0)
    t, c = 12, 7                                       # committed entries 0..c-1, then drafted entries c, c+1
    feats = torch.randn(1, t, len(head.cfg.feature_layers) * head.cfg.hidden)
    toks = torch.randint(0, VOCAB, (1, t))
    nxt = torch.cat([toks[:, 1:], toks[:, -1:]], dim=1)
    with torch.no_grad():
        outs = head.ttt_forward(head.fuse(feats), nxt, 3)
        k, v = head.new_cache(1, 16, "cpu", torch.float32)
        valid = torch.zeros(1, 16, dtype=torch.bool)
        pos = torch.arange(c)[None]
        h = head.entries(head.fuse(feats[:, :c]), nxt[:, :c], pos, prefill_mask(torch.ones(1, c, dtype=torch.bool),
                                                                                 16), torch.tensor(0), k, v)
        valid[:, :c] = True
        torch.testing.assert_close(h[:, -1], outs[0][:, c - 1], atol=1e-4, rtol=1e-4)
        hid = h[:, -1]
        w = torch.tensor(c)
        for step in (2, 3):                            # the draft entry at position c + step - 2
            e = c + step - 2
            slot = w + (step - 2)
            hid = head.entries(hid[:, None], nxt[:, e:e + 1], torch.tensor([[e]]), chunk_mask(valid, w, slot, 1),
                               slot, k, v)[:, 0]
            torch.testing.assert_close(hid, outs[step - 1][:, e], atol=1e-4, rtol=1e-4)


def test_head_training_settings_refuse_bad_values():
    from tilespec.training import HeadTrainConfig

    assert HeadTrainConfig(batch=4).batch == 4 and HeadTrainConfig().ttt_steps == 4
    for bad in ({"minutes": 0}, {"batch": 0}, {"ttt_steps": 0}, {"data_share": 1.0}, {"draft_vocab": 0}):
        with pytest.raises(ValueError, match="head training needs"):
            HeadTrainConfig(**bad)
    with pytest.raises(TypeError, match="no_such_setting"):
        train_head(None, target_name="x", no_such_setting=1)


def test_draft_train_command_trains_a_head(tmp_path, monkeypatch):
    """``tilespec draft train`` hands its flags to train_head through a HeadTrainConfig and writes its report."""
    import json

    from tilespec import models
    from tilespec.cli import main

    target = tiny_lm(0, "qwen2", vocab=VOCAB, layers=2)
    monkeypatch.setattr(models, "load", lambda *a, **k: (target, None))
    prompts = tmp_path / "prompts.json"
    prompts.write_text(json.dumps({"prompts": _prompts(16, 2), "source": {"kind": "test"}}))
    report = tmp_path / "report.json"
    assert main(["draft", "train", "--target", "tiny", "--out", str(tmp_path / "head"), "--prompts-file",
                 str(prompts), "--prompts", "16", "--max-new-tokens", "8", "--gen-batch", "16", "--seq-len", "16",
                 "--draft-vocab", "32", "--ttt-steps", "2", "--max-steps", "3", "--eval-every", "0", "--device", "cpu",
                 "--tv-weight", "0.5", "--sample-temperatures", "0,0.7,1", "--json", str(report)]) == 0
    info = json.loads(report.read_text())
    assert info["steps"] == 3 and info["draft_vocab"] == 32 and info["ttt_steps"] == 2 and info["batch"] == 8
    assert info["data"]["kind"] == "test" and info["prompt_weight"] == 0.2 and info["tv_weight"] == 0.5
    assert info["data"]["sampling"] == "batches cycle T = 0 / 0.7 / 1" and set(info["alpha_by_temperature"]) == \
        {"0", "0.7", "1"}
