"""The paged engine (engine/paged/) on CPU, fp32 tiny models: block accounting never leaks, and a request's tokens
do not depend on the batch, prefix caching, chunking, preemption or cancellations of others."""
from __future__ import annotations

import random

import pytest
import torch

from tilespec.engine import SpeculativeDecoder
from tilespec.engine.batching import BatchEngine, BatchRequest
from tilespec.engine.paged.blocks import BlockManager
from tilespec.engine.paged.engine import PagedEngine, bucket
from tilespec.engine.paged.scheduler import Scheduler, Seq
from tilespec.verify.types import SamplingParams

from engine_models import no_eos_lm, tiny_lm


@pytest.fixture(scope="module")
def target():
    return no_eos_lm()


PROMPTS = [[5, 6, 7, 8, 5, 6, 7, 8, 5, 6], [9, 10, 11], [3], list(range(20, 54)), [40, 41, 40, 41, 40] * 4,
           list(range(20, 44)) + [7, 7]]


def _run(engine, reqs, stagger=True, cancel=None):
    half = len(reqs) // 2 if stagger else len(reqs)
    for r in reqs[:half]:
        engine.submit(r)
    engine.step()
    if cancel is not None:
        engine.submit(cancel)
    engine.step()
    if cancel is not None:
        engine.cancel(cancel.rid)
    for r in reqs[half:]:
        engine.submit(r)
    while engine.has_work:
        engine.step()
        if hasattr(engine, "blocks"):
            engine.blocks.check()


# ---------------------------------------------------------------------------------------------- blocks / scheduler
def test_blocks_share_prefixes_and_evict_lru():
    bm = BlockManager(8, 4)
    tokens = list(range(13))
    table, keys = [], []
    assert bm.match_prefix(tokens, table, keys) == 0
    assert bm.grow(table, 13) and len(table) == 4
    bm.seal(tokens, table, keys, 12)
    assert len(keys) == 3
    other_t, other_k = [], []
    assert bm.match_prefix(tokens[:9] + [99, 98, 97], other_t, other_k) == 8     # two full blocks shared
    assert other_t == table[:2] and bm.ref[table[0]] == 2
    bm.release(table, keys)
    bm.release(other_t, other_k)
    bm.check()
    again_t, again_k = [], []
    assert bm.match_prefix(tokens, again_t, again_k) == 12                         # cached after release
    bm.release(again_t, again_k)
    big_t = []
    assert bm.grow(big_t, 7 * 4)                                                   # evicts every cached block
    assert not bm.by_key
    assert not bm.grow(big_t, 8 * 4)                                               # block 0 is never handed out
    bm.release(big_t, [])
    bm.check()


def test_bad_block_settings_are_refused():
    with pytest.raises(ValueError, match="power of two"):
        BlockManager(8, 6)
    with pytest.raises(ValueError, match="num_blocks"):
        BlockManager(1, 4)


@pytest.mark.parametrize("seed", range(6))
def test_block_accounting_never_leaks(seed):
    """Random arrivals, chunked prefills, drafts, cancellations and preemptions on a small pool: the pool's
    accounting holds after every step and every block comes back at the end."""
    rng = random.Random(seed)
    bm = BlockManager(12, 4)
    sched = Scheduler(bm, token_budget=rng.choice([3, 8, 16]), max_seqs=rng.choice([2, 4, 8]))
    live, order = [], 0
    for _ in range(200):
        if rng.random() < 0.3:
            seq = Seq(req=None, tokens=[rng.randrange(3) for _ in range(rng.randrange(1, 14))], order=order)
            order += 1
            sched.add(seq)
            live.append(seq)
        for seq in sched.running:
            seq.drafts = [1] * rng.randrange(3) if seq.decoding else []
        for it in sched.schedule():
            seq = it.seq
            seq.computed = it.start + it.n
            if it.samples:
                accepted = rng.randrange(len(seq.drafts) + 1)
                seq.tokens += seq.drafts[:accepted] + [rng.randrange(3)]
                seq.computed += accepted
            bm.seal(seq.tokens, seq.table, seq.keys, seq.computed)
            assert all(b != 0 for b in seq.table)
        if live and rng.random() < 0.15:
            seq = live.pop(rng.randrange(len(live)))
            sched.remove(seq)
        for seq in [s for s in sched.running if len(s.tokens) > 24]:
            live.remove(seq)
            sched.remove(seq)
        bm.check()
    for seq in live:
        sched.remove(seq)
    bm.check()
    assert bm.num_free == bm.num_blocks - 1


def test_bucket():
    assert [bucket(n) for n in (1, 3, 5, 17, 64, 65, 600)] == [1, 4, 8, 24, 64, 96, 600]


# ---------------------------------------------------------------------------------------------- engine
@pytest.fixture(scope="module")
def greedy_reference(target):
    return SpeculativeDecoder(target, None, sampling=SamplingParams(temperature=0.0)).generate(
        PROMPTS, max_new_tokens=12).sequences


@pytest.mark.parametrize("draft", [None, "ngram", "suffix"])
@pytest.mark.parametrize("prefix_caching", [True, False])
def test_greedy_tokens_equal_target_only(target, greedy_reference, draft, prefix_caching):
    engine = PagedEngine(target, draft, max_batch=3, gamma=3, block_size=4, token_budget=16,
                         prefix_caching=prefix_caching, pricing=False)     # priced steps: test_paged_pricing.py
    reqs = [BatchRequest(prompt=p, max_tokens=12, temperature=0.0) for p in PROMPTS]
    _run(engine, reqs, cancel=BatchRequest(prompt=list(range(60, 90)), max_tokens=5, temperature=0.0))
    assert [r.tokens for r in reqs] == greedy_reference
    assert all(r.finish_reason == "length" for r in reqs)
    assert engine.blocks.num_free == engine.blocks.num_blocks - 1
    assert draft is None or engine.counters["accepted"] > 0


def test_preemption_changes_no_token(target, greedy_reference):
    """A pool far too small for the batch: requests are preempted and recomputed, tokens unchanged."""
    engine = PagedEngine(target, "ngram", max_batch=6, gamma=3, block_size=4, num_blocks=20, token_budget=24)
    reqs = [BatchRequest(prompt=p, max_tokens=12, temperature=0.0) for p in PROMPTS]
    _run(engine, reqs, stagger=False)
    assert engine.counters["preemptions"] > 0
    assert [r.tokens for r in reqs] == greedy_reference


def test_shared_prefix_is_reused(target):
    system = list(range(30, 62))
    prompts = [system + [i, i + 1] for i in range(5)]
    ref = SpeculativeDecoder(target, None, sampling=SamplingParams(temperature=0.0)).generate(
        prompts, max_new_tokens=6).sequences
    engine = PagedEngine(target, None, max_batch=2, block_size=4)
    reqs = [BatchRequest(prompt=p, max_tokens=6, temperature=0.0) for p in prompts]
    for r in reqs:
        engine.submit(r)
    while engine.has_work:
        engine.step()
    assert [r.tokens for r in reqs] == ref
    # the first two are admitted in one step (neither finds the other's blocks yet); the other three find all 8
    assert engine.blocks.hits >= 3 * 8


def test_requests_with_one_prompt_prefill_it_once(target):
    """n choices of one prompt (different seeds): submitted together, the first prefills the prompt and the others
    wait for its blocks, then compute only the last partial block; each one's tokens are its solo run's."""
    prompt = list(range(20, 58))                                      # 38 tokens: 9 full blocks of 4
    def asks():
        return [BatchRequest(prompt=prompt, max_tokens=8, temperature=1.0, seed=s) for s in range(4)]
    solo = []
    for r in asks():
        e = PagedEngine(target, None, max_batch=1, block_size=4)
        e.submit(r)
        while e.has_work:
            e.step()
        solo.append(r.tokens)
    engine = PagedEngine(target, None, max_batch=4, block_size=4)
    reqs = asks()
    for r in reqs:
        engine.submit(r)
    while engine.has_work:
        engine.step()
        engine.blocks.check()
    assert [r.tokens for r in reqs] == solo
    assert engine.counters["prefill_tokens"] == 38 + 3 * 2       # the twins: 2 tokens past the 9 shared blocks


@pytest.mark.parametrize("draft", [None, "ngram"])
def test_sampled_tokens_do_not_depend_on_the_batch(target, draft):
    """T = 1, per-request seeds: each request's tokens equal those it gets alone, and those of BatchEngine."""
    def reqs():
        return [BatchRequest(prompt=p, max_tokens=10, temperature=1.0, seed=100 + i) for i, p in enumerate(PROMPTS)]
    together = reqs()
    _run(PagedEngine(target, draft, max_batch=4, gamma=3, block_size=4, token_budget=12), together)
    alone = []
    for r in reqs():
        e = PagedEngine(target, draft, max_batch=1, gamma=3, block_size=8)
        e.submit(r)
        while e.has_work:
            e.step()
        alone.append(r.tokens)
    assert [r.tokens for r in together] == alone
    batch = reqs()
    _run(BatchEngine(target, draft, max_batch=4, gamma=3, max_len=80), batch)
    assert [r.tokens for r in batch] == alone


def test_bad_requests_fail_before_admission(target):
    engine = PagedEngine(target, None, max_batch=2, block_size=4, num_blocks=8)
    with pytest.raises(ValueError, match="positions"):
        engine.submit(BatchRequest(prompt=list(range(20)), max_tokens=20))      # 40 > 7 blocks of 4
    with pytest.raises(ValueError, match="vocabulary"):
        engine.submit(BatchRequest(prompt=[1, 10_000], max_tokens=2))
    with pytest.raises(ValueError, match="empty"):
        engine.submit(BatchRequest(prompt=[], max_tokens=2))
    assert not engine.has_work


def test_foreign_drafts_are_refused(target):
    """Draft models and trained heads run on the paged engine (tests/test_paged_draft_model.py,
    tests/test_paged_head.py); draft models of another vocabulary do not."""
    with pytest.raises(ValueError, match="vocabulary"):
        PagedEngine(target, tiny_lm(1, vocab=96, layers=1))


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_logit_transforms_and_stop_ids_match_the_batch_engine(temperature):
    """Penalties / logit_bias / min_tokens, stop ids and ignore_eos: the paged engine's tokens are BatchEngine's
    (whose transformed speculative tokens equal transformed target-only tokens: tests/test_batching_transforms.py)."""
    from tilespec.verify.logit_transforms import LogitSettings
    model = tiny_lm(0, logit_scale=20.0)
    model.generation_config.eos_token_id = None
    settings = LogitSettings(presence_penalty=1.5, frequency_penalty=0.5, logit_bias={7: 2.0, 8: -5.0}, min_tokens=3)

    def asks():
        return [BatchRequest(prompt=p, max_tokens=16, temperature=temperature, seed=3 + i,
                             logits=settings if i % 2 == 0 else None, stop_token_ids=(11,) if i == 1 else (),
                             ignore_eos=i == 2) for i, p in enumerate(PROMPTS)]
    paged, batch = asks(), asks()
    _run(PagedEngine(model, "ngram", max_batch=3, gamma=3, block_size=4, eos_token_id=9), paged)
    _run(BatchEngine(model, "ngram", max_batch=3, gamma=3, max_len=80, eos_token_id=9), batch)
    assert [(r.tokens, r.finish_reason) for r in paged] == [(r.tokens, r.finish_reason) for r in batch]


def test_the_server_picks_its_engine(target):
    from engine_models import layer_skip
    from tilespec.serve import make_engine, pick_engine
    assert pick_engine(target, "ngram", "auto", {}) == "paged"
    assert pick_engine(target, layer_skip(target, 1), "auto", {}) == "paged"
    assert pick_engine(target, "head", "auto", {}) == "paged"          # a trained head too (tests/test_paged_head.py)
    assert pick_engine(target, None, "auto", {"capacity": 64}) == "batch"
    from tilespec.engine.drafters import NgramDrafter, resolve_drafter
    from tilespec.engine.drafters.trees import tree_drafter, tree_shape
    tree = tree_drafter(NgramDrafter(), tree_shape((2, 2, 4), None), SamplingParams(), "constant")
    assert pick_engine(target, tree, "auto", {}) == "paged"       # context trees: tests/test_paged_trees.py
    model_chains = tree_drafter(resolve_drafter(layer_skip(target, 1)), tree_shape(None, (2, 2)), SamplingParams(),
                                "constant")
    assert pick_engine(target, model_chains, "auto", {}) == "batch"
    with pytest.raises(ValueError, match="token tree.*use --engine batch"):
        pick_engine(target, model_chains, "paged", {})
    with pytest.raises(ValueError, match="do not apply"):
        pick_engine(target, None, "batch", {"prefix_caching": False})
    eng = make_engine(target, "ngram", max_batch=2, gamma=3, prefill_chunk=8, prefix_caching=False)
    assert isinstance(eng, PagedEngine) and not eng.blocks.prefix_caching
    assert eng.scheduler.token_budget == 8 + 2 * 4


@pytest.mark.parametrize("draft", [None, "ngram"])
def test_offline_generate_gives_the_decoders_tokens(target, greedy_reference, draft):
    """Offline generation is the serving engine fed every prompt: greedy tokens equal the decoder's, and at T = 1
    request i (seed + i) samples what SpeculativeDecoder's target-only decoding samples with the same seed."""
    eng = PagedEngine(target, draft, max_batch=3, gamma=3, block_size=4, pricing=False)   # drafts whatever the clock
    out = eng.generate(PROMPTS, max_new_tokens=12, sampling=SamplingParams(temperature=0.0))
    assert out.sequences == greedy_reference and out.finish_reasons == ["length"] * len(PROMPTS)
    assert out.stats.new_tokens == 12 * len(PROMPTS) and out.stats.steps > 0 and out.stats.kv_cache_bytes > 0
    assert draft is None or out.stats.accepted > 0
    hot = SamplingParams(temperature=1.0)
    ref = SpeculativeDecoder(target, None, sampling=hot).generate(PROMPTS, max_new_tokens=10, seed=7).sequences
    assert eng.generate(PROMPTS, max_new_tokens=10, sampling=hot, seed=7).sequences == ref
    with pytest.raises(ValueError, match="no prompts"):
        eng.generate([], max_new_tokens=4)


def test_a_kv_cache_the_device_cannot_hold_says_what_to_lower(target, monkeypatch):
    """A failed K/V allocation is one error (still an OutOfMemoryError) saying how much was asked, what the device
    has free and the setting to lower, instead of the allocator's own message: a real one on the CPU (2 PiB asked,
    past any address space, fails at once), a planted CUDA-style one; other errors of the allocation stay theirs."""
    from types import SimpleNamespace

    from tilespec.engine.paged import blocks
    with pytest.raises(blocks.KVCacheTooLarge) as real:
        PagedEngine(target, "ngram", max_batch=2, num_blocks=2**40)
    message = str(real.value)
    assert message.startswith("the K/V cache does not fit: 1,099,511,627,776 blocks of 16 tokens take 8,192.0 TiB")
    assert "pass a smaller num_blocks" in message and "DefaultCPUAllocator" not in message

    def no_room(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
    monkeypatch.setattr(blocks, "torch", SimpleNamespace(zeros=no_room, OutOfMemoryError=torch.OutOfMemoryError))
    with pytest.raises(torch.OutOfMemoryError, match="does not fit: 9 blocks of 16 tokens take 0.1 MiB") as planted:
        PagedEngine(target, "ngram", max_batch=2, max_len=64)       # 2 rows of 4 blocks + the scratch block
    assert "lower --max-batch / --max-len" in str(planted.value)    # a CPU cache is not sized by --kv-fraction

    def broken(*args, **kwargs):
        raise RuntimeError("an error of the device, not of its memory")
    monkeypatch.setattr(blocks.torch, "zeros", broken)
    with pytest.raises(RuntimeError, match="not of its memory"):
        PagedEngine(target, "ngram", max_batch=2, max_len=64)
    monkeypatch.undo()

    gpu = str(blocks.kv_too_large(9000, 16, 2**20, torch.device("cuda:0"), 30 * 2**30, 0.95, chosen=False))
    assert gpu.startswith("the K/V cache does not fit: 9,000 blocks of 16 tokens take 8.79 GiB; cuda:0 has 30.00 GiB "
                          "free without them, room for at most 30,720 blocks; lower --kv-fraction (kv_fraction in "
                          "Python; 0.95 now")


def test_a_warm_up_out_of_memory_names_the_caches_share_and_what_to_lower(target, monkeypatch):
    """A capture that runs out of device memory after the K/V cache took its share (kv_fraction near 1) ends the
    warm-up with one error naming the cache and --kv-fraction, not the allocator's size alone; other errors stay."""
    from tilespec.engine.paged import blocks, warmup
    engine = PagedEngine(target, "ngram", max_batch=4, max_len=64, kv_fraction=0.97)
    monkeypatch.setattr(engine.model, "graphs", True)          # as on CUDA: the warm-up has shapes to capture

    def no_room(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 512.00 MiB")
    monkeypatch.setattr(warmup, "warm_attention", no_room)
    with pytest.raises(blocks.KVCacheTooLarge) as failed:
        engine.warm_up()
    message = str(failed.value)
    assert message.startswith(f"the warm-up ran out of device memory: the K/V cache holds {engine.blocks.num_blocks} "
                              f"blocks") and "of 4 rows" in message
    assert "lower --kv-fraction (kv_fraction in Python; 0.97 now" in message and "--max-batch" in message

    def broken(*args, **kwargs):
        raise RuntimeError("a compile error, not one of memory")
    monkeypatch.setattr(warmup, "warm_attention", broken)
    with pytest.raises(RuntimeError, match="not one of memory"):
        engine.warm_up()


def test_bad_engine_settings_are_refused(target):
    for kwargs, match in [(dict(max_batch=0), "max_batch"), (dict(kv_fraction=1.5), "kv_fraction"),
                          (dict(draft="ngram", gamma=4, block_size=4), "below block_size"),
                          (dict(block_size=6), "power of two"), (dict(num_blocks=1), "num_blocks"),
                          (dict(gamma=40), "gamma")]:
        draft = kwargs.pop("draft", None)
        with pytest.raises(ValueError, match=match):
            PagedEngine(target, draft, **kwargs)
    with pytest.raises(ValueError, match="token_budget"):
        Scheduler(BlockManager(4, 4), token_budget=0)
    eng = PagedEngine(target, None, max_batch=2, block_size=4)
    with pytest.raises(ValueError, match="sampling.temperature has 2 values for 1 prompts"):
        eng.generate([[1, 2]], max_new_tokens=2, sampling=SamplingParams(temperature=[0.0, 1.0]))
    with pytest.raises(ValueError, match="verifies exactly"):
        eng.generate([[1, 2], [3]], max_new_tokens=2, sampling=SamplingParams(lenience=[1.0, 0.5]))
    with pytest.raises(ValueError, match="seeds"):
        eng.generate([[1, 2]], max_new_tokens=2, seed=[1, 2])


@pytest.mark.parametrize("draft", [None, "ngram"])
def test_piecewise_mixed_steps_change_no_token(target, greedy_reference, draft):
    """Mixed steps padded to their token bucket and run piece by piece (engine/paged/piecewise.py: the pieces a
    CUDA graph captures, run directly here), decode steps padded to their shapes: the greedy tokens of the plain
    path, and every bucket's pieces built once."""
    engine = PagedEngine(target, draft, max_batch=3, gamma=3, block_size=4, token_budget=40, pricing=False)
    engine.fixed_shapes = engine.model.piecewise = True
    reqs = [BatchRequest(prompt=p, max_tokens=12, temperature=0.0) for p in PROMPTS]
    _run(engine, reqs)
    assert [r.tokens for r in reqs] == greedy_reference
    assert engine.model._pieces and set(engine.model._pieces) <= set(engine.mixed_sizes)
    assert engine.blocks.num_free == engine.blocks.num_blocks - 1
