"""Tensor-parallel decoding of random-init Qwen2.5 shapes (7B / 14B / 32B, from their configs; no weights) on the
GPUs of one host, B=1, bf16, greedy, 128 new tokens, through the engine (``SpeculativeDecoder``, compile=True:
native runtime, whole-step CUDA graphs):

  * per-token latency at TP=1 (rank 0 alone) and TP=N, for each all-reduce ("nccl": functional collectives;
    "symm": the symmetric-memory one-shot all-reduce), as (t(128 tokens) - t(1 token)) / 127 (prefill cancels;
    each t the fastest of 2 runs after a warm-up that compiled and captured every shape);
  * the HBM floor: weight bytes read per token (layers + LM head) / (N x the copy bandwidth measured here);
  * the speculative step at TP=N with a context drafter that always proposes K tokens (host-side, like ngram):
    its time per step against a target-only step (the extra cost of drafting, verifying K+1 tokens and committing).

    NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 \\
      torchrun --nproc-per-node 2 bench/scripts/tensor_parallel.py --out DIR [--plan 14b:2:nccl,14b:1,...]

Each finished item is written at once to DIR/tensor-parallel.json (rank 0), so a run cut short keeps what it did.
"""
from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import subprocess
import sys
import time
from pathlib import Path

for var, value in (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"), ("NVSHMEM_DISABLE_NVLS", "1")):
    if os.environ.setdefault(var, value) != value:
        sys.exit(f"{var} must be {value}: NVLink multicast stays off on shared hosts")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

SHAPES = {   # Qwen2.5 configs (hidden, MLP width, layers, heads, K/V heads); vocab 152,064, q/k/v biases, untied
    "7b": (3584, 18944, 28, 28, 4), "14b": (5120, 13824, 48, 40, 8), "32b": (5120, 27648, 64, 40, 8),
    "tiny": (64, 128, 2, 4, 2),   # a CPU smoke test of this script (gloo)
}
DEFAULT_PLAN = "14b:2:nccl,14b:1,14b:2:symm,32b:2:best,14b:2:best:spec,tiny:check,7b:2:best,7b:1,14b:1:spec,32b:1"
PROMPT = [(17 * i + 3) % 150_000 + 100 for i in range(32)]


def qwen_config(shape: str):
    from transformers import Qwen2Config
    hidden, width, layers, heads, kv = SHAPES[shape]
    return Qwen2Config(vocab_size=152064, hidden_size=hidden, intermediate_size=width, num_hidden_layers=layers,
                       num_attention_heads=heads, num_key_value_heads=kv, max_position_embeddings=32768,
                       rope_theta=1e6, rms_norm_eps=1e-6, tie_word_embeddings=False)


def meta_model(shape: str):
    """The transformers model on the meta device (shapes only), with a real RoPE table."""
    from transformers import Qwen2ForCausalLM
    cfg = qwen_config(shape)
    with torch.device("meta"):
        model = Qwen2ForCausalLM(cfg).to(torch.bfloat16).eval()
    model.model.rotary_emb = type(model.model.rotary_emb)(config=cfg)
    return model


def random_model(shape: str, device):
    """The full model on ``device`` with random weights (N(0, 0.02); norms 1): the TP=1 baseline."""
    model = meta_model(shape).to_empty(device=device)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1 and "norm" in name:
                p.fill_(1.0)
            else:
                p.normal_(0.0, 0.02)
    model.model.rotary_emb = type(model.model.rotary_emb)(config=model.config).to(device)   # to_empty left garbage
    return model


def weight_bytes(shape: str) -> int:
    """Bytes of the weights one token reads: every layer's projections and norms, the final norm, the LM head."""
    hidden, width, layers, heads, kv = SHAPES[shape]
    d = hidden // heads
    per_layer = hidden * (heads + 2 * kv) * d + (heads + 2 * kv) * d + heads * d * hidden + 3 * width * hidden \
        + 2 * hidden
    return 2 * (layers * per_layer + hidden + 152064 * hidden)


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def copy_bandwidth(device) -> float:
    """Device-to-device copy of 2 GiB (16 MiB on CPU), bytes read + written per second (median of 10)."""
    n = 2**30 // 2 if device.type == "cuda" else 2**23
    a = torch.empty(n, dtype=torch.bfloat16, device=device).normal_()
    b = torch.empty_like(a)
    times = []
    for i in range(13):
        sync()
        t = time.perf_counter()
        b.copy_(a)
        sync()
        if i >= 3:
            times.append(time.perf_counter() - t)
    del a, b
    return 2 * n * 2 / sorted(times)[len(times) // 2]


class FixedDrafts:
    """A context drafter that proposes K copies of the last token every step (host-side, no model, like ngram):
    every step verifies K + 1 tokens, whatever the (random) model emits."""

    def __new__(cls, k: int):
        from tilespec.engine.drafters import ContextDrafter, ContextState

        class State(ContextState):
            def __init__(self, prompts):
                self.last = [p[-1] for p in prompts]

            def extend(self, row, tokens):
                if len(tokens):
                    self.last[row] = int(tokens[-1])

            def propose(self, row, cap):
                return [self.last[row]] * min(cap, k)

        class Fixed(ContextDrafter):
            kind = f"fixed-{k}"

            def start(self, prompts):
                return State(prompts)

        return Fixed()


def timed(dec, tokens: int, together: bool, repeats: int = 2) -> tuple[float, object]:
    """Fastest wall seconds of ``repeats`` generations of ``tokens`` new tokens (``together``: all ranks start
    together), and the last one's (stats, tokens)."""
    times, stats = [], None
    for _ in range(repeats):
        if together:
            dist.barrier()
        sync()
        t = time.perf_counter()
        out = dec.generate([PROMPT], max_new_tokens=tokens, seed=0)
        sync()
        times.append(time.perf_counter() - t)
        stats = out.stats
    return min(times), (stats, out.sequences[0])


def measure(model, spec_k: int = 0, together: bool = True) -> dict:
    from tilespec.engine import SpeculativeDecoder
    draft = FixedDrafts(spec_k) if spec_k else None
    dec = SpeculativeDecoder(model, draft, gamma=max(spec_k, 1), compile=True, eos_token_id=[])
    t0 = time.perf_counter()
    dec.generate([PROMPT], max_new_tokens=128, seed=0)      # compile + capture of every shape used below
    dec.generate([PROMPT], max_new_tokens=1, seed=0)
    warm = time.perf_counter() - t0
    t1, (s1, _) = timed(dec, 1, together)
    t128, (s128, seq) = timed(dec, 128, together)
    steps = s128.target_calls - s1.target_calls
    row = {"warmup_s": round(warm, 2), "t_1_token_s": t1, "t_128_tokens_s": t128,
           "per_token_ms": (t128 - t1) / 127 * 1e3, "steps": steps, "per_step_ms": (t128 - t1) / steps * 1e3,
           "runtime": s128.runtime, "tokens_head": seq[:8]}
    if spec_k:
        row.update(k=spec_k, alpha=s128.alpha, drafted=s128.drafted)
    return row


def check_tokens(tp, allreduce: str = "nccl") -> dict:
    """fp32 tiny Qwen2 (same random weights on every rank): rank 0's unsharded tokens against the sharded model's,
    compiled and captured, greedy, target-only and with K=2 fixed drafts (verify + commit inside the step graph).
    With ``allreduce`` "auto": the ranks' inputs compared on the device (check mode) and, with the symmetric-memory
    limit lowered to 512 elements, the prefill's sums take the NCCL fallback while decode sums take symmetric
    memory."""
    import copy

    from transformers import Qwen2ForCausalLM

    from tilespec.engine import SpeculativeDecoder
    from tilespec.engine.native import tensor_parallel
    from tilespec.engine.native.tensor_parallel import check_consistent, shard
    if allreduce == "auto":
        tensor_parallel.SYMM_MAX_ELEMENTS = 512
    torch.manual_seed(0)
    full = Qwen2ForCausalLM(qwen_config("tiny")).eval().to(tp.device)
    prompt = PROMPT[:12]

    def run(model):
        return [SpeculativeDecoder(model, d, gamma=2, compile=True, eos_token_id=[]).generate(
            [prompt], max_new_tokens=24, seed=0).sequences[0] for d in (None, FixedDrafts(2))]
    ref = run(copy.deepcopy(full)) if tp.rank == 0 else None
    model = shard(full, tp, allreduce=allreduce, check=allreduce == "auto")
    got = run(model)
    if allreduce == "auto":
        check_consistent(model, got)      # raises if any forward's inputs or the tokens differed between ranks
    return {"tokens_equal_tp1": ref == got if tp.rank == 0 else None, "tp1": ref, "tpN": got,
            "allreduce": model._tilespec_native.allreduce, "checked_across_ranks": allreduce == "auto"}


def release() -> None:
    from tilespec.engine.leases import release_compiled
    from tilespec.engine.native.runner import forget_compiled
    release_compiled()
    forget_compiled()
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--plan", default=DEFAULT_PLAN, help="items SHAPE:TP[:ALLREDUCE|best][:spec], in order")
    ap.add_argument("--budget-s", type=float, default=240.0, help="start no item after this many seconds")
    ap.add_argument("--spec-k", type=int, default=4)
    args = ap.parse_args()
    start = time.perf_counter()
    from tilespec.engine.native.tensor_parallel import init_tensor_parallel, shard
    world = int(os.environ.get("WORLD_SIZE", "1"))
    tp = init_tensor_parallel(world)
    main_rank = tp.rank == 0
    import transformers
    import triton
    bw = copy_bandwidth(tp.device)
    bws = [None] * world
    dist.all_gather_object(bws, bw)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    result = {"what": "tensor-parallel decoding, random-init Qwen2.5 shapes, B=1, bf16, greedy, 128 new tokens",
              "device": torch.cuda.get_device_name(tp.device) if tp.device.type == "cuda" else "cpu",
              "gpus": world, "torch": torch.__version__,
              "triton": triton.__version__, "transformers": transformers.__version__,
              "commit": os.environ.get("TILESPEC_COMMIT", commit), "date": datetime.date.today().isoformat(),
              "env": {k: os.environ.get(k) for k in ("NCCL_NVLS_ENABLE", "TORCH_SYMM_MEM_DISABLE_MULTICAST",
                                                     "NVSHMEM_DISABLE_NVLS")},
              "copy_bandwidth_Bps": bws, "method": __doc__, "items": []}
    args.out.mkdir(parents=True, exist_ok=True)
    best: dict = {}

    def save():
        if main_rank:
            (args.out / "tensor-parallel.json").write_text(json.dumps(result, indent=1))

    for item in args.plan.split(","):
        parts = item.split(":")
        shape, n = parts[0], int(parts[1]) if parts[1].isdigit() else world
        spec = parts[-1] == "spec"
        allreduce = parts[2] if len(parts) > 2 and parts[2] != "spec" else "nccl"
        if allreduce == "best":
            allreduce = best.get(shape, best.get("14b", "nccl"))
        if time.perf_counter() - start > args.budget_s:
            result["items"].append({"item": item, "skipped": "time budget"})
            continue
        row = {"item": item, "shape": shape, "tp": n, "weight_bytes": weight_bytes(shape)}
        try:
            if parts[-1] in ("check", "checkauto"):
                row.update(check_tokens(tp, "auto" if parts[-1] == "checkauto" else "nccl"))
            elif n == 1:
                if main_rank:
                    model = random_model(shape, tp.device)
                    row.update(measure(model, args.spec_k if spec else 0, together=False))
                    del model
                dist.barrier()
            else:
                row["allreduce"] = allreduce
                model = shard(meta_model(shape), tp, allreduce=allreduce, seed=1)
                row.update(measure(model, args.spec_k if spec else 0))
                del model
                if allreduce == "symm":
                    from tilespec.engine.native.tensor_parallel import SYMM_VARIANT
                    row["symm_variant"] = SYMM_VARIANT[0]
            floor = row["weight_bytes"] / (n * min(bws))
            if "per_token_ms" in row and shape != "tiny":
                row["hbm_floor_ms"] = floor * 1e3
                row["share_of_floor"] = floor * 1e3 / row["per_token_ms"]
        except Exception as err:   # record and go on (a failed all-reduce variant must not cost the other items)
            row["error"] = f"{type(err).__name__}: {err}"[:800]
            print(f"[rank {tp.rank}] {item}: {row['error']}", file=sys.stderr, flush=True)
        release()
        row["elapsed_s"] = round(time.perf_counter() - start, 1)
        result["items"].append(row)
        ok = {r["allreduce"]: r["per_token_ms"] for r in result["items"]
              if r.get("shape") == shape and r.get("tp", 1) > 1 and "per_token_ms" in r and "spec" not in r["item"]}
        if ok:
            best[shape] = min(ok, key=ok.get)
        if main_rank:
            print(json.dumps(row), flush=True)
        save()
    save()
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
