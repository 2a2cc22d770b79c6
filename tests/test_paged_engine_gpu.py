"""The paged engine on CUDA: compiled forward + captured decode graphs give the eager path's tokens (fp32), greedy
tokens equal target-only decoding, and a seeded T=1 request's tokens do not depend on the path."""
from __future__ import annotations

import pytest
import torch

from tilespec.engine import SpeculativeDecoder
from tilespec.engine.batching import BatchRequest
from tilespec.engine.paged import PagedEngine
from tilespec.engine.paged.warmup import decode_shapes
from tilespec.verify.types import SamplingParams

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def target():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from transformers import Qwen2Config, Qwen2ForCausalLM
    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=3,
                      num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=2048,
                      tie_word_embeddings=False)
    model = Qwen2ForCausalLM(cfg).eval().cuda()
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)
    model.generation_config.eos_token_id = None
    return model


PROMPTS = [list(range(5, 5 + n)) + [7, 8, 7, 8] for n in (3, 40, 150, 9, 300, 1)]


def _run(engine, reqs):
    for r in reqs:
        engine.submit(r)
    while engine.has_work:
        engine.step()
    return [r.tokens for r in reqs]


@pytest.mark.parametrize("draft", [None, "ngram"])
def test_graphs_give_target_only_tokens(target, draft):
    ref = SpeculativeDecoder(target, None, sampling=SamplingParams(temperature=0.0)).generate(
        PROMPTS, max_new_tokens=24).sequences
    eng = PagedEngine(target, draft, max_batch=4, gamma=3, compile=True, token_budget=64, max_len=512)
    assert eng.warm_up() > 0
    captured = eng.model.captures
    assert all(shape in eng.costs.seeds for shape in [(r, t, w) for r in (1, 2, 4) for t, w in decode_shapes(r, eng.gamma)])
    got = _run(eng, [BatchRequest(prompt=p, max_tokens=24, temperature=0.0) for p in PROMPTS])
    assert got == ref
    assert eng.counters["decode_graph_steps"] > 0
    assert eng.model.captures == captured           # the warm-up captured every decode shape served


def test_sampled_tokens_do_not_depend_on_graphs(target):
    def asks():
        return [BatchRequest(prompt=p, max_tokens=24, temperature=1.0, seed=i) for i, p in enumerate(PROMPTS)]
    eager = _run(PagedEngine(target, "ngram", max_batch=4, gamma=3, compile=False, max_len=512), asks())
    graphs = _run(PagedEngine(target, "ngram", max_batch=4, gamma=3, compile=True, max_len=512), asks())
    assert eager == graphs


def test_overlapped_steps_give_the_synchronous_tokens(target):
    def asks():
        return [BatchRequest(prompt=p, max_tokens=32, temperature=float(i % 2), seed=i) for i, p in enumerate(PROMPTS)]
    runs = []
    for overlap in (False, True):
        eng = PagedEngine(target, None, max_batch=4, compile=True, max_len=512, overlap=overlap)
        runs.append((_run(eng, asks()), eng.counters["steps_overlapped"]))
    (sync, none), (over, overlapped) = runs
    assert over == sync
    assert none == 0 < overlapped


def test_a_draft_model_with_graphs_gives_target_only_tokens(target):
    """A Llama-family draft model on the paged engine, compiled with captured graphs (the draft's captured on first
    use): greedy tokens are target-only decoding's, and drafts were verified."""
    from transformers import Qwen2Config, Qwen2ForCausalLM
    torch.manual_seed(1)
    cfg = Qwen2Config(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                      tie_word_embeddings=False)
    draft = Qwen2ForCausalLM(cfg).eval().cuda()
    ref = SpeculativeDecoder(target, None, sampling=SamplingParams(temperature=0.0)).generate(
        PROMPTS, max_new_tokens=24).sequences
    eng = PagedEngine(target, draft, max_batch=4, gamma=3, compile=True, token_budget=64, max_len=512,
                      pricing=False)
    got = _run(eng, [BatchRequest(prompt=p, max_tokens=24, temperature=0.0) for p in PROMPTS])
    assert got == ref
    assert eng.counters["drafted"] > 0
    eng.blocks.check()


def test_a_head_with_graphs_gives_target_only_tokens(tmp_path_factory):
    """A trained head (the CPU tests' tiny pair, moved to CUDA) on the paged engine, compiled, decode graphs with the
    feature capture inside: greedy tokens are the same engine's target-only tokens, drafts verified and accepted."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    import test_batching_heads
    from tilespec.engine.drafters import HeadDrafter
    target, head, _, prompts = test_batching_heads.trained.__wrapped__(tmp_path_factory)
    target, head = target.cuda(), head.cuda()

    def asks():
        return [BatchRequest(prompt=p, max_tokens=24, temperature=0.0) for p in prompts[:8]]
    ref = _run(PagedEngine(target, None, max_batch=4, compile=True, max_len=256), asks())
    eng = PagedEngine(target, HeadDrafter(head), max_batch=4, gamma=3, compile=True, max_len=256, pricing=False)
    eng.warm_up()
    assert _run(eng, asks()) == ref
    assert eng.counters["accepted"] > 0 and eng.counters["decode_graph_steps"] > 0
