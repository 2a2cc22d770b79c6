"""The deterministic mode on CUDA (the CPU tier runs the kernels under Triton's interpreter): the invariant linear
and RMSNorm at the 1.5B's widths give a row bitwise the same in batches of any size, and PagedEngine(deterministic=
True) with compiled layers and captured decode graphs gives a request alone the tokens and logprobs it gets among
others (chunked prefill, a prefix-cache hit, ngram drafts), bf16."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tilespec.engine.batching import BatchRequest
from tilespec.engine.paged import invariant as inv
from tilespec.engine.paged.engine import PagedEngine

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def cuda():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    return torch.device("cuda")


@pytest.mark.parametrize("k, n", [(1536, 2048), (8960, 1536), (1536, 17920)])
def test_linear_rows_do_not_depend_on_the_batch_on_cuda(cuda, k, n):
    torch.manual_seed(0)
    w = (0.02 * torch.randn(n, k, device=cuda)).bfloat16()
    row = torch.randn(1, k, device=cuda).bfloat16()
    alone = inv.linear(row, w)
    torch.testing.assert_close(alone.float(), F.linear(row.float(), w.float()), atol=2e-2, rtol=2e-2)
    for m in (2, 7, 64, 65, 256, 320):
        batch = torch.randn(m, k, device=cuda).bfloat16()
        batch[m // 2] = row[0]
        assert torch.equal(inv.linear(batch, w)[m // 2], alone[0]), m


def test_rms_norm_rows_do_not_depend_on_the_batch_on_cuda(cuda):
    weight = (1 + 0.1 * torch.randn(1536, device=cuda)).bfloat16()
    row = torch.randn(1, 1536, device=cuda).bfloat16()
    alone = inv.rms_norm(row, weight, 1e-6)
    for m in (3, 64, 300):
        batch = torch.randn(m, 1536, device=cuda).bfloat16()
        batch[-1] = row[0]
        assert torch.equal(inv.rms_norm(batch, weight, 1e-6)[-1], alone[0]), m


@pytest.fixture(scope="module")
def target(cuda):
    from transformers import Qwen2Config, Qwen2ForCausalLM
    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=3,
                      num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=2048,
                      tie_word_embeddings=False)
    model = Qwen2ForCausalLM(cfg).eval().to(cuda, torch.bfloat16)
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)
    model.generation_config.eos_token_id = None
    return model


PROMPTS = [[5, 6, 7, 8] * 6 + [5, 6], list(range(20, 90)), [9, 10, 11], [40, 41] * 20, list(range(100, 160)), [3]]


def _served(engine, reqs) -> list:
    got = {engine.submit(r): [] for r in reqs}
    while engine.has_work:
        for e in engine.step():
            got[e.rid] += list(zip(e.tokens, e.logprobs or [None] * len(e.tokens)))
    return [got[r.rid] for r in reqs]


@pytest.mark.parametrize("draft", [None, "ngram"])
def test_graphed_engine_gives_a_request_the_same_tokens_alone_and_among_others(target, draft):
    def ask(i, p):
        return BatchRequest(prompt=p, max_tokens=24, temperature=1.0 if i == 1 else 0.0, seed=i, logprobs=2)

    def engine(budget):
        eng = PagedEngine(target, draft, max_batch=8, gamma=3, compile=True, token_budget=budget, max_len=256,
                          deterministic=True, pricing=False)
        eng.warm_up()
        return eng

    alone_engine = engine(128)
    alone = [_served(alone_engine, [ask(i, p)])[0] for i, p in enumerate(PROMPTS[:2])]
    crowd_engine = engine(32)                       # prompts chunked otherwise
    _served(crowd_engine, [ask(9, PROMPTS[0] + [1, 2])])           # prompt 0's blocks in the prefix cache
    crowd = _served(crowd_engine, [ask(i, p) for i, p in enumerate(PROMPTS * 2)])
    assert crowd_engine.counters["decode_graph_steps"] > 0
    assert draft is None or crowd_engine.counters["accepted"] > 0
    for i in range(2):
        assert crowd[i] == alone[i], i              # tokens and logprobs, floats compared exactly
