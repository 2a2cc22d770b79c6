"""Speculative steps with a draft model launched one step ahead of the host read (``SpeculativeDecoder(run_ahead=)``)
on the whole-step path, run here without capture (``compile="native"``): the same tokens, finish reasons and
counters as when every step waits for the read, with EOS and max_new_tokens inside a block, defrags, and a batch
whose rows end at different steps."""
from __future__ import annotations

import pytest
import torch

from tilespec.engine import SpeculativeDecoder
from tilespec.engine.metrics import PhaseTimer
from tilespec.engine.state import still_alive
from tilespec.verify import SamplingParams

from engine_models import layer_skip, tiny_lm
from tiers import fast_first

pytestmark = [pytest.mark.usefixtures("one_thread"), pytest.mark.slow]     # the decoder's run-ahead: -m slow

PROMPTS = [[5, 17, 33, 2, 9], [7], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11]]
SAME = ("steps", "emitted", "accepted", "drafted", "tested", "request_steps", "gammas", "defrags", "new_tokens")


@pytest.fixture(scope="module", params=[("llama", 21, 3.0), ("qwen2", 31, 2.0)], ids=["llama", "qwen2"])
def pair(request):
    family, seed, scale = request.param
    target = tiny_lm(seed, family=family, logit_scale=scale)
    return target, layer_skip(target, 1)


class Checked(SpeculativeDecoder):
    """Checks after every read that no later step was launched for that the host's W (which lags while steps run
    ahead) has caught up with the device's: graph T and the host apply the same rule (rows that ended do not count)."""

    checks = 0

    def _run_ahead(self, gen, planned):
        ahead = super()._run_ahead(gen, planned)
        self._caught_up = ahead is None
        return ahead

    def commit(self, gen, planned):
        event = super().commit(gen, planned)
        if self._caught_up and planned.committed:
            assert int(gen.fast._w) == gen.state.write
            self.checks += 1
        return event


def decode(pair, prompts, run_ahead, *, gamma=3, temperature=0.0, eos=-1, max_new_tokens=14, seed=7, drafter=None,
           **kw):
    target, draft = pair
    kw.setdefault("compile", "native")
    dec = Checked(target, drafter or draft, gamma=gamma, method="reference", run_ahead=run_ahead,
                  sampling=SamplingParams(temperature=temperature), eos_token_id=eos, pad_token_id=0, **kw)
    out = dec.generate(input_ids=prompts, max_new_tokens=max_new_tokens, seed=seed)
    assert dec.checks > 0
    return out


def assert_same(on, off, gamma):
    assert on.sequences == off.sequences and on.finish_reasons == off.finish_reasons
    for name in SAME:
        assert getattr(on.stats, name) == getattr(off.stats, name), name
    # a step launched ahead after every request had ended is computed once more and counted as forwards only
    assert on.stats.target_calls - off.stats.target_calls in (0, 1)
    assert on.stats.draft_calls - off.stats.draft_calls in (0, gamma)
    assert off.stats.ahead_steps == 0


def eos_inside(pair, prompts, temperature, gamma):
    """An EOS id that the last request emits a third of the way through its output and, if possible, no other
    request emits at all (those then end by length)."""
    free = decode(pair, prompts, False, gamma=gamma, temperature=temperature).sequences
    seq, others = free[-1], {t for s in free[:-1] for t in s}
    tail = seq[len(seq) // 3:]
    return next((t for t in tail if t not in others), tail[0])


@pytest.mark.parametrize("temperature", [0.0, 1.0])
@pytest.mark.parametrize("gamma", fast_first([3, 1, 5], 1))
@pytest.mark.parametrize("batch", [1, 3])
def test_run_ahead_equals_waiting(pair, temperature, gamma, batch):
    prompts = PROMPTS[:batch]
    for eos in (-1, eos_inside(pair, prompts, temperature, gamma)):
        off = decode(pair, prompts, False, gamma=gamma, temperature=temperature, eos=eos)
        on = decode(pair, prompts, True, gamma=gamma, temperature=temperature, eos=eos)
        assert_same(on, off, gamma)
        assert on.stats.ahead_steps > 0
        for seq, reason in zip(on.sequences, on.finish_reasons):
            assert len(seq) <= 14 and (eos not in seq[:-1])
            assert (reason == "eos") == (seq[-1:] == [eos])


def test_length_and_eos_inside_blocks_are_exercised(pair):
    """The cases above do cut blocks short: tokens after max_new_tokens / EOS were computed and dropped."""
    eos = eos_inside(pair, PROMPTS, 1.0, 5)
    out = decode(pair, PROMPTS, True, gamma=5, temperature=1.0, eos=eos)
    assert "eos" in out.finish_reasons and "length" in out.finish_reasons
    assert out.stats.emitted > out.stats.new_tokens
    assert out.stats.ahead_steps > 0


def test_run_ahead_greedy_equals_transformers_generate(pair):
    target, _ = pair
    out = decode(pair, PROMPTS, True, gamma=3, max_new_tokens=16)
    assert out.stats.ahead_steps > 0
    for prompt, seq in zip(PROMPTS, out.sequences):
        ref = target.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                              max_new_tokens=16, do_sample=False, pad_token_id=0)
        assert seq == ref[0, len(prompt):].tolist()


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_run_ahead_near_capacity_defragments_identically(pair, temperature):
    """Long prompts fill most of the (256-rounded) cache, so ragged acceptance forces defrags; steps that could
    overflow wait for the read and defragment then, exactly as without run-ahead."""
    prompts = [list(range(1, 120)), list(range(3, 127)), [9] * 110]
    off = decode(pair, prompts, False, gamma=3, temperature=temperature, max_new_tokens=120, cache_slack=0)
    on = decode(pair, prompts, True, gamma=3, temperature=temperature, max_new_tokens=120, cache_slack=0)
    assert_same(on, off, 3)
    assert on.stats.defrags >= 1
    assert 0 < on.stats.ahead_steps < on.stats.steps - 1      # the capacity bound held some steps back


def test_heuristic_schedule_and_context_drafters_wait_for_the_read(pair):
    """γ of the heuristic schedule depends on the unread step, a context drafter needs its tokens: no speculative
    step runs ahead, and the outputs are those of run_ahead=False."""
    _, draft = pair
    prompts = [[5, 6, 7, 8, 5, 6, 7, 8, 5, 6], [9, 10, 9, 10, 9], [3, 4]]     # the n-gram drafter finds matches
    eos = eos_inside(pair, prompts, 1.0, 2)
    for kw in (dict(gamma_schedule="heuristic"), dict(drafter="ngram"), dict(drafter=[draft, "ngram"])):
        off, on = (decode(pair, prompts, ra, gamma=2, temperature=1.0, eos=eos, **kw) for ra in (False, True))
        assert on.sequences == off.sequences and on.finish_reasons == off.finish_reasons
        assert on.stats.ahead_steps == 0


def test_optimal_schedule_runs_ahead_with_a_gamma_one_step_older(pair):
    """``optimal`` decides γ from the steps read so far and launches the next drafting step ahead of the read
    (fixed_gamma): greedy outputs stay the target's own (every γ gives them), the run-ahead steps are counted, and
    with run_ahead=False the same schedule waits for every read."""
    target, _ = pair
    reference = SpeculativeDecoder(target, None, sampling=SamplingParams(temperature=0.0), eos_token_id=-1,
                                   pad_token_id=0, compile="native").generate(input_ids=PROMPTS, max_new_tokens=14)
    for run_ahead in (True, False):
        out = decode(pair, PROMPTS, run_ahead, gamma=2, gamma_schedule="optimal", fallback_below=0)
        assert out.sequences == reference.sequences
        assert out.stats.fallback_steps == 0 and sum(out.stats.gammas) > 0
        assert (out.stats.ahead_steps > 0) == run_ahead


def test_optimal_run_ahead_pins_the_gamma_it_announced():
    """fixed_gamma() pins the γ it returns for the next next(), repeats it until then, and is None for the
    heuristic schedule, before the first recorded step, for context drafters and after a fallback."""
    from tilespec.engine.gamma import GammaSchedule
    sched = GammaSchedule("optimal", gamma=3, max_gamma=8, fallback_below=0)
    assert sched.fixed_gamma() is None                       # nothing recorded yet: wait for the read
    g = sched.next()
    sched.update(g, [g], draft_time=1e-4, target_time=2e-3, step_time=2.5e-3)
    pinned = sched.fixed_gamma()
    assert pinned is not None and pinned >= 1 and sched.fixed_gamma() == pinned
    assert sched.next() == pinned and sched._pinned is None
    assert GammaSchedule("heuristic", gamma=3, max_gamma=8).fixed_gamma() is None
    ctx = GammaSchedule("optimal", gamma=3, max_gamma=8)
    ctx.bind(model=False, context=True)
    ctx.update(3, [3], draft_time=1e-4, target_time=2e-3)
    assert ctx.fixed_gamma() is None
    sched._fall_back(0.5)
    assert sched.fixed_gamma() is None


def test_target_only_run_ahead_and_the_opt_out(pair, monkeypatch):
    target, _ = pair
    kw = dict(sampling=SamplingParams(temperature=0.0), eos_token_id=-1, pad_token_id=0, compile="native")
    on = SpeculativeDecoder(target, None, **kw).generate(input_ids=PROMPTS, max_new_tokens=8)
    off = SpeculativeDecoder(target, None, run_ahead=False, **kw).generate(input_ids=PROMPTS, max_new_tokens=8)
    assert on.sequences == off.sequences and on.stats.ahead_steps == 7 and off.stats.ahead_steps == 0
    monkeypatch.setenv("TILESPEC_RUN_AHEAD", "0")
    assert not SpeculativeDecoder(target, None, **kw).run_ahead
    monkeypatch.setenv("TILESPEC_RUN_AHEAD", "1")
    assert SpeculativeDecoder(target, None, **kw).run_ahead


def test_still_alive_is_the_hosts_rule():
    alive = torch.tensor([True, True, True, True, False])
    seq_len = torch.tensor([5, 5, 5, 5, 5])
    limit = torch.tensor([20, 20, 8, 20, 20])
    eos = torch.tensor([-1, 42])                            # -1 also pads output_tokens: padding must not count
    out = torch.tensor([[3, 4, -1], [3, 42, -1], [3, 4, 6], [3, 4, 42], [42, 1, 2]])
    n = torch.tensor([2, 2, 3, 2, 3])                        # row 3's EOS lies past its emitted tokens
    assert still_alive(alive, seq_len, limit, eos, n, out).tolist() == [True, False, False, True, False]
    assert still_alive(alive, seq_len, limit, eos[:0], n, out).tolist() == [True, True, False, True, False]


def test_phase_timer_between_marks():
    timer = PhaseTimer(torch.device("cpu"))
    timer.start("draft"), timer.stop("draft")
    a = timer.mark()
    timer.start("target"), timer.stop("target")
    timer.start("draft"), timer.stop("draft")
    b = timer.mark()
    timer.start("target"), timer.stop("target")
    log = [dt for _, dt in timer._log]
    spent = timer.between(a, b)
    assert spent["target"] == log[1] and spent["draft"] == log[2] and spent["verify"] == 0.0
    assert timer.resolve()["target"] == pytest.approx(log[1] + log[3])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_run_ahead_speculative_on_cuda_graphs(temperature):
    """On CUDA graphs a step launched ahead reads W from the previous graph T and its predecessor's tokens from the
    pinned copy taken before it: every token equals the eager native path's, with EOS inside a block, one request
    and a batch, run-ahead on and off."""
    target = tiny_lm(21, logit_scale=3.0).cuda()
    pair = (target, layer_skip(target, 1).cuda())
    eos = eos_inside(pair, PROMPTS, temperature, 3)
    for prompts in (PROMPTS[:1], PROMPTS):
        ref = decode(pair, prompts, False, temperature=temperature, eos=eos, max_new_tokens=24)
        for run_ahead in (False, True):
            out = decode(pair, prompts, run_ahead, temperature=temperature, eos=eos, max_new_tokens=24,
                         compile=True)
            assert out.stats.runtime == "native-graphs" and (out.stats.ahead_steps > 0) == run_ahead
            assert out.sequences == ref.sequences and out.finish_reasons == ref.finish_reasons
