"""Draft pricing on the paged engine (engine/paged/pricing.py): the planner keeps drafts where they are nearly free
and none where every token costs, step costs learn from served steps, acceptance by depth; on the engine the
priced and padded (fixed-shape) steps change no greedy token, and measured costs decide whether it drafts."""
from __future__ import annotations

import pytest

from tilespec.engine.batching import BatchRequest
from tilespec.engine.paged.engine import PagedEngine
from tilespec.engine.paged.pricing import (PRICED_AFTER, Acceptance, DraftGate, StepCosts, plan, token_bucket,
                                          token_buckets)
from tilespec.engine.paged.warmup import decode_shapes, scratch_decode

import test_paged_engine
from test_paged_engine import PROMPTS, _run

target = test_paged_engine.target      # the paged tests' tiny model (a module fixture)


def costs_of(rows: int, gamma: int, per_token: float, fixed: float = 1.0, free_up_to: int = 0) -> StepCosts:
    """Seeds for every decode shape of ``rows``: ``fixed`` + ``per_token`` per token beyond ``free_up_to``."""
    costs = StepCosts()
    for total, wide in decode_shapes(rows, gamma):
        costs.seed((rows, total, wide), fixed + per_token * max(0, total - max(rows, free_up_to)))
    return costs


def test_token_buckets_hold_every_ragged_total():
    for rows in (1, 3, 16, 64, 256):
        buckets = token_buckets(rows, 4)
        assert buckets[0] == rows and buckets[-1] == rows * 5 and list(buckets) == sorted(set(buckets))
        for tokens in range(rows, rows * 5 + 1):
            b = token_bucket(rows, tokens, 4)
            assert b in buckets and b >= tokens
    assert token_buckets(8, 0) == (8,)


def test_free_drafts_are_all_verified():
    chains = [[0.5, 0.3, 0.2, 0.1]] * 4 + [[]] * 4        # 8 requests, half of them offer 4 drafts
    ks, shape = plan(8, chains, costs_of(8, 4, per_token=0.0), 4)
    assert ks == [4] * 4 + [0] * 4 and shape[2] and shape[1] >= 8 + 16


def test_costly_tokens_buy_no_draft():
    """Every token costs as much as a row's pending token: no draft below acceptance 1 can pay."""
    chains = [[0.9, 0.8, 0.7, 0.6]] * 8
    ks, shape = plan(8, chains, costs_of(8, 4, per_token=1 / 8, fixed=1.0), 4)
    assert ks == [0] * 8 and shape == (8, 8, False)


def test_cheap_room_goes_to_the_likeliest_drafts():
    """Tokens are free up to 2 x rows, then dear: the step fills that room with the highest chain probabilities."""
    rows = 16
    chains = [[0.9, 0.8, 0.6, 0.5] if i % 2 else [0.3, 0.1] for i in range(rows)]
    ks, shape = plan(rows, chains, costs_of(rows, 4, per_token=1.0, free_up_to=2 * rows), 4)
    assert shape == (rows, 2 * rows, True) and sum(ks) == rows
    assert all(k == 2 for k in ks[1::2]) and all(k == 0 for k in ks[0::2])     # 0.9 and 0.8 before any 0.6 / 0.3


def test_absent_rows_leave_room_for_drafts_at_no_token_bucket():
    """3 requests in a rows bucket of 4: one draft fits the absent row's place, so T stays 4."""
    costs = StepCosts()
    costs.seed((4, 4, False), 1.0)
    costs.seed((4, 4, True), 1.0)
    for t in token_buckets(4, 4)[1:]:
        costs.seed((4, t, True), 5.0)
    ks, shape = plan(4, [[0.9, 0.5], [0.2], []], costs, 4)
    assert shape == (4, 4, True) and ks == [1, 0, 0]


def test_step_costs_learn_from_served_steps():
    costs = StepCosts(decay=0.5)
    assert costs.estimate((4, 8, True)) is None
    costs.seed((4, 4, False), 1.0)
    costs.seed((4, 8, True), 1.2)
    costs.observe((4, 4, False), 1.5)            # served steps cost 0.5 s more than the graph alone
    assert costs.estimate((4, 4, False)) == pytest.approx(1.5)
    assert costs.estimate((4, 8, True)) == pytest.approx(1.7)      # borrows the rows' excess
    costs.observe((4, 4, False), 100.0)          # a stall: clipped at 2x the estimate
    assert costs.estimate((4, 4, False)) == pytest.approx(1.0 + 0.5 * 0.5 + 0.5 * 2.0)
    bare = StepCosts()                           # no seeds (CPU): the dearest sampled shape below stands in
    bare.observe((2, 2, False), 0.01)
    assert bare.estimate((2, 6, True)) == pytest.approx(0.01) and bare.estimate((4, 4, False)) is None


def test_acceptance_by_depth_follows_the_request():
    acc = Acceptance(4, start=0.5, prior=2.0, decay=1.0, idle_decay=1.0)
    own = acc.new_request()
    fresh = acc.chain(own, 4)
    assert fresh == sorted(fresh, reverse=True) and fresh[0] == pytest.approx(0.5)
    for step in range(20):
        acc.observe(own, 4, 4, step)             # everything accepted
    good = acc.chain(own, 4, 20)
    assert all(c > 0.85 for c in good) and good == sorted(good, reverse=True)
    other = acc.new_request()
    for step in range(20):
        acc.observe(other, 4, 0, step)           # nothing accepted
    assert acc.chain(other, 4, 20)[0] < 0.15
    assert len(acc.chain(other, 2, 20)) == 2


def test_a_request_priced_out_is_tried_again_as_its_evidence_ages():
    acc = Acceptance(2, start=0.6, decay=0.8, idle_decay=0.9)
    own = acc.new_request()
    for step in range(10):
        acc.observe(own, 2, 0, step)
    low = acc.chain(own, 1, 10)[0]
    later = acc.chain(own, 1, 60)[0]
    assert low < 0.2 and later > 2 * low


# ------------------------------------------------------------------------------------------------- on the engine
@pytest.fixture(scope="module")
def greedy_reference(target):
    engine = PagedEngine(target, None, max_batch=3, block_size=4, token_budget=16)
    reqs = [BatchRequest(prompt=p, max_tokens=12, temperature=0.0) for p in PROMPTS]
    _run(engine, reqs)
    return [r.tokens for r in reqs]


@pytest.mark.parametrize("draft", ["ngram", "suffix"])
@pytest.mark.parametrize("fixed", [False, True])
def test_priced_ragged_steps_change_no_greedy_token(target, greedy_reference, draft, fixed):
    """Pricing on, decode steps ragged, and (``fixed``) padded to their (rows, token) bucket as graphs replay them:
    absent rows, padding tokens on the scratch block, logit rows repeated."""
    engine = PagedEngine(target, draft, max_batch=3, gamma=3, block_size=4, token_budget=16)
    engine.fixed_shapes, engine.gate = fixed, None      # the draft gate times the wall clock: tested on its own
    for rows in (1, 2, 4):                        # drafts priced as nearly free (wall times on a busy CPU vary)
        for total, wide in decode_shapes(rows, 3):
            engine.costs.seed((rows, total, wide), 1.0 + 1e-3 * (total - rows))
    reqs = [BatchRequest(prompt=p, max_tokens=12, temperature=0.0) for p in PROMPTS]
    _run(engine, reqs)
    assert [r.tokens for r in reqs] == greedy_reference
    assert engine.counters["accepted"] > 0 and engine.blocks.num_free == engine.blocks.num_blocks - 1
    assert engine.costs.samples                   # served decode steps were measured


@pytest.mark.parametrize("dear", [False, True])
def test_measured_costs_decide_whether_the_engine_drafts(target, greedy_reference, dear):
    """Costs seeded for every shape and never updated: drafts cost nothing (``dear`` False: the engine drafts) or
    a wide step, and each token in it, cost a whole step (it drafts nothing); the tokens are the same either way."""
    engine = PagedEngine(target, "ngram", max_batch=3, gamma=3, block_size=4, token_budget=16)
    engine.gate = None                                  # the draft gate times the wall clock: tested on its own
    for rows in (1, 2, 4):
        for total, wide in decode_shapes(rows, 3):
            engine.costs.seed((rows, total, wide), 1.0 + (total - rows + wide if dear else 0))
    engine.costs.observe = lambda shape, seconds: None
    reqs = [BatchRequest(prompt=p, max_tokens=12, temperature=0.0) for p in PROMPTS]
    _run(engine, reqs)
    assert [r.tokens for r in reqs] == greedy_reference
    decode_drafted = engine.counters["drafted"]
    assert (decode_drafted == 0) if dear else (decode_drafted > 0)


def test_the_draft_gate_runs_the_faster_branch_and_explores_the_other():
    gate = DraftGate(explore=4, max_explore=32, stretch=2, share=1.0)    # share 1: explorations priced out below
    assert [gate.drafting(8), gate.drafting(8)] == [True, True]     # a new bucket drafts for a stretch ...
    gate.observe(8, True, 30, 1.0)
    gate.observe(8, True, 30, 1.0)
    assert [gate.drafting(8), gate.drafting(8)] == [False, False]   # ... then measures without
    gate.observe(8, False, 10, 1.0)
    assert gate.drafting(8, explore=False) is True and gate.steps[8] == 4    # a mixed step: the winner, uncounted,
    gate.rate.update({(64, True): 1.0, (64, False): 2.0})
    assert gate.drafting(48, explore=False) is False and 48 not in gate.steps  # the nearest measured bucket's
    assert DraftGate().drafting(8, explore=False) is True                     # ... optimistic before any rate
    picks = [gate.drafting(8) for _ in range(14)]     # drafting is faster: off for a stretch at the 4th step, then
    assert picks == [True] * 3 + [False] * 2 + [True] * 7 + [False] * 2      # 8 steps later
    for _ in range(40):                               # drafting stops paying (it got slower): the gate follows,
        gate.observe(8, True, 5, 1.0)                 # exploring every 4th step again
    assert [gate.drafting(8) for _ in range(14)] == [False] * 3 + [True] * 2 + [False] * 7 + [True] * 2
    for _ in range(200):                              # while the winner holds, explorations thin out (to 32 here)
        gate.drafting(8)
    assert gate.every[8] == 32 and sum(gate.drafting(8) for _ in range(64)) == 2 * 2
    assert gate.drafting(16) is True                  # buckets are independent
    with pytest.raises(ValueError, match="explore"):
        DraftGate(explore=1)
    with pytest.raises(ValueError, match="stretch"):
        DraftGate(explore=4, stretch=4)


def test_explorations_cost_at_most_their_share_of_the_tokens():
    """A loser at a quarter of the winner's rate: each 8-step stretch of it gives up 6 steps' tokens, so at a 2 %
    share the gate waits 8 x 0.75 / 0.02 = 300 steps between stretches, beyond the doubling's cap; a loser at 0.99
    of the winner's rate costs little, and the doubling rules."""
    gate = DraftGate(explore=16, max_explore=256, stretch=8, share=0.02)
    gate.rate.update({(64, True): 1.0, (64, False): 4.0})
    gate.steps[64], gate.best[64], gate.explored[64] = 1, False, PRICED_AFTER    # past the first explorations
    picks = [gate.drafting(64) for _ in range(16 + 8 + 300 + 8)]
    drafting = [i for i, p in enumerate(picks) if p]
    assert drafting == list(range(15, 23)) + list(range(22 + 300, 22 + 300 + 8))
    near = DraftGate(explore=16, max_explore=256, stretch=8, share=0.02)
    near.rate.update({(64, True): 0.99, (64, False): 1.0})
    near.steps[64] = 1
    picks = [near.drafting(64) for _ in range(16 + 8 + 32)]
    assert [i for i, p in enumerate(picks) if p] == list(range(15, 23)) + [22 + 32, 22 + 33]    # every 32: doubled
    with pytest.raises(ValueError, match="share"):
        DraftGate(share=0)


def test_the_draft_gate_weighs_steps_by_their_time():
    """A branch's rate is its tokens over its seconds: three drafting steps that found nothing to draft (one token
    each, synchronous) and one that drafted well give 8 / 3.25 tokens a second, not the mean of the four steps'
    rates (5.75), and beat the steps without the drafter (2 a second)."""
    gate = DraftGate(decay=1.0)
    for tokens, seconds in ((1, 1.0), (1, 1.0), (1, 1.0), (5, 0.25)):
        gate.observe(1, True, tokens, seconds)
    gate.observe(1, False, 2, 1.0)
    assert gate.rate[1, True] == pytest.approx(8 / 3.25) and gate.rate[1, True] > gate.rate[1, False]


def test_a_gate_that_finds_drafting_slower_stops_proposing(target, greedy_reference):
    """Rates seeded so that steps without the drafter are far faster, and frozen: the engine proposes only on the
    gate's exploration steps, and its tokens are target-only's."""
    engine = PagedEngine(target, "ngram", max_batch=3, gamma=3, block_size=4, token_budget=16)
    engine.gate = DraftGate(explore=10**6, max_explore=10**6)
    for rows in (1, 2, 4):
        engine.gate.rate.update({(rows, True): 1.0, (rows, False): 1e9})
        engine.gate.steps[rows] = 1                   # past each bucket's first (exploring) step
    engine.gate.observe = lambda *a: None
    proposed = []
    reqs = [BatchRequest(prompt=p, max_tokens=12, temperature=0.0) for p in PROMPTS]
    for r in reqs:
        engine.submit(r)
    for seq in engine.seqs.values():
        real = seq.context.propose
        seq.context.propose = lambda row, cap, real=real: proposed.append(cap) or real(row, cap)
    while engine.has_work:
        engine.step()
    assert [r.tokens for r in reqs] == greedy_reference
    assert proposed == [] and engine.counters["drafted"] == 0 and engine.counters["steps_drafter_off"] > 0


def test_pricing_off_verifies_every_offered_draft(target, greedy_reference):
    engine = PagedEngine(target, "ngram", max_batch=3, gamma=3, block_size=4, token_budget=16, pricing=False)
    for rows in (1, 2, 4):
        for total, wide in decode_shapes(rows, 3):
            engine.costs.seed((rows, total, wide), 1.0 + 10 * (total - rows))     # ignored
    reqs = [BatchRequest(prompt=p, max_tokens=12, temperature=0.0) for p in PROMPTS]
    _run(engine, reqs)
    assert [r.tokens for r in reqs] == greedy_reference and engine.counters["drafted"] > 0


def test_the_warm_up_builds_every_decode_shape_on_the_scratch_block(target):
    """Each (rows, tokens, wide) the planner can choose, at two table widths, runs through the forward on the
    scratch block with the shapes a graph captures (eagerly here: no CUDA)."""
    engine = PagedEngine(target, "ngram", max_batch=4, gamma=3, block_size=4, token_budget=16)
    free = engine.blocks.num_free
    for rows in (1, 2, 4):
        for total, wide in decode_shapes(rows, 3):
            width = 4 if wide else 1
            for m in (16, 32):
                inputs = scratch_decode(engine, rows, total, width, m)
                assert inputs.tokens.shape == (total,) and inputs.tables.shape == (rows, m)
                assert engine.model.forward(inputs).shape == (rows * width, engine.vocab_out)
    assert engine.blocks.num_free == free


# ------------------------------------------------------------------------------------------------------ admission
def test_admission_coalesces_prefills_by_ski_rental():
    from tilespec.engine.paged.admission import Admission
    adm = Admission(max_wait_s=1.0)
    assert adm.admit(0.0, [0.0], running=8)            # nothing measured yet: admit at once
    adm.observe(True, 0.030)                           # a prefilling step costs 30 ms, a decode step 5 ms:
    adm.observe(False, 0.005)                          # O = 25 ms for each of 8 running requests = 0.2 s
    assert adm.overhead == pytest.approx(0.025)
    assert not adm.admit(1.0, [0.95, 0.99], running=8)          # 0.06 request-seconds waited
    assert adm.admit(1.0, [0.85, 0.9, 0.95], running=8)         # 0.3 >= 0.2
    assert adm.admit(1.0, [0.99], running=0)                    # nobody to delay
    assert adm.admit(2.0, [0.99], running=64)                   # the longest wait is bounded
    assert not adm.admit(1.0, [], running=8)
    adm.observe(True, 10.0)                                     # a stall moves the average at most 2x
    assert adm.mixed <= 0.030 * (0.8 + 0.2 * 2) + 1e-12
    assert Admission(max_wait_s=0.0).admit(0.0, [0.0], running=8)


def test_coalesced_admission_changes_no_token(target, greedy_reference):
    """Mixed steps priced far above decode steps: arrivals wait (bounded) so prefills coalesce; tokens unchanged."""
    engine = PagedEngine(target, "ngram", max_batch=3, gamma=3, block_size=4, token_budget=16,
                         max_admission_wait=0.02)
    engine.admission.observe(True, 5.0)
    engine.admission.observe(False, 0.001)
    engine.admission.observe = lambda prefilled, seconds: None
    reqs = [BatchRequest(prompt=p, max_tokens=12, temperature=0.0) for p in PROMPTS]
    _run(engine, reqs)
    assert [r.tokens for r in reqs] == greedy_reference
    assert engine.blocks.num_free == engine.blocks.num_blocks - 1 and engine.counters["admissions_deferred"] > 0
