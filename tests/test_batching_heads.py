"""Continuous batching (engine/batching.py) and ``tilespec serve`` with a trained draft head (``head``,
``head+ngram``) on CPU: requests joining mid-flight, ending early and cancelled get target-only decoding's greedy
tokens, a seeded sampled request gets the same tokens alone and amid traffic, the head stays current in steps that
draft nothing (per-request γ = 0, the load switch), and the server answers with ``--draft head``."""
from __future__ import annotations

import random
import shutil

import httpx
import pytest
import torch

from tilespec.engine import SpeculativeDecoder
from tilespec.engine.batching import BatchEngine, BatchRequest
from tilespec.engine.drafters import HeadDrafter
from tilespec.training import train_head
from tilespec.verify.types import SamplingParams

from engine_models import tiny_lm
from tiers import fast_first

GREEDY = SamplingParams(temperature=0.0)
VOCAB = 128


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A 4-layer random target and a head trained on its own greedy responses for 60 steps (~2 s on one core)."""
    torch.set_num_threads(1)
    target = tiny_lm(0, "qwen2", vocab=VOCAB, layers=4, logit_scale=4.0)
    target.generation_config.eos_token_id = None
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, VOCAB, (8,), generator=g).tolist() for _ in range(32)]
    folder = tmp_path_factory.mktemp("head")
    head, _ = train_head(target, target_name="tiny", out=folder, prompts=prompts, max_new_tokens=32, gen_batch=32,
                         seq_len=40, draft_vocab=96, ttt_steps=2, batch=8, lr=3e-3, warmup=10, max_steps=60,
                         eval_every=0, resume=False, compile=False, progress=False, log=lambda m: None)
    return target, head, folder, prompts


def _reference_hidden(target, head, ids: list) -> torch.Tensor:
    """The head's output at the last entry of the sequence ``ids`` built from scratch (one target forward with its
    hidden states, the head's entries over every position): what a head that observed every step holds."""
    x = torch.tensor([ids])
    n = len(ids) - 1
    out = target(input_ids=x[:, :n], output_hidden_states=True)
    feats = torch.cat([out.hidden_states[i] for i in head.cfg.feature_layers], dim=-1)
    k, v = head.new_cache(1, n, x.device, head.fc.weight.dtype)
    mask = torch.ones(n, n, dtype=torch.bool).tril()[None, None]
    h = head.entries(head.fuse(feats), x[:, 1:], torch.arange(n)[None], mask, torch.zeros((), dtype=torch.int64),
                     k, v)
    return h[0, -1]


@pytest.mark.parametrize("runtime", [False, "native"])
@pytest.mark.parametrize("draft", ["head", "head+ngram"])
def test_greedy_tokens_equal_target_only_with_joins_early_ends_and_a_cancel(trained, draft, runtime):
    target, head, _, train_prompts = trained
    prompts = [train_prompts[0], [5, 6, 7, 8, 5, 6, 7, 8, 5, 6], [9], train_prompts[1][:3], list(range(20, 34)),
               train_prompts[2] + train_prompts[3], [40, 41, 40, 41, 40]]
    budgets = [16, 12, 9, 16, 4, 16, 14]
    ref = SpeculativeDecoder(target, None, sampling=GREEDY).generate(prompts, max_new_tokens=16).sequences
    context = "ngram" if draft == "head+ngram" else None
    engine = BatchEngine(target, HeadDrafter(head, context=context), max_batch=3, gamma=3, max_len=64,
                         compile=runtime, prefill_chunk=4)
    reqs = [BatchRequest(prompt=p, max_tokens=m, temperature=0.0) for p, m in zip(prompts, budgets)]
    for r in reqs[:3]:
        engine.submit(r)
    engine.step()
    engine.step()
    for r in reqs[3:]:                        # they join rows as the first requests leave
        engine.submit(r)
    engine.step()
    cancelled = reqs[1]
    engine.cancel(cancelled.rid)
    while engine.has_work:
        engine.step()
    for r, want in zip(reqs, ref):
        if r is cancelled:
            assert r.finish_reason == "cancelled" and r.tokens == want[:len(r.tokens)]
        else:
            assert r.tokens == want[:r.max_tokens] and r.finish_reason == "length", (r.prompt, r.tokens)
    assert engine.running == 0 and engine.counters["drafted"] > 0 and engine.counters["accepted"] > 0


def test_batched_head_drafts_and_accepts_what_it_does_alone(trained):
    """Greedy: each request's drafted / accepted counts amid traffic equal a lone SpeculativeDecoder's with the same
    head and γ (so the head's per-row cache and state are exactly what one request's own decoding builds)."""
    target, head, _, train_prompts = trained
    prompts = [train_prompts[i] for i in (4, 5, 6, 7, 8)]
    solo = []
    for p in prompts:
        out = SpeculativeDecoder(target, HeadDrafter(head), gamma=3, sampling=GREEDY).generate([p], max_new_tokens=20)
        solo.append((out.sequences[0], out.stats.drafted, out.stats.accepted))
    engine = BatchEngine(target, HeadDrafter(head), max_batch=2, gamma=3, max_len=64, prefill_chunk=3, min_alpha=0.0)
    reqs = [BatchRequest(prompt=p, max_tokens=20, temperature=0.0) for p in prompts]
    for r in reqs:
        engine.submit(r)
    while engine.has_work:
        engine.step()
    assert [(r.tokens, r.drafted, r.accepted) for r in reqs] == solo
    assert sum(r.accepted for r in reqs) > 0


def _run_checking_the_head(engine, target, head, reqs, defrag_every: int = 0) -> int:
    """Run ``engine`` to the end; after every step each live request's head state must equal the head rebuilt from
    scratch over its prompt and tokens. Returns how many states were checked."""
    checked = 0
    while engine.has_work:
        engine.step()
        if defrag_every and engine.counters["steps"] % defrag_every == 0:
            with torch.inference_mode():
                engine._defrag()           # moves the head's K/V with the target's (the next step reads them)
        for r in reqs:
            if r.finish_reason is None and r.tokens:
                want = _reference_hidden(target, head, r.prompt + r.tokens)
                torch.testing.assert_close(engine.state.hidden[r.row], want, rtol=1e-4, atol=1e-4)
                checked += 1
    return checked


@pytest.mark.parametrize("runtime", [False, "native"])
def test_the_head_stays_current_while_nothing_is_drafted(trained, runtime):
    """Drafting off by load (``spec_max_batch=1`` while two requests decode) and by request (γ = 0): after every
    step each live row's head state is the head rebuilt from scratch; once alone, the request drafts and its drafts
    are accepted."""
    target, head, _, train_prompts = trained
    engine = BatchEngine(target, HeadDrafter(head), max_batch=4, gamma=3, max_len=64, compile=runtime,
                         prefill_chunk=5, spec_max_batch=1)
    x = BatchRequest(prompt=train_prompts[9], max_tokens=24, temperature=0.0)
    y = BatchRequest(prompt=train_prompts[10][:5], max_tokens=8, temperature=0.0, gamma=0)
    z = BatchRequest(prompt=[7], max_tokens=6, temperature=0.0)
    for r in (x, y, z):
        engine.submit(r)
    assert _run_checking_the_head(engine, target, head, (x, y, z)) >= 10
    assert y.drafted == 0 and z.drafted == 0
    assert x.drafted > 0 and x.accepted > 0       # drafted only after y and z ended, from a current head


@pytest.mark.parametrize("runtime", [False, "native"])
def test_the_heads_cache_moves_with_the_targets_at_a_defragmentation(trained, runtime):
    """Three drafting requests accept different lengths (holes in the shorter rows), the caches defragmented every
    third step: every row's head state stays the head rebuilt from scratch."""
    target, head, _, train_prompts = trained
    engine = BatchEngine(target, HeadDrafter(head), max_batch=4, gamma=3, max_len=64, compile=runtime,
                         prefill_chunk=8, min_alpha=0.0)
    reqs = [BatchRequest(prompt=train_prompts[i], max_tokens=20, temperature=0.0) for i in (12, 13, 14)]
    for r in reqs:
        engine.submit(r)
    assert _run_checking_the_head(engine, target, head, reqs, defrag_every=3) >= 20
    assert engine.counters["defrags"] >= 3 and sum(r.accepted for r in reqs) > 0


@pytest.mark.parametrize("draft,method,repeats,runtime", fast_first([
    ("head", "coupled", False, "native"), ("head+ngram", "coupled", True, "native"), ("head", "coupled", False, False),
    ("head", "reference", False, False), ("head+ngram", "coupled", False, False)], 2))
def test_seeded_sampled_request_alone_equals_amid_traffic_and_defrags(trained, draft, method, repeats, runtime):
    """The same sampled request (seed 7, T=1, top-p 0.9) with head (and context) drafts alone, amid 9 other requests
    (other temperatures, γ = 0 for some), and amid them with the caches defragmented mid-flight: the same tokens.
    With head+ngram a request verifies its own context drafts where it matches (``repeats``: its prompt does at
    once) and the head's elsewhere, whatever the other rows draft."""
    target, head, _, train_prompts = trained
    context = "ngram" if draft == "head+ngram" else None

    def run(others: int, capacity=None):
        engine = BatchEngine(target, HeadDrafter(head, context=context), max_batch=4, gamma=3, max_len=48,
                             capacity=capacity, prefill_chunk=3, method=method, compile=runtime)
        rng = random.Random(1)
        reqs = [BatchRequest(prompt=([rng.randrange(3, VOCAB) for _ in range(3)] * 5)[:rng.randrange(1, 16)],
                             max_tokens=rng.randrange(1, 20), temperature=rng.choice([0.0, 0.7, 1.0]), seed=i,
                             gamma=rng.choice([None, 0, 2, 3])) for i in range(others)]   # repeats: n-gram matches
        if others:      # greedy companions whose output loops: context drafts while x (no match) drafts the head's
            reqs[:0] = [BatchRequest(prompt=train_prompts[5], max_tokens=19, temperature=0.0) for _ in range(2)]
        prompt = [31, 32, 33] * 3 if repeats else train_prompts[11]
        x = BatchRequest(prompt=prompt, max_tokens=20, temperature=1.0, top_p=0.9, seed=7)
        reqs.insert(others // 2, x)
        for r in reqs[:len(reqs) // 2]:
            engine.submit(r)
        engine.step()
        for r in reqs[len(reqs) // 2:]:
            engine.submit(r)
        while engine.has_work:
            engine.step()
            if capacity and runtime and engine.counters["steps"] % 8 == 0:    # compiled capacities round up to
                with torch.inference_mode():                                   # 256 slots: defragment anyway
                    engine._defrag()
        assert all(len(r.tokens) == r.max_tokens for r in reqs)
        return x.tokens, x.drafted, engine.counters["defrags"]

    alone, drafted, _ = run(0)
    crowd, _, _ = run(7)
    tight, _, defrags = run(7, capacity=56)
    assert alone == crowd == tight and len(alone) == 20
    assert drafted > 0 and defrags >= 1


def test_a_head_on_a_runtime_without_hidden_states_fails_at_construction(trained):
    target, head, _, _ = trained
    with pytest.raises(ValueError, match="reads the target's hidden states"):
        BatchEngine(target, HeadDrafter(head), max_batch=2, max_len=16, compile="debug")


@pytest.mark.slow
def test_server_answers_with_the_targets_head(trained, tmp_path, monkeypatch):
    """``--draft head``: the head found under $TILESPEC_HOME/heads/<target>/, served end to end on the paged engine
    (greedy text equals target-only decoding's, streaming, drafted and accepted tokens in /metrics); a head folder
    (+ngram) resolves too."""
    pytest.importorskip("fastapi")
    pytest.importorskip("uvicorn")
    openai = pytest.importorskip("openai")
    from tilespec.serve import build_server
    from test_serve import CharTokenizer, Server

    target, head, folder, _ = trained
    assert BatchEngine(target, f"{folder}+ngram", max_batch=1, max_len=16).drafter.name == "head+ngram"
    monkeypatch.setenv("TILESPEC_HOME", str(tmp_path))
    shutil.copytree(folder, tmp_path / "heads" / "tiny")
    monkeypatch.setattr(target, "tilespec_name", "tiny", raising=False)
    app = build_server(target, CharTokenizer(), draft="head", model_name="tiny", max_batch=2, gamma=3,
                       max_len=96, default_max_tokens=16, prefill_chunk=8,
                       pricing=False)      # the paged engine (auto); every draft verified, none priced out on a CPU
    srv = Server(app)
    try:
        client = srv.client(openai.OpenAI)
        prompt = [1] + [3 + (ord(c) % 120) for c in "hello there"]
        got = client.completions.create(model="tiny", prompt=prompt, max_tokens=16, temperature=0)
        want = SpeculativeDecoder(target, None, sampling=GREEDY).generate([prompt], max_new_tokens=16).sequences[0]
        assert got.choices[0].text == CharTokenizer().decode(want) and got.usage.completion_tokens == 16
        chunks = list(client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "abab"}],
                                                     max_tokens=10, temperature=0.8, seed=2, stream=True))
        assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
        metrics = dict(line.split() for line in httpx.get(f"{srv.url}/metrics").text.splitlines()
                       if not line.startswith(("#", "tilespec_drafting{")))
        assert float(metrics["tilespec_drafted_total"]) > 0 and float(metrics["tilespec_accepted_total"]) > 0
    finally:
        srv.stop()
