"""Reliability cases that run on the CPU (docs/reliability.md lists every case)."""
from __future__ import annotations

import pytest
import torch

from tilespec.engine import graphs


def test_workspace_clear_makes_graph_caches_capture_again(monkeypatch):
    """The mechanism behind the crash after transformers' static-compiled generate: any call of
    torch._C._cuda_clearCublasWorkspaces (CUDA-graph trees make one around every warm-up and recording) bumps the
    epoch, and a GraphCache with graphs from an older epoch drops them before its next call."""
    calls = []
    monkeypatch.setattr(torch._C, "_cuda_clearCublasWorkspaces", lambda: calls.append(1), raising=False)
    cache = graphs.GraphCache(lambda x, key=None: x)
    cache._graphs["stale"] = object()                # stands for a graph captured before the clear
    epoch = graphs.workspace_epoch()
    torch._C._cuda_clearCublasWorkspaces()           # what torch._inductor.cudagraph_trees calls
    assert calls == [1] and graphs.workspace_epoch() == epoch + 1
    with pytest.raises(RuntimeError, match="CUDA"):   # CPU: the fresh capture itself is refused ...
        cache(torch.ones(2))
    assert len(cache) == 0                            # ... but the stale graph is gone first
    graphs._watch_workspace_clears()                 # idempotent: one wrapper, one count per clear
    torch._C._cuda_clearCublasWorkspaces()
    assert calls == [1, 1] and graphs.workspace_epoch() == epoch + 2


def test_graph_cache_evicts_the_least_recently_replayed_graph(monkeypatch):
    """A long-lived server meets more step shapes than the bound: the cache evicts, it never raises."""
    class FakeGraph:
        def replay(self):
            pass

    cache = graphs.GraphCache(lambda x, key=None: x, max_graphs=3)
    monkeypatch.setattr(cache, "_record", lambda static, key: (FakeGraph(), key))   # CPU: no capture
    x = torch.ones(2)
    for key in ("a", "b", "c", "a", "d"):             # "a" replayed after "c": "b" is the least recent when "d" comes
        assert cache(x, key=key) == key
    assert len(cache) == 3 and cache.evictions == 1
    assert [k[0] for k in cache._graphs] == ["c", "a", "d"]


# ------------------------------------------------------------------------------ errors that misled or came late
import warnings                                              # noqa: E402

import numpy as np                                           # noqa: E402

import tilespec                                              # noqa: E402
from tilespec import api                                     # noqa: E402
from tilespec.engine import SpeculativeDecoder, drafters     # noqa: E402
from tilespec.verify import SamplingParams                   # noqa: E402

from engine_models import layer_skip, tiny_lm                # noqa: E402
from test_api import ChatTokenizer                           # noqa: E402
from test_bad_inputs_cli import run_cli as _cli              # noqa: E402



@pytest.fixture
def no_loading(monkeypatch):
    """Any model load fails the test: the errors below must come before one."""
    from tilespec import models

    def refuse(*a, **k):
        raise AssertionError("a model was loaded before the draft name was checked")
    monkeypatch.setattr(models, "load", refuse)


def test_drafter_typo_is_caught_before_any_load_with_did_you_mean(no_loading, capsys):
    rc, err = _cli(["generate", "--target", "smollm2-135m-instruct", "--draft", "ngramm", "--prompt", "hi"], capsys)
    assert rc == 1 and "unknown draft 'ngramm': did you mean 'ngram'?" in err and "Traceback" not in err
    with pytest.raises(ValueError, match="did you mean 'suffix'"):
        api.load_pair("smollm2-135m-instruct", "sufix", "cpu", torch.float32)
    with pytest.raises(ValueError, match="did you mean 'smollm2-135m-instruct'"):
        api.check_draft_name("smollm2-135m-instrut:layers=2")
    for fine in ("ngram", "suffix", "smollm2-135m-instruct+ngram", "org/model", "gpt2", None):
        api.check_draft_name(fine)


def test_drafter_suggestions_follow_the_drafter_registries(monkeypatch):
    """Names come from every *_DRAFTERS registry of tilespec.engine.drafters, so new drafters are suggested."""
    assert {"ngram", "suffix"} <= set(drafters.drafter_names())
    monkeypatch.setattr(drafters, "EXTRA_DRAFTERS", {"lookahead": object}, raising=False)
    assert "lookahead" in drafters.drafter_names()
    with pytest.raises(ValueError, match="did you mean 'lookahead'"):
        api.check_draft_name("lookahed")


def test_draft_names_work_with_a_loaded_target():
    target = tiny_lm(0, logit_scale=20.0)
    target.generation_config.eos_token_id = None
    tok = ChatTokenizer()
    with pytest.raises(ValueError, match="did you mean 'ngram'"):
        tilespec.generate("abc", target=target, tokenizer=tok, draft="ngramm", max_new_tokens=4)
    out = tilespec.generate("abcabc", target=target, tokenizer=tok, draft="any-name:layers=1", max_new_tokens=6,
                            temperature=0)
    ref = tilespec.generate("abcabc", target=target, tokenizer=tok, max_new_tokens=6, temperature=0)
    assert out.sequences == ref.sequences and out.stats.drafted > 0


@pytest.mark.parametrize("seed,error,match", [
    ("abc", TypeError, r"got 'abc' \(str\)"), (True, TypeError, r"got True \(bool\)"),
    (np.bool_(False), TypeError, r"\(bool"), (torch.tensor(True), TypeError, "torch.bool tensor"),
    ([1, True], TypeError, "in the per-request seeds"), (2.0, TypeError, r"pass int\(seed\)"),
    (2**63 - 1, ValueError, r"\[-2\*\*63, 2\*\*63 - 2\]")])
def test_verify_seed_errors(seed, error, match):
    logits, draft = torch.randn(2, 3, 10), torch.randint(0, 10, (2, 2))
    with pytest.raises(error, match=match):
        tilespec.verify(logits, draft, seed=seed)


def test_verify_takes_torch_and_numpy_integer_scalars_as_ints():
    logits, draft = torch.randn(2, 3, 10), torch.randint(0, 10, (2, 2))
    want = tilespec.verify(logits, draft, seed=3).output_tokens
    for seed in (torch.tensor(3), torch.tensor(3, dtype=torch.int32), np.int64(3)):
        assert torch.equal(tilespec.verify(logits, draft, seed=seed).output_tokens, want)
    assert torch.equal(tilespec.verify(logits, draft, seed=torch.tensor([3, 4])).output_tokens, want)


def test_meta_tensors_and_meta_models_are_named():
    logits, draft = torch.randn(2, 3, 10), torch.randint(0, 10, (2, 2))
    for kw in ({"target_logits": logits.to("meta"), "draft_tokens": draft},
               {"target_logits": logits, "draft_tokens": draft.to("meta")},
               {"target_logits": logits, "draft_tokens": draft, "draft_logits": torch.randn(2, 2, 10, device="meta")}):
        with pytest.raises(ValueError, match="is on the meta device"):
            tilespec.verify(**kw)
    target = tiny_lm(0)
    for t, d in ((target.to("meta"), None), (tiny_lm(0).to("meta"), layer_skip(tiny_lm(0), 1).to("meta"))):
        with pytest.raises(ValueError, match=r"the (target|draft) has weights on the meta device"):
            SpeculativeDecoder(t, d).generate([[1, 2, 3]], max_new_tokens=2)


def test_generate_prompts_agree_with_the_cli(capsys):
    target = tiny_lm(0)
    tok = ChatTokenizer()
    with pytest.raises(TypeError, match="prompts must be a str or a list of str, got NoneType"):
        tilespec.generate(None, target=target, tokenizer=tok)
    for bad in ([""], ["ok", "   "], ""):
        with pytest.raises(ValueError, match="is empty: give some text to continue"):
            tilespec.generate(bad, target=target, tokenizer=tok)
    with pytest.raises(ValueError, match="no prompts"):
        tilespec.generate([], target=target, tokenizer=tok)
    rc, err = _cli(["generate", "--target", "x", "--prompt", ""], capsys)
    assert rc == 1 and "is empty: give some text to continue" in err


def test_negative_temperature_fails_before_the_prefill():
    target = tiny_lm(0)
    calls = []
    target.register_forward_pre_hook(lambda *a: calls.append(1))
    for mode in (False, "native"):
        dec = SpeculativeDecoder(target, None, sampling=SamplingParams(temperature=-1.0), compile=mode)
        with pytest.raises(ValueError, match="temperature"):
            dec.generate([[1, 2, 3]], max_new_tokens=2)
    assert calls == []


def test_check_exactness_refuses_a_sample_too_small_for_its_power_check(capsys):
    rc, err = _cli(["check", "exactness", "--method", "reference", "--samples", "2000"], capsys)
    assert rc == 1 and "--samples 2,000 is too small for the power check" in err and "--no-power-check" in err
    from tilespec.cli.check import min_power_samples
    assert min_power_samples(1e-6) == 50_000 and min_power_samples(1e-12) == 100_000
    assert min_power_samples(1e-3) == 50_000


def test_ctrl_c_during_models_fetch_is_one_line(monkeypatch, capsys):
    from tilespec import models

    def interrupted(*a, **k):
        raise KeyboardInterrupt
    monkeypatch.setattr(models, "fetch", interrupted)
    rc, err = _cli(["models", "fetch", "smollm2-135m-instruct"], capsys)
    assert rc == 130 and "Traceback" not in err and len(err.strip().splitlines()) == 1
    assert "interrupted; the cache is unchanged" in err


def test_our_transformers_calls_raise_no_deprecation_warning():
    """transformers >= 5.2x renamed past_key_values to cache (with a FutureWarning); older 5.x only knows the old
    name: engine.cache.cache_kwarg picks the one the installed version takes."""
    from tilespec.multidraft.decoding import MultiDraftDecoder
    target = tiny_lm(0, logit_scale=20.0)
    draft = layer_skip(target, 1)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        for mode in (False, "native"):
            SpeculativeDecoder(target, draft, gamma=2, compile=mode).generate([[1, 2, 3]], max_new_tokens=3)
        MultiDraftDecoder(target, draft, draft_temperatures=[1.0, 1.0], L=1).generate(
            torch.tensor([[1, 2, 3]]), max_new_tokens=2)
    ours = [w for w in seen if "past_key_values" in str(w.message) or "deprecat" in str(w.message).lower()]
    assert not ours, [str(w.message) for w in ours]


def _greedy_ties():
    import sys
    from pathlib import Path
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench" / "scripts"))
    import greedy_ties
    return greedy_ties


def test_greedy_tie_rule_accepts_only_small_gaps_at_the_first_difference():
    """The soak's T = 0 rule (bench/scripts/greedy_ties.py): a row may differ from the reference only where the
    reference's top two logits are at most TIE_STEPS = 2 bf16 steps apart at the FIRST differing token; tokens
    after it are not compared; a larger gap fails."""
    ties = _greedy_ties()
    logits = torch.zeros(3, 2, 8)
    logits[:, :, 0] = 8.0                                   # top logit 8.0: a bf16 step of 2^(3 - 7) = 1/16
    logits[0, 0, 1] = 8.0 - 2 / 16                          # row 0: 2 steps apart at token 0
    logits[1, 1, 1] = 8.0 - 3 / 16                          # row 1: 3 steps apart at token 1
    logits[2, :, 1] = 8.0                                   # row 2: an exact tie everywhere
    gaps = ties.top2_gaps(logits.to(torch.bfloat16))
    assert [round(g, 3) for g in gaps[0]] == [2.0, 128.0] and gaps[1][1] == 3.0 and gaps[2] == [0.0, 0.0]
    want = [[0, 0], [0, 0], [0, 0]]
    got = [[1, 5], [0, 1], [0, 0]]                         # row 0 parts at token 0 (then anything goes)
    div, n_ties, problems = ties.judge(got, want, gaps)
    assert div == [dict(row=0, token=0, gap_bf16_steps=2.0), dict(row=1, token=1, gap_bf16_steps=3.0)]
    assert n_ties == 1 and len(problems) == 1 and "row 1 differs" in problems[0] and "3.0 bf16 steps" in problems[0]
    assert ties.judge([[1, 0]], [[0, 0]], [[2.01, 0.0]])[2]             # just past the rule: fails
    assert ties.judge([[0]], [[0, 0]], [[0.0, 0.0]])[2]                 # a short row is a difference too
    assert ties.bf16_step(torch.tensor([1.0, -3.0, 0.5])).tolist() == [2**-7, 2**-6, 2**-8]
