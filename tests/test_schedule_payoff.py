"""The ``optimal`` schedule never loses: a draft that never agrees costs a few forwards, per-request decisions at
B > 1 with the verify width priced, and context drafting resumes after a fallback (CPU, fp32, tiny models).

Costs here are counted in forwards, not wall time: a target forward counts 1 (plus DEFAULT_SLOPE per verify position
beyond the first, the width price the schedule assumes until it measures one), a draft forward its share of the
target's layers.
"""
from __future__ import annotations

import functools

import pytest
import torch

from tilespec.engine import GammaSchedule, SpeculativeDecoder
from tilespec.engine.payoff import DEFAULT_SLOPE, RequestAlphas, WidthCost, best_cap
from tilespec.verify import SamplingParams

from engine_models import tiny_lm

pytestmark = pytest.mark.usefixtures("one_thread")


def never_agreeing_pair():
    """(target with 4 layers, draft with 1): the draft always proposes token 0 (all-zero LM head, argmax ties to the
    first id), whose target logit is 0 while the target's greedy choice has a large positive logit: α = 0 at T = 0."""
    target, draft = tiny_lm(0, layers=4, logit_scale=20.0), tiny_lm(1, layers=1)
    with torch.no_grad():
        target.lm_head.weight[0].zero_()
        draft.lm_head.weight.zero_()
    return target, draft


def count_forwards(model) -> list:
    calls = [0]
    model.register_forward_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
    return calls


def test_a_draft_that_never_agrees_costs_under_three_percent():
    target, draft = never_agreeing_pair()
    prompt, n = [[5, 17, 33, 2, 9, 4]], 128
    greedy = SamplingParams.greedy()
    reference = SpeculativeDecoder(target, None, sampling=greedy, eos_token_id=[]).generate(prompt, max_new_tokens=n)
    dec = SpeculativeDecoder(target, draft, gamma=5, gamma_schedule="optimal", sampling=greedy, eos_token_id=[])
    drafts = count_forwards(draft)
    try:
        first = dec.generate(prompt, max_new_tokens=n)
        after_first = drafts[0]
        second = dec.generate(prompt, max_new_tokens=n)    # inherits the measured costs and the pooled α
    finally:
        draft._forward_hooks.clear()
    for out in (first, second):
        assert out.sequences == reference.sequences
        assert out.stats.accepted == 0
    ar_cost = reference.stats.target_calls
    extra_positions = sum(first.stats.gammas)             # verify positions beyond the first, over all steps
    cost = first.stats.target_calls + 0.25 * after_first + DEFAULT_SLOPE * extra_positions
    assert cost <= 1.03 * ar_cost, (cost, ar_cost, first.stats.gammas[:12])
    assert first.stats.fallback_at_step is not None and first.stats.fallback_at_step <= 4
    assert second.stats.fallback_at_step == 0 and drafts[0] == after_first   # no draft forward, no draft prefill


def drive_context(sched: GammaSchedule, rows: list, steps: int, matches, width_slope: float,
                  accept, t1: float = 2e-3) -> list:
    """Feed a context schedule synthetic steps. matches(step, row) -> draft length offered; accept(row, k) -> accepted
    count. Target seconds t1·(1 + width_slope·(q - 1)); no host overhead. Returns per step the lengths it kept
    (None: not drafting / target-only)."""
    kept = []
    for s in range(steps):
        g = sched.next()
        if g == 0:
            kept.append(None)
            sched.observe_rate(0, t1, 1.0, target_time=t1, fallback=True)
            continue
        offered = [[7] * min(matches(s, r), g) for r in rows]
        cut = sched.select_drafts(offered, rows) if any(offered) else None
        if cut is None:
            kept.append(None)
            sched.observe_rate(0, t1, 1.0, target_time=t1, fallback=False)
            continue
        ks = [len(d) for d in cut]
        q = max(ks) + 1
        target = t1 * (1 + width_slope * (q - 1))
        acc = [accept(r, k) if k else 0 for r, k in zip(rows, ks)]
        sched.update(max(ks), acc, draft_time=1e-5, target_time=target, step_time=target + 1e-5,
                     requests=rows, drafted=ks)
        sched.observe_rate(max(ks), target + 1e-5, sum(a + 1 for a in acc) / len(rows), fallback=False)
        kept.append(ks)
    return kept


def context_schedule(**kw) -> GammaSchedule:
    sched = GammaSchedule("optimal", gamma=4, max_gamma=8, **kw)
    sched.bind(model=False, context=True)
    return sched


def test_per_request_cut_at_batch_eight():
    """B = 8, the verify forward 25 % dearer per extra position: rows whose drafts are always rejected stop paying
    for the width (the steps where only they match go undrafted), while steps where most rows copy their context
    draft."""
    rows = list(range(8))
    sched = context_schedule()
    good = {0, 1, 2, 3, 4, 5}
    kept = drive_context(sched, rows, 40, matches=lambda s, r: 4 if (s % 2 == 0) == (r in good) else 0,
                         width_slope=0.25, accept=lambda r, k: k if r in good else 0)
    assert kept[0] == [1] * 6 + [0, 0]              # nothing timed yet: the first step probes with one token
    odd_steps = [k for s, k in enumerate(kept) if s >= 4 and s % 2 == 1]    # only the two bad rows offer drafts
    even_steps = [k for s, k in enumerate(kept) if s >= 4 and s % 2 == 0]   # the six good rows offer drafts
    assert all(k is None for k in odd_steps)
    assert all(k is not None and sum(k[r] for r in good) > 0 for k in even_steps)
    # one good row alone does not pay a batch-wide width of 5 at B = 8 ...
    alphas = [0.9] + [0.0] * 7
    cost = WidthCost()
    for q in (1, 5):
        cost.observe(q, 2e-3 * (1 + 0.25 * (q - 1)))
    g, speedup = best_cap(alphas, [4] + [0] * 7, 4, lambda g: cost.at(g + 1), cost.at(1), cost.at(1))
    assert g <= 1
    # ... but at B = 1 it does
    g1, s1 = best_cap([0.9], [4], 4, lambda g: cost.at(g + 1), cost.at(1), cost.at(1))
    assert g1 == 4 and s1 > 1.5


def test_width_cost_fits_a_line_and_request_alphas_forget():
    cost = WidthCost(decay=1.0)
    assert cost.at(3) == pytest.approx(1 + 2 * DEFAULT_SLOPE)        # unit costs before any measurement
    for q, t in ((1, 1.0), (3, 1.4), (5, 1.8), (3, 1.4)):
        cost.observe(q, t)
    assert cost.at(1) == pytest.approx(1.0) and cost.at(6) == pytest.approx(2.0)
    jump = WidthCost(decay=1.0)          # q = 1 is measured apart: a cheaper one-token kernel path is not averaged in
    for q, t in ((2, 1.3), (4, 1.5), (1, 1.0)):
        jump.observe(q, t)
    assert jump.at(1) == pytest.approx(1.0) and jump.at(3) == pytest.approx(1.4) and jump.single_known
    alphas = RequestAlphas(weight=2.0, decay=0.5)
    for _ in range(10):
        alphas.observe("a", 0, 3)
    low = alphas.alpha("a", 0.8)
    assert low < 0.2 and alphas.alpha("b", 0.8) == pytest.approx(0.8)
    for _ in range(6):
        alphas.forget()
    assert alphas.alpha("a", 0.8) > 0.6                               # drifted back: the request is tried again


def test_context_drafting_resumes_after_a_fallback():
    """A request that stops matching makes drafting lose, so the schedule falls back (run-ahead target-only steps);
    after ``backoff`` steps it drafts again, and keeps drafting once the context matches."""
    sched = context_schedule(backoff=6)
    rows = [0]
    phase = {"match": False}
    kept = drive_context(sched, rows, 30, matches=lambda s, r: 3 if phase["match"] else 0, width_slope=0.05,
                         accept=lambda r, k: k)
    assert sched.fallbacks >= 1 and sched.fallback_after is not None
    assert any(k is None for k in kept)
    phase["match"] = True
    kept = drive_context(sched, rows, 60, matches=lambda s, r: 3, width_slope=0.05, accept=lambda r, k: k)
    assert sched.resumes >= 1
    assert all(k is not None for k in kept[-20:]), kept[-20:]


def test_resumed_ngram_decoding_equals_target_only():
    """Engine: n-gram drafting with a schedule that falls back at once (fallback_below far above any speedup) and
    resumes every few steps: tokens equal target-only decoding, and drafting happened after the first fallback."""
    target = tiny_lm(0, logit_scale=20.0)
    prompts = [[5, 6, 7, 8, 5, 6, 7, 8, 5, 6], [1, 2, 3, 1, 2, 3, 1, 2], [9, 40, 2, 77]]
    greedy = SamplingParams.greedy()
    expected = SpeculativeDecoder(target, None, sampling=greedy, eos_token_id=[]).generate(
        prompts, max_new_tokens=40).sequences
    sched = functools.partial(GammaSchedule, backoff=3, min_steps=1)
    dec = SpeculativeDecoder(target, "ngram", gamma=3, gamma_schedule="optimal", fallback_below=1e9,
                             sampling=greedy, eos_token_id=[], schedule=sched)
    out = dec.generate(prompts, max_new_tokens=40)
    assert out.sequences == expected
    g = out.stats.gammas
    first = out.stats.fallback_at_step
    assert first is not None and out.stats.fallback_steps < len(g) - first   # some steps after it were not fallbacks


def test_model_draft_does_not_resume_and_mixed_batch_is_exact():
    """A draft model never resumes after its fallback (its cache is stale); at B = 3 with a random draft, the
    per-request estimates drive the decision and the tokens equal target-only decoding at T = 0."""
    target, draft = tiny_lm(0, logit_scale=20.0), tiny_lm(1, layers=1, logit_scale=20.0)
    prompts = [[5, 17, 33, 2, 9], [7], [1, 2, 3, 4, 5, 6, 7, 8]]
    greedy = SamplingParams.greedy()
    expected = SpeculativeDecoder(target, None, sampling=greedy, eos_token_id=[]).generate(
        prompts, max_new_tokens=24).sequences
    dec = SpeculativeDecoder(target, draft, gamma=3, gamma_schedule="optimal", sampling=greedy, eos_token_id=[],
                             schedule=functools.partial(GammaSchedule, backoff=2))
    out = dec.generate(prompts, max_new_tokens=24)
    assert out.sequences == expected
    g, first = out.stats.gammas, out.stats.fallback_at_step
    if first is not None:
        assert g[first:] == [0] * (len(g) - first)


def test_select_drafts_passes_other_schedules_through():
    drafts = [[1, 2], [], [3]]
    for kind in ("constant", "heuristic"):
        assert GammaSchedule(kind, 2, 4).select_drafts(drafts, [0, 1, 2]) is drafts
    with pytest.raises(ValueError, match="backoff"):
        GammaSchedule("optimal", 2, 4, backoff=0)
    with pytest.raises(ValueError, match="one entry per row"):
        GammaSchedule("optimal", 2, 4).update(2, [1, 0], requests=[0])


def test_mixed_rows_keep_the_paying_row_drafting():
    """Two requests at B = 2 with cheap verify width: the one accepting 3 of every 4 keeps drafting; the one that
    accepts nothing does not stop it (its row emits one token either way), and its own α estimate falls."""
    sched = context_schedule()
    rows = ["good", "bad"]
    kept = drive_context(sched, rows, 40, matches=lambda s, r: 4, width_slope=0.02,
                         accept=lambda r, k: min(k, 3) if r == "good" else 0)
    assert sum(1 for k in kept[10:] if k is not None and k[0] > 0) >= 25
    assert sched.requests.alpha("bad", sched.alpha) < 0.3 < sched.requests.alpha("good", sched.alpha)


def test_transcribe_defaults_never_speculate_without_a_draft(monkeypatch):
    """``tilespec transcribe`` and ``tilespec.transcribe`` default to target-only decoding (no draft), and with a
    draft to the ``optimal`` schedule, which stops drafting where it does not pay."""
    import inspect

    import numpy as np

    import tilespec
    from tilespec.cli import build_parser

    from engine_models import stub_whisper_io, tiny_whisper
    args = build_parser().parse_args(["transcribe", "clip.flac"])
    assert args.draft is None and args.gamma_schedule == "optimal"
    assert inspect.signature(tilespec.transcribe).parameters["draft"].default is None
    target = tiny_whisper(0)
    proc = stub_whisper_io(monkeypatch, target)
    out = tilespec.transcribe([np.zeros(16000, np.float32)] * 2, target=target, processor=proc, max_new_tokens=6)
    assert out.stats.drafted == 0 and out.stats.method == "target-only"
    import tilespec.api as api
    seen = {}
    real = api._decoder
    monkeypatch.setattr(api, "_decoder", lambda t, d, tok, options: seen.update(options) or real(t, d, tok, options))
    from tilespec.models.layerskip import layer_skip_draft
    tilespec.transcribe([np.zeros(16000, np.float32)], target=target, draft=layer_skip_draft(target, 1),
                        processor=proc, max_new_tokens=4)
    assert seen["gamma_schedule"] == "optimal"
