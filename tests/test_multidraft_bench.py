"""Experiment helpers of ``python -m bench.multidraft`` on synthetic logits (no real models needed)."""
import argparse

import pytest
import torch

from bench.multidraft import study as bench_multidraft
from tilespec.multidraft.decoding import Round
from bench.multidraft.experiments import paper_configs, round_block_efficiency, token_acceptance
from tilespec.verify.types import SamplingParams


def synthetic_round(k=8, L=3, v=12, seed=0):
    g = torch.Generator().manual_seed(seed)
    base = torch.randn(1, 1, L + 1, v, generator=g) * 2
    t_logits = base.expand(1, k, L + 1, v).clone()
    d_logits = (base[:, :, :L] + 0.5 * torch.randn(1, 1, L, v, generator=g)).expand(1, k, L, v).clone()
    q = torch.softmax(d_logits.double(), -1)
    toks = torch.multinomial(q.view(-1, v).float(), 1, generator=g).view(1, k, L)
    return Round(target_logits=t_logits, draft_tokens=toks, draft_probs=q, draft_logits=d_logits)


def test_round_block_efficiency_all_settings():
    temps = [1.2, 2.0]
    groups = {1.2: [0, 1, 2, 3], 2.0: [4, 5]}
    cfg = paper_configs(groups, temps, range(2, 5), [1.2, 2.0], 2.0)
    assert {c.setting for c in cfg} == {"fig3", "table1", "fig4", "table2"}
    be = round_block_efficiency(synthetic_round(k=6), cfg, SamplingParams(top_p=0.95), reps=3, seed=1)
    assert all(1.0 <= mean <= 4.0 for mean, _, _ in be.values())


def test_token_acceptance_ordering():
    g = torch.Generator().manual_seed(2)
    t, d = torch.randn(5, 30, generator=g) * 2, torch.randn(5, 30, generator=g) * 2
    acc = token_acceptance(t, t + 0.7 * d, SamplingParams(top_p=0.95), [1.2], ks=(2, 4))
    for k in (2, 4):
        row = acc[1.2][k]
        for i in range(5):
            assert row["optimal"][i] >= max(row["is"][i], row["spectr"][i], row["specinfer"][i]) - 1e-7


def test_bench_rejects_bad_arguments():
    parser = argparse.ArgumentParser()
    bench_multidraft.add_arguments(parser)
    with pytest.raises(ValueError, match="must include 1.2"):
        bench_multidraft.run(parser.parse_args(["--temps", "1.4,2.0"]))
    with pytest.raises(ValueError, match="max-k"):
        bench_multidraft.run(parser.parse_args(["--max-k", "1"]))


def test_time_generation_on_tiny_models():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=8, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                      num_key_value_heads=2, max_position_embeddings=64)
    target, draft = LlamaForCausalLM(cfg).eval(), LlamaForCausalLM(cfg).eval()
    args = argparse.Namespace(temps="1.2", L=2, device="cpu", timing_tokens=3)
    out = bench_multidraft.time_generation(target, draft, [torch.tensor([[1, 2]])], args, SamplingParams(top_p=0.95))
    assert set(out["T=1.2"]) == {"sd", "specinfer", "spectr", "is"}
    assert out["T=1.2"]["sd"]["gain_over_sd_pct"] == 0.0
    assert all(r["tokens"] == 3 for r in out["T=1.2"].values())
    args.timing_ks = "2,3"                                      # K = 3 rows are keyed scheme/K=3
    out = bench_multidraft.time_generation(target, draft, [torch.tensor([[1, 2]])], args, SamplingParams(top_p=0.95))
    assert set(out["T=1.2"]) == {"sd", "specinfer", "spectr", "is", "specinfer/K=3", "spectr/K=3", "is/K=3"}
    assert out["T=1.2"]["is/K=3"]["K"] == 3 and out["T=1.2"]["is"]["K"] == 2
