"""The held-out estimate of a head's chain (training.chain_walk, training.acceptance.held_out) predicts the engine's
tokens per target forward: exactly at T = 0 on the same prompts, within sampling noise at T = 1, where the
teacher-forced product formula over per-position averages overestimates."""
from __future__ import annotations

import pytest
import torch

from tilespec.engine import SpeculativeDecoder
from tilespec.engine.drafters import HeadDrafter
from tilespec.training import train_head
from tilespec.training.acceptance import EVAL_FILTERED, acceptance, emitted_acceptance, held_out, tau_by_gamma
from tilespec.training.chain_walk import alphas_of_taus, chain_walk
from tilespec.training.head_data import generate_responses, sequence_features
from tilespec.verify import SamplingParams

from engine_models import random_prompts, tiny_lm

VOCAB, NEW, PROMPT = 64, 40, 8


def _backward_steps(acc: torch.Tensor, start: int, end: int, gamma: int) -> float:
    """Expected steps by the backward recursion S(j) = 1 + sum_m P(first rejection at depth m) S(j + m)
    + P(all accepted) S(j + γ + 1), S(j >= end) = 0; acc [K, T] of one row."""
    s = [0.0] * (end + gamma + 2)
    for j in range(end - 1, start - 1, -1):
        run, total = 1.0, 1.0
        for m in range(1, gamma + 1):
            a = float(acc[m - 1, j + m - 1]) if j + m - 1 < end else 0.0
            total += run * (1 - a) * s[j + m]
            run *= a
        s[j] = total + run * s[j + gamma + 1]
    return s[start]


def test_chain_walk_equals_the_backward_recursion():
    g = torch.Generator().manual_seed(0)
    acc = torch.rand(5, 3, 20, generator=g)
    acc[0] = 1.0                                            # every draft accepted: ceil(tokens / (γ + 1)) steps
    start, end = torch.tensor([2, 0, 5, 7, 19]), torch.tensor([20, 20, 12, 7, 20])
    for gamma in (1, 2, 3):
        steps, tokens = chain_walk(acc, start, end, gamma)
        want = [_backward_steps(acc[i], int(start[i]), int(end[i]), gamma) for i in range(5)]
        torch.testing.assert_close(steps, torch.tensor(want, dtype=torch.float64), atol=1e-9, rtol=0)
        assert tokens.tolist() == [18, 20, 7, 0, 1]
        assert float(steps[0]) == -(-18 // (gamma + 1)) and float(steps[3]) == 0
    zero = chain_walk(torch.zeros(1, 2, 9), torch.tensor([1]), torch.tensor([9]), 2)
    assert zero[0].tolist() == [8.0] and zero[1].tolist() == [8.0]        # one token per step


def test_chain_walk_refuses_bad_shapes_and_depths():
    with pytest.raises(ValueError, match=r"accept \[S, K, T\]"):
        chain_walk(torch.zeros(2, 3), torch.zeros(2, dtype=torch.int64), torch.zeros(2, dtype=torch.int64), 1)
    with pytest.raises(ValueError, match="gamma must be in"):
        chain_walk(torch.zeros(2, 3, 4), torch.zeros(2, dtype=torch.int64), torch.zeros(2, dtype=torch.int64), 4)


def test_alphas_of_taus_invert_the_chain_formula():
    alphas = [0.8, 0.6, 0.5, 0.3]
    taus = {g: t for g, t in tau_by_gamma(alphas).items()}
    assert alphas_of_taus(taus) == pytest.approx(alphas, abs=2e-3)
    assert alphas_of_taus({1: 1.5, 2: 2.5}) == [0.5, 1.0]                # clipped where τ grows faster


@pytest.mark.parametrize("sampling", [SamplingParams(temperature=0.7), SamplingParams(temperature=1.0, top_k=5),
                                      SamplingParams(temperature=0.0)])
def test_emitted_acceptance_averages_to_the_sum_of_minima(sampling):
    """E_{x ~ p} min(1, q(x) / p(x)) = sum_v min(p, q): summed exactly over x, with a reduced draft vocabulary."""
    from tilespec.verify.distributions import log_probs
    from tilespec.verify.validation import resolve_sampling

    g = torch.Generator().manual_seed(3)
    v, n, rows = 12, 7, 5
    target = 2 * torch.randn(rows, v, generator=g)
    ids = torch.sort(torch.randperm(v, generator=g)[:n]).values
    draft = 2 * torch.randn(rows, n, generator=g)
    p = log_probs(target[None], resolve_sampling(sampling, 1, target.device))[0].exp()
    every = torch.arange(v).repeat(rows)
    r = emitted_acceptance(target.repeat_interleave(v, 0), draft.repeat_interleave(v, 0), every, ids, sampling)
    got = (p * r.view(rows, v)).sum(-1)
    torch.testing.assert_close(got, acceptance(target, draft, ids, sampling), atol=1e-5, rtol=0)
    assert ((r >= 0) & (r <= 1)).all()
    with pytest.raises(ValueError, match="tokens must be"):
        emitted_acceptance(target, draft, every, ids, sampling)


def _prompts(n: int, seed: int) -> list:
    return random_prompts(n, seed, PROMPT, VOCAB)


@pytest.fixture(scope="module")
def chain_head(tmp_path_factory):
    """A 4-layer random target and a head of 4 training-time-test steps trained on its greedy and T = 1 responses."""
    torch.set_num_threads(1)
    target = tiny_lm(0, "qwen2", vocab=VOCAB, layers=4, logit_scale=4.0)
    head, info = train_head(target, target_name="tiny", out=tmp_path_factory.mktemp("chain-head"),
                            prompts=_prompts(64, 1), max_new_tokens=NEW, gen_batch=32, seq_len=PROMPT + NEW,
                            draft_vocab=48, ttt_steps=4, batch=8, lr=3e-3, warmup=20, max_steps=150, eval_every=0,
                            resume=False, compile=False, progress=False, ignore_eos=True, log=lambda m: None)
    return target, head, info


def _estimate(target, head, prompts, temp: float, seed: int) -> dict:
    seqs = generate_responses(target, prompts, max_new_tokens=NEW, batch=len(prompts), compile=False,
                              temperatures=(temp,), seed=seed, ignore_eos=True)
    data = sequence_features(target, seqs, head.cfg.feature_layers, length=PROMPT + NEW)
    return held_out(head, data, torch.arange(len(prompts)), 4, target.lm_head.weight.detach(),
                    temperatures=(temp,), row_temperatures=torch.tensor(seqs.temperatures), min_positions=1)


def _live(target, head, prompts, temp: float, gamma: int, seed: int) -> float:
    """The engine's tokens per target forward over the requested tokens (a last step's surplus left out)."""
    dec = SpeculativeDecoder(target, HeadDrafter(head), gamma=gamma, sampling=SamplingParams(temperature=temp),
                             eos_token_id=[])
    out = dec.generate(prompts, max_new_tokens=NEW, seed=seed)
    return sum(len(s) for s in out.sequences) / sum(out.stats.accepted_histogram)


def test_the_greedy_chain_estimate_is_the_engines_tokens_per_forward(chain_head):
    """Greedy rows of the same prompts are the engine's text: the walked chain gives its tokens per forward exactly
    at every γ, where the product formula over per-position averages is far above it (steps start after
    rejections, so hard stretches count more)."""
    target, head, info = chain_head
    # 3 held-out rows hold too few tokens per temperature: the manifest's chain walks all rows
    assert info["held_out"]["chain_rows"] == {"0": 0, "0.7": 0, "1": 0, **{k: 0 for k in EVAL_FILTERED}}
    prompts = _prompts(32, 2)
    est = _estimate(target, head, prompts, 0.0, 0)
    teacher = est["teacher_forced"]["tau_by_setting"]["0"]
    for gamma in (1, 2, 4):
        live = _live(target, head, prompts, 0.0, gamma, 0)
        assert est["tau"][gamma] == pytest.approx(live, abs=2e-3), (gamma, est["tau"], live)
    assert teacher[4] > est["tau"][4] + 0.1, (teacher, est["tau"])


def test_the_sampled_chain_estimate_predicts_the_engine_at_t1(chain_head):
    """T = 1: the chain walked along T = 1 responses of held-out prompts against the engine on other prompts."""
    target, head, _ = chain_head
    est = _estimate(target, head, _prompts(96, 7), 1.0, 5)["tau_by_temperature"]["1"]
    prompts = _prompts(96, 2)
    for gamma, tol in ((1, 0.04), (4, 0.08)):
        live = sum(_live(target, head, prompts, 1.0, gamma, seed) for seed in (3, 4)) / 2
        assert est[gamma] == pytest.approx(live, abs=tol), (gamma, est, live)
