"""Context drafters (ngram, suffix, with a model fallback) in the engine: proposals, greedy equality with
target-only decoding, the sequence law at T > 0, and the decode loop's per-generation state and injection points."""
from __future__ import annotations

import itertools
from collections import Counter

import numpy as np
import pytest
import torch

from tilespec.engine import GammaSchedule, NgramDrafter, SpeculativeDecoder, SuffixDrafter
from tilespec.engine.drafters import resolve_drafter
from tilespec.engine.drafters.ngram import CATCH_UP
from tilespec.exactness.stats import fit_test
from tilespec.verify import SamplingParams

from engine_models import exact_sequence_law, layer_skip, tiny_lm

pytestmark = pytest.mark.usefixtures("one_thread")
GREEDY = SamplingParams(temperature=0.0)


# ------------------------------------------------------------------------------------------------ proposals
def test_ngram_proposes_what_followed_the_most_recent_longest_match():
    state = NgramDrafter(n_min=1, n_max=3, tokens_per_match=10).start([[7, 1, 2, 3, 9, 1, 2, 4, 5, 1, 2]])
    assert state.match(0) == (2, 7)                  # [1, 2] last seen ending at index 7 (followed by 4)
    assert state.propose(0, 3) == [4, 5, 1]
    state.extend(0, [4])                             # history ... 1 2 4: the 3-gram [1, 2, 4] occurred before
    assert state.match(0)[0] == 3 and state.propose(0, 2) == [5, 1]
    assert NgramDrafter(n_min=2).start([[1, 2, 3]]).propose(0, 4) == []      # no repeated bigram: no draft


def _lookup(hist, n_min, n_max):
    """The longest suffix n-gram's most recent earlier occurrence, by scanning the history."""
    for n in range(min(n_max, len(hist) - 1), n_min - 1, -1):
        for end in range(len(hist) - 1, n - 1, -1):
            if hist[end - n:end] == hist[len(hist) - n:]:
                return n, end
    return 0, -1


def test_ngram_index_kept_lazily_matches_a_scan_of_the_history():
    """Appends only store tokens; a lookup asked steadily indexes (at most CATCH_UP positions of) what came since the
    last one, any other scans the history: with lookups after every append (also behind a prompt longer than
    CATCH_UP), after runs of appends (the draft gate off) or never until the end, every proposal is the eager one."""
    rng = np.random.default_rng(0)
    for every, prompt in ((1, 5), (1, 3 * CATCH_UP), (3, 5), (50, 5)):
        hist = [int(t) for t in rng.integers(0, 6, prompt)]
        state = NgramDrafter(n_min=1, n_max=4, tokens_per_match=2).start([hist])
        for i in range(300):
            new = [int(t) for t in rng.integers(0, 6, int(rng.integers(1, 5)))]
            state.extend(0, new)
            hist += new
            if i % every == 0:
                n, end = _lookup(hist, 1, 4)
                assert state.propose(0, 3) == (hist[end:end + min(3, 2 * n)] if n else [])
        assert state.match(0) == _lookup(hist, 1, 4)
    big = NgramDrafter(n_min=2, n_max=3).start([[150_000, 7, 9, 150_000, 7]])        # ids far above 2**16
    assert big.propose(0, 4) == [9, 150_000, 7]


class _EagerSuffix:
    """The suffix drafter's proposals from an index kept at every append (what SuffixState replaced)."""

    def __init__(self, d, prompt):
        self.d, self.hist, self.index = d, [], [{} for _ in range(d.n_max + 1)]
        self.extend(prompt)

    def extend(self, tokens):
        for t in tokens:
            for n in range(self.d.n_min, min(self.d.n_max, len(self.hist)) + 1):
                self.index[n].setdefault(tuple(self.hist[len(self.hist) - n:]), Counter())[t] += 1
            self.hist.append(t)

    def propose(self, cap):
        ctx, first, out = self.hist[-self.d.n_max:], 0, []
        while len(out) < cap:
            for n in range(min(self.d.n_max, len(ctx)), self.d.n_min - 1, -1):
                gram = tuple(ctx[len(ctx) - n:])
                local, shared = self.index[n].get(gram), self.d.shared[n].get(gram) if self.d.remember else None
                if local or shared:
                    counts = (local or Counter()) + (shared or Counter())
                    break
            else:
                break
            if not out:
                first, cap = n, min(cap, n * self.d.tokens_per_match)
            token, count = counts.most_common(1)[0]
            if count < self.d.min_share * sum(counts.values()):
                break
            out.append(token)
            ctx = ctx[1:] + [token] if len(ctx) >= self.d.n_max else ctx + [token]
        return out if first else []


def test_suffix_scanned_at_proposals_matches_an_eager_index():
    """SuffixState keeps no index (each proposal scans the history): on random streams, asked at random intervals,
    with and without remembered generations, its proposals are the eager index's, ties and min_share included."""
    rng = np.random.default_rng(1)
    for trial in range(60):
        vocab = int(rng.choice([2, 3, 6, 20]))
        n_min = int(rng.integers(1, 3))
        d = SuffixDrafter(n_min=n_min, n_max=int(rng.integers(n_min, 8)), min_share=float(rng.choice([0, 0.1, 0.5])),
                          remember=bool(trial % 2), tokens_per_match=int(rng.integers(1, 4)))
        if d.remember:
            old = d.start([rng.integers(0, vocab, 20).tolist()])
            old.extend(0, rng.integers(0, vocab, 30).tolist())
            old.close()
        prompt = rng.integers(0, vocab, int(rng.integers(1, 30))).tolist()
        state, eager = d.start([prompt]), _EagerSuffix(d, prompt)
        for _ in range(40):
            new = rng.integers(0, vocab, int(rng.integers(1, 5))).tolist()
            state.extend(0, new)
            eager.extend(new)
            if rng.random() < 0.5:
                cap = int(rng.integers(1, 8))
                assert state.propose(0, cap) == eager.propose(cap)


def test_ngram_draft_length_grows_with_the_match_length():
    prompt = [5, 1, 2, 3, 4, 6, 7, 8, 9, 5]
    short = NgramDrafter(n_min=1, n_max=4, tokens_per_match=2).start([prompt])
    assert short.propose(0, 8) == [1, 2]              # a 1-token match proposes at most 2 tokens
    long = NgramDrafter(n_min=1, n_max=4, tokens_per_match=2).start([[8, 9] + prompt[:-1] + [8, 9, 5]])
    assert long.match(0)[0] == 3 and long.propose(0, 8) == [1, 2, 3, 4, 6, 7]   # a 3-token match: up to 6


def test_suffix_follows_the_most_frequent_continuation():
    state = SuffixDrafter(n_min=1, n_max=2, tokens_per_match=8).start([[3, 1, 3, 1, 3, 2, 3]])
    assert state.propose(0, 3) == [1, 3, 1]           # after 3: "1" twice, "2" once
    remembered = SuffixDrafter(remember=True)
    first = remembered.start([[10]])
    first.extend(0, [11, 12, 13])
    first.close()                                     # its output is now in the shared index
    assert remembered.start([[11]]).propose(0, 2) == [12, 13]
    assert SuffixDrafter().start([[11]]).propose(0, 2) == []


def test_resolve_drafter_forms_and_errors():
    target = tiny_lm(0)
    assert resolve_drafter(None) is None
    assert resolve_drafter(target).model is target
    assert resolve_drafter("suffix").name == "suffix"
    combo = resolve_drafter(["ngram", target])
    assert isinstance(combo, NgramDrafter) and combo.model is target and combo.name.endswith("+ngram")
    with pytest.raises(ValueError, match="unknown drafter 'trigram'"):
        resolve_drafter("trigram")
    with pytest.raises(ValueError, match="one model and one context drafter"):
        resolve_drafter([target, target])
    with pytest.raises(ValueError, match="n_min <= n_max"):
        NgramDrafter(n_min=3, n_max=2)


# ------------------------------------------------------------------------------------------------ greedy equality
PROMPTS = [[5, 6, 7, 8, 9, 10, 5, 6, 7, 8], [1, 2, 3, 1, 2], [40, 41, 42, 43]]


@pytest.mark.parametrize("draft", ["ngram", "suffix", "combo"])
def test_greedy_context_drafts_equal_target_only(draft):
    target = tiny_lm(3, logit_scale=8.0)
    spec = [layer_skip(target, 1), "ngram"] if draft == "combo" else draft
    ref = SpeculativeDecoder(target, None, sampling=GREEDY).generate(PROMPTS, max_new_tokens=40)
    for prompts in (PROMPTS, PROMPTS[:1]):
        out = SpeculativeDecoder(target, spec, gamma=4, sampling=GREEDY).generate(prompts, max_new_tokens=40)
        assert out.sequences == ref.sequences[:len(prompts)]
        assert out.stats.drafted > 0 and out.stats.context_steps > 0 and 0 < out.stats.match_share <= 1
        assert out.stats.drafter == SpeculativeDecoder(target, spec).drafter.name


def test_greedy_context_drafts_equal_target_only_with_eos_and_schedules():
    target = tiny_lm(4, logit_scale=8.0)
    ref = SpeculativeDecoder(target, None, sampling=GREEDY).generate(PROMPTS, max_new_tokens=30)
    eos = ref.sequences[1][7]                          # a token request 1 emits: it must stop there
    ref = SpeculativeDecoder(target, None, sampling=GREEDY, eos_token_id=eos).generate(PROMPTS, max_new_tokens=30)
    for schedule in ("heuristic", "optimal"):
        dec = SpeculativeDecoder(target, "ngram", gamma=3, gamma_schedule=schedule, sampling=GREEDY, eos_token_id=eos)
        out = dec.generate(PROMPTS, max_new_tokens=30)
        assert out.sequences == ref.sequences and out.finish_reasons == ref.finish_reasons


# ------------------------------------------------------------------------------------------------ sequence law, T > 0
VOCAB, LENGTH, N = 6, 3, 6000
LAW_PROMPT = [1, 4, 2, 1, 4, 3, 5, 1, 4]


def exact_law(model, sampling: SamplingParams) -> np.ndarray:
    return exact_sequence_law(model, sampling, LAW_PROMPT, VOCAB, LENGTH)


@pytest.mark.parametrize("draft,sampling", [
    ("ngram", SamplingParams(temperature=1.0)),
    ("suffix", SamplingParams(temperature=0.8, top_k=4)),
    ("combo", SamplingParams(temperature=1.0)),
])
def test_context_drafted_sequences_follow_target_law(draft, sampling):
    target = tiny_lm(10, vocab=VOCAB, logit_scale=20.0)
    spec = [tiny_lm(11, vocab=VOCAB, layers=1, logit_scale=20.0), "ngram"] if draft == "combo" else draft
    dec = SpeculativeDecoder(target, spec, gamma=2, sampling=sampling, eos_token_id=[])
    out = dec.generate([LAW_PROMPT] * N, max_new_tokens=LENGTH, seed=2024)
    s = out.stats
    assert 200 < s.accepted < s.drafted - 200 and s.match_share > 0.3      # accepts and rejects, drafts often
    index = [int(np.ravel_multi_index(s, [VOCAB] * LENGTH)) for s in out.sequences]
    result = fit_test(np.bincount(index, minlength=VOCAB ** LENGTH), exact_law(target, sampling))
    assert result.impossible == 0
    assert result.p_value > 1e-6, result


# ------------------------------------------------------------------------------------------------ decode loop
def test_two_streams_on_one_decoder_do_not_share_results():
    target = tiny_lm(5, logit_scale=8.0)
    dec = SpeculativeDecoder(target, "ngram", gamma=3, sampling=GREEDY)
    alone = [dec.generate([p], max_new_tokens=12).sequences[0] for p in PROMPTS[:2]]
    streams = [dec.stream([p], max_new_tokens=12) for p in PROMPTS[:2]]
    got = [[], []]
    for events in itertools.zip_longest(*streams):
        for k, event in enumerate(events):
            if event is not None:
                got[k] += event.tokens.get(0, [])
    assert got == alone
    gen = dec.prefill([PROMPTS[0]], max_new_tokens=5)      # the split loop, driven by hand
    while not gen.finished:
        dec.commit(gen, dec.step(gen))
    assert dec.finish(gen).sequences[0] == alone[0][:5]


def test_schedule_and_verify_hook_are_injected_through_the_constructor():
    from tilespec.engine import step

    target = tiny_lm(6, logit_scale=8.0)
    calls, made = [], []

    def schedule(*args, **kwargs):
        made.append(args)
        return GammaSchedule(*args, **kwargs)

    def verify_fn(*args, **kwargs):
        calls.append(int(args[1].shape[1]))
        return step.run_verify(*args, **kwargs)

    dec = SpeculativeDecoder(target, layer_skip(target, 1), gamma=2, sampling=SamplingParams(temperature=1.0),
                             schedule=schedule, verify_fn=verify_fn)
    out = dec.generate(PROMPTS[:1], max_new_tokens=10)
    assert made == [("constant", 2, 16)] and len(calls) == out.stats.steps and set(calls) <= {0, 1, 2}
    warm = dec.warmup(prompt_len=6, max_new_tokens=3)
    assert warm.requests == 1 and 1 <= warm.new_tokens <= 3
    with pytest.raises(TypeError, match="schedule must be a factory"):
        SpeculativeDecoder(target, None, schedule=3)


# ------------------------------------------------------------------------------------------------ GPU (-m gpu)
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("draft", ["ngram", "suffix", "combo"])
@pytest.mark.parametrize("method,temperature", [("reference", 0.0), ("fused", 0.0), ("fused", 1.0)])
def test_context_drafts_on_the_gpu_paths(draft, method, temperature):
    """CUDA graphs give the eager engine's tokens; greedy drafts on every runtime give target-only tokens."""
    target = tiny_lm(3, logit_scale=8.0).cuda()
    spec = [layer_skip(target, 1).cuda(), "ngram"] if draft == "combo" else draft
    outs = {}
    for mode in (False, "graphs", "native"):
        sampling = SamplingParams(temperature=temperature)
        out = SpeculativeDecoder(target, spec, gamma=4, method=method, eos_token_id=[], compile=mode,
                                 sampling=sampling).generate(PROMPTS, max_new_tokens=24, seed=5)
        assert out.stats.context_steps > 0
        outs[mode] = out.sequences
        if temperature == 0:
            base = SpeculativeDecoder(target, None, sampling=sampling, eos_token_id=[], compile=mode)
            assert out.sequences == base.generate(PROMPTS, max_new_tokens=24).sequences, mode
    assert outs[False] == outs["graphs"]


def test_an_injected_schedule_gets_the_protocols_defaults():
    """A schedule with only next() / update() runs through every hook of the protocol (engine/gamma.py)."""
    from tilespec.engine.gamma import ScheduleHooks, as_schedule

    class Plain:
        kind = "plain"

        def __init__(self):
            self.updates = 0

        def next(self):
            return 2

        def update(self, *args, **kwargs):
            self.updates += 1

    plain = Plain()
    hooked = as_schedule(plain)
    assert isinstance(hooked, ScheduleHooks) and hooked.kind == "plain"
    assert not hooked.wants_step_time and hooked.fixed_gamma() is None and hooked.cost_state() is None
    assert hooked.select_drafts([[1]], [0]) == [[1]]
    target = tiny_lm(6, logit_scale=8.0)
    dec = SpeculativeDecoder(target, "ngram", gamma=2, sampling=GREEDY, schedule=lambda *a, **k: plain)
    ref = SpeculativeDecoder(target, None, sampling=GREEDY).generate(PROMPTS[:2], max_new_tokens=8).sequences
    assert dec.generate(PROMPTS[:2], max_new_tokens=8).sequences == ref and plain.updates > 0
    with pytest.raises(TypeError, match="next"):
        as_schedule(object())
