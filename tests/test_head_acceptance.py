"""Head training's acceptance estimates and sampling options (tilespec.training.acceptance, head_training, head_data,
``tilespec draft train`` flags) against brute-force full-vocabulary computations on tiny tensors and a tiny target."""
from __future__ import annotations

import argparse
import math

import pytest
import torch

from tilespec.heads import DraftHead, config_for
from tilespec.training import HeadTrainConfig
from tilespec.training.acceptance import EVAL_FILTERED, acceptance, held_out, tau_by_gamma, total_variation
from tilespec.training.head_data import Sequences, sequence_features
from tilespec.training.head_training import _loss, draft_log_mass
from tilespec.verify import SamplingParams

from engine_models import tiny_lm


def _filtered_probs(z: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Brute force, float64, one row z (scaled logits, -inf = excluded): top-k then top-p by their definitions."""
    z = z.double().clone()
    if 0 < top_k < int(torch.isfinite(z).sum()):
        z[z < torch.sort(z, descending=True).values[top_k - 1]] = -math.inf
    if top_p < 1:
        pi = torch.softmax(z, -1)
        keep = torch.tensor([float(pi[z > z[x]].sum()) < top_p for x in range(len(z))])
        z[~keep] = -math.inf
    return torch.softmax(z, -1)


def _brute_acceptance(t_row, d_row, ids, temp, top_k=0, top_p=1.0) -> float:
    v = t_row.shape[0]
    q_full = torch.full((v,), -math.inf, dtype=torch.float64)
    q_full[ids] = d_row.double()
    if temp == 0:
        return float(int(ids[d_row.argmax()]) == int(t_row.argmax()))
    p = _filtered_probs(t_row / temp, top_k, top_p)
    q = _filtered_probs(q_full / temp, top_k, top_p)
    return float(torch.minimum(p, q).sum())


@pytest.mark.parametrize("temp,top_k,top_p", [(0.0, 0, 1.0), (0.7, 0, 1.0), (1.0, 0, 1.0), (0.7, 3, 0.8),
                                              (1.0, 0, 0.5)])
def test_acceptance_equals_the_full_vocabulary_sum_of_minima(temp, top_k, top_p):
    g = torch.Generator().manual_seed(0)
    p_rows, v, n = 8, 12, 5
    target = 2 * torch.randn(p_rows, v, generator=g)
    ids = torch.sort(torch.randperm(v, generator=g)[:n]).values
    draft = 2 * torch.randn(p_rows, n, generator=g)
    draft[:3] = target[:3, ids]                          # rows that agree (greedy: same argmax when it is in vocab)
    target[0, ids[0]] = 50.0
    draft[0, 0] = 50.0
    got = acceptance(target, draft, ids, SamplingParams(temperature=temp, top_k=top_k, top_p=top_p))
    want = torch.tensor([_brute_acceptance(target[i], draft[i], ids, temp, top_k, top_p) for i in range(p_rows)])
    assert got.shape == (p_rows,) and got.dtype == torch.float32
    torch.testing.assert_close(got, want.float(), atol=1e-5, rtol=0)
    assert got[0] == pytest.approx(1.0, abs=1e-4) and (got <= 1 + 1e-6).all() and (got >= 0).all()
    full = acceptance(target[:, ids], draft, None, SamplingParams(temperature=temp, top_k=top_k, top_p=top_p))
    assert (full >= got - 1e-6).all()                    # on the draft vocabulary alone p loses no mass


def test_acceptance_refuses_mismatched_shapes():
    with pytest.raises(ValueError, match="need vocab_ids"):
        acceptance(torch.zeros(2, 8), torch.zeros(2, 4))
    with pytest.raises(ValueError, match=r"\[P, V\]"):
        acceptance(torch.zeros(2, 8), torch.zeros(3, 8))
    with pytest.raises(ValueError, match="vocab_ids must be"):
        acceptance(torch.zeros(2, 8), torch.zeros(2, 4), torch.arange(5))


def test_tau_is_the_chains_expected_tokens_per_forward():
    assert tau_by_gamma([0.5, 0.5, 1.0]) == {1: 1.5, 2: 1.75, 3: 2.0}
    assert tau_by_gamma([]) == {}


def test_total_variation_is_one_minus_sampled_acceptance_and_has_a_gradient():
    g = torch.Generator().manual_seed(1)
    full = torch.randn(6, 10, generator=g)
    ids = torch.tensor([0, 2, 3, 7])
    teacher = torch.log_softmax(full[:, ids], -1)
    log_mass = torch.logsumexp(full[:, ids], -1) - torch.logsumexp(full, -1)
    draft = torch.randn(6, 4, generator=g, requires_grad=True)
    tv = total_variation(teacher, torch.log_softmax(draft, -1), log_mass)
    q_full = torch.zeros(6, 10).index_copy(1, ids, torch.softmax(draft.detach(), -1))
    brute = 0.5 * (torch.softmax(full, -1) - q_full).abs().sum(-1)
    torch.testing.assert_close(tv.detach(), brute, atol=1e-6, rtol=0)
    torch.testing.assert_close(tv.detach(), 1 - acceptance(full, draft.detach(), ids, SamplingParams(temperature=1.0)),
                               atol=1e-6, rtol=0)
    tv.sum().backward()
    assert torch.isfinite(draft.grad).all() and draft.grad.abs().sum() > 0
    same = total_variation(teacher, teacher)                     # no log_mass: the draft vocabulary holds all mass
    torch.testing.assert_close(same, torch.zeros(6), atol=1e-6, rtol=0)


@pytest.fixture(scope="module")
def tiny():
    """A tiny target, a fresh head over 40 of its 64 ids, and its features of 4 random sequences."""
    torch.manual_seed(0)
    target = tiny_lm(0, "qwen2", vocab=64, layers=2, logit_scale=3.0)
    g = torch.Generator().manual_seed(2)
    seqs = Sequences([torch.randint(1, 64, (n,), generator=g).tolist() for n in (20, 24, 17, 24)], [6, 8, 5, 10])
    ids = torch.sort(torch.randperm(64, generator=g)[:40]).values
    head = DraftHead(config_for(target, draft_vocab=40), vocab_ids=ids).init_from(target).bind(target)
    data = sequence_features(target, seqs, head.cfg.feature_layers, length=24)
    return target, head, data


def _full_probs(target, head, data, h, rows):
    """Brute force: the target's and the head's full-vocabulary T = 1 probabilities at every entry [S, T, V]."""
    normed = data["normed"][rows]
    teach_h = torch.cat([normed[:, 1:], normed[:, -1:]], dim=1)
    with torch.no_grad():
        p = torch.softmax(target.lm_head(teach_h).double(), -1)
        q = torch.zeros_like(p)
        q[..., head.vocab_ids] = torch.softmax(head.logits(h).double(), -1)
    return p, q


def test_tv_term_of_the_loss_equals_the_full_vocabulary_brute_force(tiny):
    target, head, data = tiny
    lm_full = target.lm_head.weight.detach()
    data = dict(data, log_mass=draft_log_mass(data, head.lm_rows, lm_full, batch=3))
    with torch.no_grad():
        logits = target.lm_head(data["normed"])
    brute_mass = torch.logsumexp(logits[..., head.vocab_ids], -1) - torch.logsumexp(logits, -1)
    torch.testing.assert_close(data["log_mass"], brute_mass.clamp(max=0), atol=1e-5, rtol=0)
    idx, steps, lam = torch.tensor([0, 2, 3]), 3, 0.7
    base = _loss(head, data, idx, steps, head.lm_rows, 0.1, 0.2)
    with_tv = _loss(head, data, idx, steps, head.lm_rows, 0.1, 0.2, tv_weight=lam)
    toks = data["tokens"][idx]
    nxt = torch.cat([toks[:, 1:], toks[:, -1:]], dim=1)
    with torch.no_grad():
        outs = head.ttt_forward(head.fuse(data["feats"][idx]), nxt, steps)
    pos = torch.arange(toks.shape[1])[None]
    inside = pos + 2 < data["lengths"][idx, None]
    resp = pos + 2 >= data["loss_from"][idx, None]
    weight = (inside & resp).double() + 0.2 * (inside & ~resp).double()
    want = 0.0
    for k, h in enumerate(outs, start=1):
        p, q = _full_probs(target, head, data, h, idx)
        m = weight * (pos >= k - 1)
        want += 0.8 ** (k - 1) * float((0.5 * (p - q).abs().sum(-1) * m).sum() / m.sum())
    assert float((with_tv - base).detach()) == pytest.approx(lam * want, rel=1e-4)
    head.zero_grad()
    (with_tv - base).backward()
    grads = [p.grad for p in (head.fc.weight, head.qkv.weight, head.down.weight)]
    assert all(g is not None and torch.isfinite(g).all() and g.abs().sum() > 0 for g in grads)
    head.zero_grad()


def test_held_out_reports_sampled_acceptance_per_depth_and_temperature(tiny):
    """Teacher-forced averages against brute force; the stored τ is the chain walked along the rows (without row
    temperatures: with each position's average acceptance) and α is the per-depth acceptance giving that τ."""
    from tilespec.training.chain_walk import alphas_of_taus, taus_of_walks

    target, head, data = tiny
    rows = torch.tensor([1, 3, 0])
    est = held_out(head, data, rows, 2, target.lm_head.weight.detach(), batch=2, temperatures=(0.0, 0.7, 1.0),
                   filtered=EVAL_FILTERED, chunk=7)
    assert set(est["alpha_by_temperature"]) == {"0", "0.7", "1"} and set(est["alpha_by_sampling"]) == set(EVAL_FILTERED)
    assert est["alpha_by_temperature"]["0"] == est["alpha_per_step"] and est["tau"] == est["tau_by_temperature"]["0"]
    assert est["chain_rows"] == {"0": 0, "0.7": 0, "1": 0, **{k: 0 for k in EVAL_FILTERED}}
    teacher = est["teacher_forced"]["alpha_by_setting"]
    toks = data["tokens"][rows]
    nxt = torch.cat([toks[:, 1:], toks[:, -1:]], dim=1)
    mean = torch.zeros(3, 2, toks.shape[1])
    with torch.no_grad():
        outs = head.ttt_forward(head.fuse(data["feats"][rows]), nxt, 2)
        pos = torch.arange(toks.shape[1])[None]
        base = (pos + 2 < data["lengths"][rows, None]) & (pos + 2 >= data["loss_from"][rows, None])
        for k, h in enumerate(outs, start=1):
            p, q = _full_probs(target, head, data, h, rows)
            m = base & (pos >= k - 1)
            per_position = torch.minimum(p, q).sum(-1)
            assert teacher["1"][k - 1] == pytest.approx(float(per_position[m].mean()), abs=1e-4)
            greedy = float((q.argmax(-1) == p.argmax(-1))[m].float().mean())
            assert teacher["0"][k - 1] == pytest.approx(greedy, abs=1e-4)
            mean[:, k - 1, 2:] = (per_position * m)[:, :-2].float()
    assert est["positions"] == int(base.sum())
    taus = taus_of_walks(mean, data["loss_from"][rows], data["lengths"][rows], (1, 2))
    assert est["tau_by_temperature"]["1"] == {g: pytest.approx(t, abs=1e-3) for g, t in taus.items()}
    assert est["alpha_by_temperature"]["1"] == pytest.approx(alphas_of_taus(taus), abs=1e-4)
    assert est["teacher_forced"]["tau_by_setting"]["1"] == tau_by_gamma(teacher["1"])


def test_sample_temperatures_and_tv_weight_are_validated():
    cfg = HeadTrainConfig(sample_temperatures=[0, 0.7, 1])
    assert cfg.sample_temperatures == (0.0, 0.7, 1.0) and HeadTrainConfig().sample_temperatures == (0.0, 1.0)
    for bad in ((), [-0.1], [3.0], [float("nan")], "0,1", 1.0, [True], [None]):
        with pytest.raises(ValueError, match="sample_temperatures"):
            HeadTrainConfig(sample_temperatures=bad)
    for bad in (-1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="tv_weight"):
            HeadTrainConfig(tv_weight=bad)


def test_responses_cycle_through_the_sample_temperatures(monkeypatch):
    import tilespec.engine as engine
    from tilespec.training.head_data import generate_responses

    used = []

    class Recorder:
        def __init__(self, target, draft, *, sampling, compile, **kw):
            self.temp = sampling.temperature

        def generate(self, chunk, *, max_new_tokens, seed):
            used.append(self.temp)
            return argparse.Namespace(sequences=[[7] * max_new_tokens for _ in chunk])

    monkeypatch.setattr(engine, "SpeculativeDecoder", Recorder)
    seqs = generate_responses(None, [[1, 2]] * 9, max_new_tokens=3, batch=2, compile=False,
                              temperatures=(0.0, 0.7, 0.7, 1.0))
    assert used == [0.0, 0.7, 0.7, 1.0, 0.0] and len(seqs.tokens) == 9 and seqs.new_tokens == 27
    with pytest.raises(ValueError, match="at least one temperature"):
        generate_responses(None, [[1]], max_new_tokens=1, batch=1, temperatures=())


def test_draft_train_flags_reach_the_config(monkeypatch, capsys):
    from tilespec import models, training
    from tilespec.cli import main
    from tilespec.cli.draft import temperature_list

    assert temperature_list("0,0.7,1") == (0.0, 0.7, 1.0)
    for bad in ("", "a,1", "-1", "0,5", "nan"):
        with pytest.raises(argparse.ArgumentTypeError, match="temperatures in"):
            temperature_list(bad)
    seen = {}
    monkeypatch.setattr(models, "load", lambda *a, **k: (tiny_lm(0, "qwen2", vocab=64), None))
    monkeypatch.setattr(training, "train_head", lambda *a, config, **k: (seen.update(config=config), (None, {}))[1])
    argv = ["draft", "train", "--target", "tiny", "--device", "cpu", "--max-steps", "1"]
    assert main(argv + ["--sample-temperatures", "0,0.7,1", "--tv-weight", "0.5"]) == 0
    assert seen["config"].sample_temperatures == (0.0, 0.7, 1.0) and seen["config"].tv_weight == 0.5
    assert main(argv) == 0
    assert seen["config"].sample_temperatures == (0.0, 1.0) and seen["config"].tv_weight == 0.0
    with pytest.raises(SystemExit):
        main(argv + ["--sample-temperatures", "0,x"])
    assert "temperatures in [0, 2]" in capsys.readouterr().err
