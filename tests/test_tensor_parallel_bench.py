"""The tensor-parallel benchmark's arithmetic (bench/scripts/tensor_parallel*.py), no processes: plan parsing and its
errors, the bytes a rank reads per step against the meta model's parameters, the 72B shard fitting one H100 at TP=4,
the TP=1 baseline refusing a model larger than its GPU, and the derived shares and projections."""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


def _load(name: str):
    path = next(p for p in sorted(ROOT.glob(f"bench*/**/{name}.py")) if ".git" not in p.parts)
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def model_lib():
    return _load("tensor_parallel_model")


@pytest.fixture
def script(monkeypatch, model_lib):
    for var, value in (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"),
                       ("NVSHMEM_DISABLE_NVLS", "1")):
        monkeypatch.setenv(var, value)       # the script sets them when unset; restored after the test
    return _load("tensor_parallel")


def test_plan_items(script):
    assert script.parse_item("72b:4:b8", 4) == {"shape": "72b", "tp": 4, "allreduce": "best", "batch": 8,
                                                "kind": "plain"}
    assert script.parse_item("14b:1:spec:nccl", 4) == {"shape": "14b", "tp": 1, "allreduce": None, "batch": 1,
                                                       "kind": "spec"}
    assert script.parse_item("32b:2:symm:nocomm", 4)["allreduce"] == "symm"
    for item, why in (("13b:2", "SHAPE one of"), ("14b:8", "outside 1..4"), ("14b:2:fast", "unknown option"),
                      ("72b:3", "does not divide"), ("14b:2:b0", "unknown option")):
        with pytest.raises(ValueError, match=why):
            script.parse_item(item, 4)


@pytest.mark.parametrize("shape", ["tiny", "14b"])
def test_weight_bytes_match_the_model(model_lib, shape):
    model = model_lib.meta_model(shape)
    params = sum(p.numel() for n, p in model.named_parameters() if "embed_tokens" not in n)
    assert model_lib.weight_bytes(shape, 1) == 2 * params
    hidden, width, layers, heads, kv = model_lib.SHAPES[shape]
    norms = layers * 2 * hidden + hidden
    vocab8 = model_lib.VOCAB + (-model_lib.VOCAB % 8)
    sharded = 2 * (params - norms - model_lib.VOCAB * hidden)
    assert model_lib.weight_bytes(shape, 8) == sharded // 8 + 2 * norms + 2 * vocab8 // 8 * hidden


def test_72b_shard_fits_one_h100_at_tp4(model_lib):
    hidden = model_lib.SHAPES["72b"][0]
    per_rank = model_lib.weight_bytes("72b", 4) + 2 * model_lib.VOCAB * hidden       # + the replicated embedding
    assert 35e9 < per_rank < 40e9
    kv = model_lib.kv_bytes("72b", 4, batch=8, context=96)
    assert kv == 2 * 8 * 80 * 2 * 2 * 128 * 96          # 2 of 8 K/V heads a rank, head dim 128


def test_tp1_baseline_refuses_a_model_larger_than_its_gpu(model_lib, monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda d: SimpleNamespace(total_memory=80 * 2**30))
    with pytest.raises(MemoryError, match="72b needs 1[0-9]{2} GiB .* does not fit one GPU"):
        model_lib.random_model("72b", torch.device("cuda", 0))


def test_derived_shares_and_projections(model_lib):
    def row(tp, kind, ms, batch=1, **kw):
        return {"shape": "72b", "tp": tp, "batch": batch, "allreduce": "best" if tp > 1 else None, "kind": kind,
                "per_step_ms": ms, **kw}
    items = [row(4, "plain", 20.0), row(4, "nocomm", 17.0), row(4, "spec", 24.0, k=4), row(4, "plain", 26.0, 8),
             {"item": "72b:1", "error": "MemoryError"}, row(1, "plain", 60.0)]
    out = model_lib.derive(items, [0.0, 0.6])
    assert out["ratio_to_tp1"]["72b tp4 b1 best"]["ratio"] == pytest.approx(20 / 60)
    assert "72b tp4 b8 best" not in out["ratio_to_tp1"]           # no TP=1 row at B=8
    assert out["allreduce_share"]["72b tp4 b1 best"]["share"] == pytest.approx(0.15)
    spec = out["spec_step"]["72b tp4 b1 best"]
    assert spec["projection"] is True and spec["c"] == pytest.approx(1.2) and spec["extra_ms"] == pytest.approx(4)
    assert spec["projected_speedup"]["alpha=0"] == pytest.approx(1 / 1.2)
    assert spec["projected_speedup"]["alpha=0.6"] == pytest.approx((1 - 0.6 ** 5) / 0.4 / 1.2)
    assert model_lib.expected_tokens(1.0, 4) == 5
