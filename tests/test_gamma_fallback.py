"""The ``optimal`` γ schedule's fallback to target-only decoding when speculation is predicted to lose (CPU, fp32).

Unit tests drive :class:`GammaSchedule` with synthetic (α, c); engine tests force the fallback (``fallback_below``
above any reachable speedup, or a draft slower than its target) and check exactness and the stats accounting.
"""
from __future__ import annotations

import random

import pytest
import torch

from tilespec.engine import GammaSchedule, SpeculativeDecoder, expected_speedup
from tilespec.verify import SamplingParams

from engine_models import tiny_lm
from tiers import fast_first


pytestmark = pytest.mark.usefixtures("one_thread")


def drive(schedule: GammaSchedule, alpha: float, c: float, steps: int, seed: int = 0, timed: bool = True) -> list:
    """Run ``steps`` steps of a synthetic generation (i.i.d. acceptance α, cost ratio c); returns the γ's asked."""
    rand = random.Random(seed)
    gammas = []
    for _ in range(steps):
        g = schedule.next()
        gammas.append(g)
        if g == 0:
            continue  # a target-only step is never fed to the schedule
        n = 0
        while n < g and rand.random() < alpha:
            n += 1
        schedule.update(g, [n], draft_time=c * g * 1e-3 if timed else 0.0, target_time=1e-3 if timed else 0.0)
    return gammas


def test_optimal_falls_back_after_min_steps_and_stays():
    s = GammaSchedule("optimal", 3, max_gamma=12)
    gammas = drive(s, alpha=0.3, c=0.9, steps=30)
    assert all(g >= 1 for g in gammas[:4]) and gammas[4:] == [0] * 26
    assert s.fallback_after == 4 and s.steps == 4
    assert s.fallback_speedup < 1.0
    # Theorem 3.8 at the estimates, less the price of the wider verify forward (the schedule's prior slope until it
    # has measured two widths): never above Theorem 3.8 itself
    theorem = max(expected_speedup(s.alpha, g, s.cost_ratio) for g in range(1, 13))
    assert theorem * 0.9 < s.fallback_speedup <= theorem
    custom = GammaSchedule("optimal", 3, max_gamma=12, min_steps=7)
    gammas = drive(custom, alpha=0.3, c=0.9, steps=10)
    assert min(gammas[:7]) >= 1 and gammas[7:] == [0, 0, 0] and custom.fallback_after == 7


def test_optimal_keeps_speculating_when_it_pays():
    s = GammaSchedule("optimal", 3, max_gamma=12)
    gammas = drive(s, alpha=0.8, c=0.05, steps=200)
    assert min(gammas) >= 1 and s.fallback_after is None and s.fallback_speedup is None
    assert gammas[-1] >= 4


def test_no_fallback_without_measured_cost_or_when_disabled():
    untimed = GammaSchedule("optimal", 3, max_gamma=12)   # c stays the prior default: not trustworthy
    assert min(drive(untimed, alpha=0.0, c=0.9, steps=20, timed=False)) >= 1 and untimed.fallback_after is None
    disabled = GammaSchedule("optimal", 3, max_gamma=12, fallback_below=0.0)
    assert min(drive(disabled, alpha=0.3, c=0.9, steps=20)) >= 1 and disabled.fallback_after is None
    with pytest.raises(ValueError, match="gamma >= 1"):
        disabled.update(0, [0])
    with pytest.raises(ValueError, match="fallback_below"):
        GammaSchedule("optimal", fallback_below=-1.0)
    with pytest.raises(ValueError, match="min_steps"):
        GammaSchedule("optimal", min_steps=0)


@pytest.mark.parametrize("kind", ["constant", "heuristic"])
def test_other_schedules_never_return_zero(kind):
    s = GammaSchedule(kind, 3, max_gamma=12, fallback_below=100.0)
    assert min(drive(s, alpha=0.0, c=5.0, steps=40)) >= 1 and s.fallback_after is None


# ------------------------------------------------------------------------------------------------ engine
PROMPTS = [[5, 17, 33, 2, 9], [7], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11], [100, 3]]


@pytest.fixture(scope="module")
def models():
    return {"target": tiny_lm(0, logit_scale=20.0), "draft": tiny_lm(1, layers=1, logit_scale=20.0)}


def count_calls(model) -> list:
    """A one-element list counting ``model``'s forward calls."""
    calls = [0]
    model.register_forward_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
    return calls


def check_stats(stats, batch: int, max_new_tokens: int, draft_forwards: int) -> None:
    """Accounting invariants of a run whose requests all decode max_new_tokens (no EOS), fallback included."""
    g = stats.gammas
    assert stats.new_tokens == batch * max_new_tokens
    assert stats.steps == stats.target_calls == len(g)
    assert stats.fallback_at_step is not None and stats.fallback_steps > 0
    assert g[stats.fallback_at_step:] == [0] * stats.fallback_steps
    assert stats.fallback_at_step + stats.fallback_steps == stats.steps
    assert min(g[:stats.fallback_at_step]) >= 1          # speculative until the fallback
    assert stats.draft_calls == sum(g) and stats.drafted == batch * sum(g)
    assert stats.accepted <= stats.tested <= stats.drafted
    assert draft_forwards == 1 + stats.draft_calls      # prefill + γ per speculative step; none after the fallback
    assert stats.mean_gamma == pytest.approx(sum(g) / len(g))
    assert stats.mean_spec_gamma == pytest.approx(sum(g) / stats.fallback_at_step)
    d = stats.to_dict()
    assert d["fallback_steps"] == stats.fallback_steps and d["fallback_at_step"] == stats.fallback_at_step


def fresh_compile():
    from tilespec.engine.decoder import release_compiled
    release_compiled()
    torch._dynamo.reset()


@pytest.mark.slow
@pytest.mark.parametrize("compile", fast_first(["debug", False], 1))
def test_forced_fallback_greedy_equals_target_only(models, compile):
    target, draft = models["target"], models["draft"]
    prompts, n = (PROMPTS, 24) if not compile else (PROMPTS[:2], 10)
    expected = SpeculativeDecoder(target, None, sampling=SamplingParams.greedy(),
                                  eos_token_id=[]).generate(prompts, max_new_tokens=n).sequences
    kwargs = dict(max_gamma=1, gamma=1) if compile else dict(max_gamma=8, gamma=4)  # few traced shapes
    # dynamo does not guard on module hooks: drop compiled runners/code so the counting hook is traced in
    fresh_compile()
    dec = SpeculativeDecoder(target, draft, gamma_schedule="optimal", fallback_below=1e9, compile=compile,
                             sampling=SamplingParams.greedy(), eos_token_id=[], **kwargs)
    calls = count_calls(draft)
    try:
        out = dec.generate(prompts, max_new_tokens=n)
    finally:
        draft._forward_hooks.clear()
        fresh_compile()
    assert out.sequences == expected
    assert out.stats.fallback_at_step == 4   # min_steps timed speculative steps, then target-only for good
    check_stats(out.stats, len(prompts), n, calls[0])
    again = dec.generate([prompts[0]], max_new_tokens=n)   # a new generation speculates again, then falls back
    assert again.sequences[0] == expected[0] and again.stats.fallback_at_step == 4


def test_slow_draft_falls_back_by_itself(models):
    """A draft with 8x the target's layers: measured c > 1, so no γ pays and the default threshold triggers."""
    target = tiny_lm(0, layers=1, logit_scale=20.0)
    slow = tiny_lm(2, layers=8, logit_scale=20.0)
    expected = SpeculativeDecoder(target, None, sampling=SamplingParams.greedy(),
                                  eos_token_id=[]).generate(PROMPTS[:2], max_new_tokens=20).sequences
    dec = SpeculativeDecoder(target, slow, gamma=3, gamma_schedule="optimal", sampling=SamplingParams.greedy(),
                             eos_token_id=[])
    out = dec.generate(PROMPTS[:2], max_new_tokens=20)
    assert out.sequences == expected
    assert out.stats.fallback_at_step == 4 and out.stats.fallback_steps == out.stats.steps - 4


def test_forced_fallback_sampling_runs(models):
    target, draft = models["target"], models["draft"]
    dec = SpeculativeDecoder(target, draft, gamma=3, gamma_schedule="optimal", max_gamma=6, fallback_below=1e9,
                             sampling=SamplingParams(temperature=1.0), eos_token_id=[])
    calls = count_calls(draft)
    try:
        out = dec.generate(PROMPTS, max_new_tokens=16, seed=7)
    finally:
        draft._forward_hooks.clear()
    assert [len(s) for s in out.sequences] == [16] * len(PROMPTS)
    assert all(0 <= t < 128 for s in out.sequences for t in s)
    check_stats(out.stats, len(PROMPTS), 16, calls[0])


def test_step_overhead_makes_the_optimal_schedule_fall_back():
    """A per-step host overhead that target-only decoding does not pay turns a predicted gain into a loss: with
    α = 0.75, c = 0.4 Theorem 3.8 predicts 1.28× at γ = 2, but 0.6 target-forwards of overhead per step give
    2.31 / (2·0.4 + 1 + 0.6) = 0.96× (on an H100 the 0.5B draft measured 0.78× where 1.06× was predicted)."""
    from tilespec.engine.gamma import GammaSchedule, best_gamma, overhead_improvement
    assert overhead_improvement(0.75, 2, 0.4, 0.0) > 1.0 > overhead_improvement(0.75, 2, 0.4, 0.6)
    assert best_gamma(0.75, 0.4, 0.0, 16)[1] > 1.0 > best_gamma(0.75, 0.4, 0.6, 16)[1]
    import random
    for with_overhead in (False, True):
        # explore_below=0: the model alone decides here (exploring to measure target-only steps is tested below)
        sched = GammaSchedule("optimal", gamma=2, max_gamma=16, explore_below=0.0)
        rng = random.Random(0)
        for step in range(60):
            g = sched.next()
            if g == 0:
                break
            n = 0                                               # i.i.d. acceptance at rate 0.75, any γ
            while n < g and rng.random() < 0.75:
                n += 1
            accepted = [n]
            kw = {"step_time": 2.5e-3 * (1 + 0.6) + g * 0.4 * 2.5e-3} if with_overhead else {}
            sched.update(g, accepted, draft_time=g * 0.4 * 2.5e-3, target_time=2.5e-3, **kw)
        assert (sched.fallback_after is not None) == with_overhead


def test_overhead_model_rejects_bad_input():
    from tilespec.engine.gamma import GammaSchedule, best_gamma, overhead_improvement
    with pytest.raises(ValueError, match="overhead must be a finite number >= 0"):
        best_gamma(0.5, 0.1, -0.2, 8)
    with pytest.raises(ValueError, match="alpha must be in"):
        overhead_improvement(1.5, 2, 0.1, 0.0)
    with pytest.raises(ValueError, match="max_gamma must be >= 1"):
        best_gamma(0.5, 0.1, 0.2, 0)
    sched = GammaSchedule("optimal", gamma=2)
    with pytest.raises(ValueError, match="step_time must be a finite number >= 0"):
        sched.update(2, [1], draft_time=1e-3, target_time=2e-3, step_time=float("nan"))


def test_fallback_steps_run_ahead_on_the_native_step_path(models):
    """After the optimal schedule's fallback the target-only steps are launched one ahead of the host read (the
    native CPU step reuses its output buffers as a replayed graph does): tokens equal target-only decoding."""
    target, draft = models["target"], models["draft"]
    expected = SpeculativeDecoder(target, None, sampling=SamplingParams.greedy(), compile="native",
                                  eos_token_id=[]).generate(PROMPTS, max_new_tokens=20).sequences
    dec = SpeculativeDecoder(target, draft, gamma=2, gamma_schedule="optimal", fallback_below=1e9, compile="native",
                             sampling=SamplingParams.greedy(), eos_token_id=[])
    for prompts, rows in ((PROMPTS[:1], expected[:1]), (PROMPTS, expected)):
        out = dec.generate(prompts, max_new_tokens=20)
        # min_steps = 4 timed steps, plus the one drafting step launched ahead of the read that decided to stop
        assert out.stats.fallback_at_step == 5 and out.stats.runtime == "native"
        assert out.sequences == rows
    # the decoder keeps the measured costs per batch size: a later generation that cannot pay even at the prior α
    # falls back before its first step instead of probing again
    again = dec.generate(PROMPTS[:1], max_new_tokens=20)
    assert again.stats.fallback_at_step == 0 and again.stats.draft_calls == 0
    assert again.sequences == expected[:1]


def test_learned_costs_and_the_measured_alpha_seed_the_next_schedule():
    first = GammaSchedule("optimal", 3, 8)
    drive(first, alpha=0.9, c=0.05, steps=6)
    state = first.cost_state()
    assert state is not None and GammaSchedule("optimal", 3, 8).cost_state() is None
    second = GammaSchedule("optimal", 3, 8)
    second.inherit_cost(state)
    assert second.cost_ratio == pytest.approx(first.cost_ratio)
    # α starts at the last generation's pooled α (same decoder: same sampling parameters), with the prior's weight
    assert second.alpha == pytest.approx(first.alpha) and second.estimator._trials == pytest.approx(3.0)
    low = GammaSchedule("optimal", 3, 8)
    drive(low, alpha=0.2, c=0.05, steps=6)
    after_low = GammaSchedule("optimal", 3, 8)
    after_low.inherit_cost(low.cost_state())
    assert after_low.alpha == pytest.approx(low.alpha) and after_low.alpha < 0.5   # not pulled back to the 0.7 prior
    assert second.next() >= 1                                # a cheap draft keeps speculating


@pytest.mark.parametrize("state", [{"_draft_time": 1.0}, [1, 2], "costs",
                                   dict.fromkeys(GammaSchedule._COST_FIELDS, float("nan")),
                                   dict.fromkeys(GammaSchedule._COST_FIELDS, -1.0)])
def test_inherit_cost_rejects_bad_states(state):
    with pytest.raises(ValueError, match="cost state"):
        GammaSchedule("optimal", 3, 8).inherit_cost(state)


def _spec_steps(sched, n, wall, tokens, alpha_accepted=1):
    for _ in range(n):
        g = sched.next()
        if g == 0:
            return False
        sched.update(g, [min(alpha_accepted, g)], draft_time=g * 1e-3, target_time=2e-3, step_time=wall)
        sched.observe_rate(g, wall, tokens)
    return True


def test_measured_rates_decide_the_fallback_and_carry_to_the_next_generation():
    """The optimal schedule times whole steps: a context drafter whose prediction is below explore_below and that
    has no target-only rate yet falls back to measure one (exploring; a draft model or head too, after min_steps
    steps of its own, for the rest of its generation); the next generation inherits both rates and falls back before
    its first step
    (and asks the decoder to skip the draft's prefill) when speculative tokens/s were lower, but speculates when
    they were higher, whatever Theorem 3.8 predicts."""
    from tilespec.engine.gamma import GammaSchedule
    for is_model in (True, False):   # a prediction below explore_below is not trusted to keep drafting
        sched = GammaSchedule("optimal", gamma=2, max_gamma=8, explore_below=100.0)
        sched.bind(model=is_model, context=not is_model)
        assert not _spec_steps(sched, 20, 2.5e-3, 3.0, alpha_accepted=2)
        assert sched.fallback_after == sched.min_steps + (not is_model) and sched.fallback_speedup > 1.0
        if is_model:   # explored: not a loss when the measured rates say drafting paid, so the next one drafts
            for _ in range(6):
                sched.observe_rate(0, 2.5e-3, 1.0, target_time=2e-3, fallback=True)
            assert sched.measured()[0] == pytest.approx(3.0)       # 3 tokens per 2.5 ms vs 1
            nxt = GammaSchedule("optimal", gamma=2, max_gamma=8)
            nxt.bind(model=True, context=False)
            nxt.inherit_cost(sched.cost_state())
            assert not nxt.falls_back_at_start and nxt.next() >= 1
    for spec_wall, expect_fallback in ((5e-3, True), (2.5e-3, False)):   # 2 tokens per step vs 1 per 2 ms
        first = GammaSchedule("optimal", gamma=2, max_gamma=8, explore_below=100.0)
        first.bind(model=False, context=True)       # a context drafter explores (it resumes after a backoff)
        first.observe_rate(2, 99.0, 2.0)            # the first step of a generation carries the prefill: ignored
        assert not _spec_steps(first, 20, spec_wall, 2.0)   # predicted below explore_below -> explore
        assert first.fallback_after is not None and first.measured_speedup() is None
        for _ in range(6):
            first.observe_rate(0, 2e-3, 1.0)        # target-only steps after the fallback: 2 ms per token
        assert abs(first.measured_speedup() - (2.0 / spec_wall) / (1 / 2e-3)) < 1e-9
        second = GammaSchedule("optimal", gamma=2, max_gamma=8)
        second.bind(model=False, context=True)
        second.inherit_cost(first.cost_state())
        assert second.falls_back_at_start == expect_fallback
        assert (second.next() == 0) == expect_fallback
        if not expect_fallback:
            assert _spec_steps(second, 30, spec_wall, 2.0) and second.fallback_after is None


def test_rates_ignore_switch_steps_and_fallback_below_zero_disables_exploring():
    from tilespec.engine.gamma import GammaSchedule
    sched = GammaSchedule("optimal", gamma=2, max_gamma=8, fallback_below=0.0)
    assert _spec_steps(sched, 30, 5e-3, 2.0) and sched.fallback_after is None
    rates = sched.cost_state()
    assert rates["rate_spec_steps"] == 29 and rates["rate_ar_steps"] == 0   # the first step is not counted
    sched.observe_rate(0, 1.0, 1.0)                 # a switch to target-only steps: not counted either
    sched.observe_rate(0, 2e-3, 1.0)
    assert sched.cost_state()["rate_ar_steps"] == 1
    old = {k: v for k, v in rates.items() if not k.startswith("rate_")}
    fresh = GammaSchedule("optimal", gamma=2, max_gamma=8)
    fresh.inherit_cost(old)                          # a cost state without rates (older decoders) still loads
    assert fresh.measured_speedup() is None        # without rates the cost model alone decides at the start
    assert fresh.falls_back_at_start == (fresh._predicted()[1] < 1.0)


def test_decoder_skips_the_draft_when_measured_rates_say_it_loses():
    """A decoder whose earlier generation measured speculation slower than target-only decoding falls back before
    the first step of the next one: the draft model is not even prefilled, and the output is the target's."""
    from engine_models import tiny_lm
    from tilespec.engine import SpeculativeDecoder
    from tilespec.engine.gamma import GammaSchedule
    from tilespec.verify import SamplingParams
    target, draft = tiny_lm(0), tiny_lm(1)
    calls = []
    draft.register_forward_pre_hook(lambda *a, **k: calls.append(1))
    slow = GammaSchedule("optimal", gamma=2, max_gamma=4)
    for _ in range(9):
        slow.observe_rate(2, 5e-3, 1.5)             # 0.3 tokens per ms speculating ...
    for _ in range(6):                               # ... against 0.5 per ms target-only
        slow.observe_rate(0, 2e-3, 1.0)
    assert slow.measured_speedup() < 1.0
    dec = SpeculativeDecoder(target, draft, gamma=2, gamma_schedule="optimal", max_gamma=4,
                             sampling=SamplingParams(temperature=0.0), compile="native", eos_token_id=-1, pad_token_id=0)
    dec._costs[1] = slow.cost_state()
    prompt = [[3, 9, 4, 1, 7]]
    out = dec.generate(prompt, max_new_tokens=12)
    ref = SpeculativeDecoder(target, None, sampling=SamplingParams(temperature=0.0), compile="native",
                             eos_token_id=-1, pad_token_id=0).generate(prompt, max_new_tokens=12)
    assert out.sequences == ref.sequences
    assert out.stats.fallback_at_step == 0 and out.stats.draft_calls == 0
    assert not calls


def test_rate_feed_skips_steps_that_compiled_or_captured():
    """A step that captured a new graph shape (ragged context drafts: one per K) carries that capture's seconds in its
    wall time; on the H100 those made n-gram / suffix + optimal measure speculation slower than it is and fall back.
    Such steps are not fed to the schedule."""
    import types
    from tilespec.engine.generation import Generation
    seen = []
    sched = types.SimpleNamespace(observe_rate=lambda g, wall, tok: seen.append((g, tok)))
    runner = types.SimpleNamespace(compile_seconds=0.0)
    gen = types.SimpleNamespace(schedule=sched, target=runner, draft=None, fast=None, compiled_seen=0.0,
                                last_read=0.0)
    Generation.feed_rate(gen, 3, [2, 4])
    runner.compile_seconds = 0.5                    # the next step captured a shape
    Generation.feed_rate(gen, 2, [1])
    Generation.feed_rate(gen, 0, [1, 1])
    assert seen == [(3, 3.0), (0, 1.0)]


def test_explore_below_rejects_negative_and_nan():
    import pytest
    from tilespec.engine.gamma import GammaSchedule
    for bad in (-0.1, float("nan")):
        with pytest.raises(ValueError, match="explore_below must be >= 0"):
            GammaSchedule("optimal", 2, 8, explore_below=bad)
    assert GammaSchedule("optimal", 2, 8, explore_below=0.0).explore_below == 0.0


def test_a_draft_model_that_lost_is_skipped_then_probed_again_with_backoff():
    """After a draft model's or head's fallback the next generation skips it, the one after probes again; each new
    loss doubles the number of skipped generations, and a probe that pays resets it."""
    from tilespec.engine.gamma import GammaSchedule

    def generation(state, accepted):
        sched = GammaSchedule("optimal", gamma=2, max_gamma=4, fallback_below=1.0)
        sched.bind(model=True, context=False)
        sched.inherit_cost(state)
        if sched.falls_back_at_start:
            for _ in range(8):
                assert sched.next() == 0 or True
                sched.observe_rate(0, 2e-3, 1.0, target_time=2e-3, fallback=True)
            return sched.cost_state(), "skipped"
        for _ in range(12):
            g = sched.next()
            if g == 0:
                sched.observe_rate(0, 2e-3, 1.0, target_time=2e-3, fallback=True)
                continue
            sched.update(g, [min(accepted, g)], draft_time=g * 1.5e-3, target_time=2e-3, step_time=2e-3 + g * 1.5e-3)
            sched.observe_rate(g, 2e-3 + g * 1.5e-3, 1.0 + min(accepted, g))
        return sched.cost_state(), "lost" if sched.fallback_after is not None else "paid"

    state, seen = None, []
    for _ in range(7):
        state, what = generation(state, accepted=0)
        seen.append(what)
    assert seen == ["lost", "skipped", "lost", "skipped", "skipped", "lost", "skipped"]
    cheap = GammaSchedule("optimal", gamma=2, max_gamma=4)
    cheap.bind(model=True, context=False)
    cheap.inherit_cost(dict(state, probe_left=0.0))
    assert not cheap.falls_back_at_start                  # the backoff is over: it probes again
