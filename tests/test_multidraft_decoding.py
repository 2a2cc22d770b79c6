"""Sequence-level multi-draft decoding on tiny random Llama models: exact law of 2-token continuations, and
greedy decoding through the prefix caches equals plain target greedy decoding."""
import numpy as np
import pytest
import torch

from tilespec.exactness.stats import fit_test
from tilespec.multidraft.decoding import MultiDraftDecoder, decode_batch, draft_and_score
from tilespec.verify.types import SamplingParams

V = 8


def tiny(seed, sharp):
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=V, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                      num_key_value_heads=2, max_position_embeddings=128)
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(sharp)
    return model


@pytest.fixture(scope="module")
def pair():
    return tiny(0, 60.0), tiny(1, 40.0)


def exact_pair_law(target, prompt):
    with torch.no_grad():
        ctx = torch.cat([prompt.repeat(V, 1), torch.arange(V)[:, None]], 1)
        logits = target(input_ids=ctx).logits.double()
    p1 = torch.softmax(logits[0, -2], -1)
    p2 = torch.softmax(logits[:, -1], -1)
    return (p1[:, None] * p2).reshape(-1).numpy(), p1


@pytest.mark.parametrize("scheme,temps", [("is", (1.0, 1.0)), ("spectr", (1.3, 1.3, 1.3)),
                                          ("specinfer", (0.8, 1.6)), ("is", (0.8, 1.6))])
def test_two_token_law_is_exact(pair, scheme, temps):
    target, draft = pair
    n = 3000
    prompt = torch.tensor([[1, 5, 2]])
    exact, p1 = exact_pair_law(target, prompt)
    gen = torch.Generator().manual_seed(3)
    ds = [SamplingParams(temperature=t) for t in temps]
    res = decode_batch(target, draft, prompt.repeat(n, 1), draft_sampling=ds, L=2, scheme=scheme,
                       sampling=SamplingParams(), seed=10, generator=gen)
    out = res.output_tokens[:, :2].clone()
    need = (res.num_emitted < 2).nonzero().squeeze(1)
    ctx = torch.cat([prompt.repeat(need.numel(), 1), out[need, :1]], 1)
    res2 = decode_batch(target, draft, ctx, draft_sampling=ds, L=2, scheme=scheme, sampling=SamplingParams(),
                        seed=10 + n, generator=gen)
    out[need, 1] = res2.output_tokens[:, 0]
    counts = np.bincount((out[:, 0] * V + out[:, 1]).numpy(), minlength=V * V)
    fit = fit_test(counts, exact)
    assert fit.p_value > 1e-6 and fit.chi2_p_value > 1e-6, fit
    assert float(p1.max()) < 0.9          # the test is not degenerate


def test_round_shapes_and_bad_input(pair):
    target, draft = pair
    ds = [SamplingParams(temperature=1.2)] * 3
    rnd = draft_and_score(target, draft, torch.tensor([[1, 2], [3, 4]]), draft_sampling=ds, L=4)
    assert rnd.target_logits.shape == (2, 3, 5, V) and rnd.draft_tokens.shape == (2, 3, 4)
    assert torch.allclose(rnd.draft_probs.sum(-1), torch.ones(2, 3, 4, dtype=torch.float64))
    with pytest.raises(ValueError, match="L must be >= 1"):
        draft_and_score(target, draft, torch.tensor([[1]]), draft_sampling=ds, L=0)
    with pytest.raises(ValueError, match="single request"):
        from transformers import DynamicCache
        draft_and_score(target, draft, torch.tensor([[1], [2]]), draft_sampling=ds, L=2, target_cache=DynamicCache())
    with pytest.raises(ValueError, match="prompt_ids"):
        MultiDraftDecoder(target, draft, (1.0, 1.0)).generate(torch.tensor([1, 2]), 4)


@pytest.mark.parametrize("scheme", ["is", "spectr"])
def test_greedy_through_caches_equals_target_greedy(pair, scheme):
    target, draft = pair
    prompt = torch.tensor([[3, 1, 4, 1, 5]])
    with torch.no_grad():
        ids = prompt
        for _ in range(12):
            ids = torch.cat([ids, target(input_ids=ids).logits[:, -1].argmax(-1, keepdim=True)], 1)
    want = ids[0, prompt.shape[1]:].tolist()
    dec = MultiDraftDecoder(target, draft, (0.0, 0.0), L=3, scheme=scheme, sampling=SamplingParams.greedy())
    got, stats = dec.generate(prompt, 12)
    assert got == want
    assert stats["block_efficiency"] >= 1.0


def test_sampled_generation_runs_with_caches(pair):
    target, draft = pair
    dec = MultiDraftDecoder(target, draft, (1.2, 2.0), L=4, scheme="is", seed=5)
    got, stats = dec.generate(torch.tensor([[2, 7]]), 10)
    assert len(got) == 10 and all(0 <= t < V for t in got)
    assert 1.0 <= stats["block_efficiency"] <= 5.0
