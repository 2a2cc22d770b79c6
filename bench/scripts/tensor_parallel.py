"""Tensor-parallel decoding of random-init Qwen2.5 shapes (7B / 14B / 32B / 72B, from their configurations; no
weights, no network) on the GPUs of one host, bf16, greedy, 128 new tokens, through the engine
(``SpeculativeDecoder``, compile=True: native runtime, whole-step CUDA graphs). Items of ``--plan``, comma-separated,
each ``SHAPE:TP`` followed by options in any order:

  * ``nccl`` / ``symm`` / ``best`` / ``auto``: the all-reduce (default ``best``: NCCL and symmetric memory timed per
    shape at startup, each in a CUDA graph, the faster kept on every rank; the times are recorded per item);
  * ``bN``: N rows (default 1);
  * ``spec``: a context drafter that always proposes ``--spec-k`` tokens (host-side, like ngram): the speculative
    step's cost against the plain step of the same shape, degree, batch and all-reduce;
  * ``nocomm``: the same step with every collective dropped (sums the identity, logits tiled; the tokens are
    wrong): the sums' share of a step;
  * ``check``: fp32 tiny model, TP=N tokens against TP=1's (compiled, captured), with ``auto``: check mode too.

TP=1 runs on rank 0 alone (the full random model on its GPU); 1 < TP < world on ranks 0..TP-1 (a sub-mesh); the other
ranks wait. A TP>1 model is built directly sharded: a meta-device model whose shards each rank fills with random
values on its own GPU, so no rank ever holds the full model in host or device memory (72B: ~38 GB a rank at TP=4).

Per item: per-step latency (t(128 tokens) - t(1 token)) / steps, each t the fastest of 2 runs after a warm-up that
compiled and captured every shape (prefill cancels; a plain step emits one token per row); the HBM floor: the bytes
a rank reads per step (its weight shards + its K/V heads over the mean context) / the per-GPU copy bandwidth measured
in the same run; the share of the floor = floor / step. ``derived`` (tensor_parallel_model.derive): ratios to TP=1,
the sums' share of a step, the speculative step's extra cost c and speedups projected from c and α (``projection``).

    NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 \\
      torchrun --nproc-per-node 4 bench/scripts/tensor_parallel.py --out RESULT.json --plan 72b:4:b1,72b:4:b8,...

Each finished item is written at once (rank 0), so a run cut short keeps what it did. ``--out DIR`` writes
DIR/tensor-parallel.json; ``--append`` keeps the items an earlier run wrote there.
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

sys.path.insert(0, str(Path(__file__).resolve().parent))
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from tensor_parallel_model import (SHAPES, FixedDrafts, copy_bandwidth, derive, kv_bytes, meta_model,  # noqa: E402
                                   qwen_config, random_model, sync, weight_bytes)

DEFAULT_PLAN = "14b:2:nccl,14b:1,14b:2:symm,32b:2,14b:2:spec,tiny:2:check,7b:2,7b:1,14b:1:spec,32b:1"
PROMPT = [(17 * i + 3) % 150_000 + 100 for i in range(32)]
NEW_TOKENS = 128
ALLREDUCES = ("nccl", "symm", "best", "auto")


def parse_item(item: str, world: int) -> dict:
    """``SHAPE:TP[:option...]`` -> {"shape", "tp", "allreduce", "batch", "kind"}; ValueError naming the problem."""
    parts = item.strip().split(":")
    if len(parts) < 2 or parts[0] not in SHAPES or not parts[1].isdigit():
        raise ValueError(f"plan item {item!r}: expected SHAPE:TP[:options] with SHAPE one of {', '.join(SHAPES)}")
    tp = int(parts[1])
    if not 1 <= tp <= world:
        raise ValueError(f"plan item {item!r}: TP {tp} outside 1..{world} (the launch's processes)")
    spec = {"shape": parts[0], "tp": tp, "allreduce": "best" if tp > 1 else None, "batch": 1, "kind": "plain"}
    for opt in parts[2:]:
        if opt in ALLREDUCES:
            spec["allreduce"] = opt if tp > 1 else None
        elif opt in ("spec", "nocomm", "check"):
            spec["kind"] = opt
        elif opt[:1] == "b" and opt[1:].isdigit() and int(opt[1:]) > 0:
            spec["batch"] = int(opt[1:])
        else:
            raise ValueError(f"plan item {item!r}: unknown option {opt!r} (nccl, symm, best, auto, bN, spec, "
                             f"nocomm, check)")
    from tilespec.engine.native.tensor_parallel import check_divisible
    check_divisible(qwen_config(spec["shape"]), tp)
    return spec


def timed(dec, prompts, tokens: int, group, repeats: int = 2) -> tuple[float, object]:
    """Fastest wall seconds of ``repeats`` generations of ``tokens`` new tokens (the item's ranks start together),
    and the last one's stats."""
    times, stats = [], None
    for _ in range(repeats):
        if group is not None:
            dist.barrier(group=group)
        sync()
        t = time.perf_counter()
        out = dec.generate(prompts, max_new_tokens=tokens, seed=0)
        sync()
        times.append(time.perf_counter() - t)
        stats = out.stats
    return min(times), (stats, out.sequences[0])


def measure(model, batch: int, spec_k: int, group) -> dict:
    from tilespec.engine import SpeculativeDecoder
    draft = FixedDrafts(spec_k) if spec_k else None
    compile = True if torch.cuda.is_available() else "native"       # CPU: the smoke test, eager native runtime
    dec = SpeculativeDecoder(model, draft, gamma=max(spec_k, 1), compile=compile, eos_token_id=[])
    prompts = [PROMPT[i:] + PROMPT[:i] for i in range(batch)]
    t0 = time.perf_counter()
    dec.generate(prompts, max_new_tokens=NEW_TOKENS, seed=0)      # compile + capture of every shape used below
    dec.generate(prompts, max_new_tokens=1, seed=0)
    warm = time.perf_counter() - t0
    t1, (s1, _) = timed(dec, prompts, 1, group)
    tn, (sn, seq) = timed(dec, prompts, NEW_TOKENS, group)
    steps = sn.target_calls - s1.target_calls
    row = {"warmup_s": round(warm, 2), "t_1_token_s": t1, f"t_{NEW_TOKENS}_tokens_s": tn, "steps": steps,
           "per_step_ms": (tn - t1) / steps * 1e3, "tokens_per_s": batch * (NEW_TOKENS - 1) / (tn - t1),
           "runtime": sn.runtime, "tokens_head": seq[:8]}
    if spec_k:
        row.update(k=spec_k, alpha=sn.alpha, drafted=sn.drafted)
    return row


def check_tokens(tp, allreduce: str) -> dict:
    """fp32 tiny Qwen2 (same random weights on every rank): rank 0's unsharded tokens against the sharded model's,
    compiled and captured, greedy, target-only and with K=2 fixed drafts. With ``allreduce`` "auto": the ranks'
    inputs compared on the device (check mode) and, with the symmetric-memory limit lowered to 512 elements, the
    prefill's sums take the NCCL fallback while decode sums take symmetric memory."""
    from tilespec.engine.native import tp_collectives
    limit = tp_collectives.SYMM_MAX_ELEMENTS
    if allreduce == "auto":
        tp_collectives.SYMM_MAX_ELEMENTS = 512
    try:
        return _check_tokens(tp, allreduce)
    finally:
        tp_collectives.SYMM_MAX_ELEMENTS = limit       # the items after this one keep the usual limit


def _check_tokens(tp, allreduce: str) -> dict:
    import copy

    from transformers import Qwen2ForCausalLM

    from tilespec.engine import SpeculativeDecoder
    from tilespec.engine.native.tensor_parallel import check_consistent, shard
    torch.manual_seed(0)
    full = Qwen2ForCausalLM(qwen_config("tiny")).eval().to(tp.device)

    def run(model):
        compile = True if torch.cuda.is_available() else "native"
        return [SpeculativeDecoder(model, d, gamma=2, compile=compile, eos_token_id=[]).generate(
            [PROMPT[:12]], max_new_tokens=24, seed=0).sequences[0] for d in (None, FixedDrafts(2))]
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


def groups(tp_world, degrees) -> dict:
    """{degree: TensorParallel of ranks 0..degree-1, or None on the ranks outside it}; made on every rank in the
    same order (creating a sub-mesh is collective)."""
    from torch.distributed.device_mesh import DeviceMesh

    from tilespec.engine.native.tensor_parallel import TensorParallel
    out = {tp_world.size: tp_world}
    for n in sorted(set(degrees) - {1, tp_world.size}):
        mesh = DeviceMesh(tp_world.device.type, list(range(n)), mesh_dim_names=("tp",))
        out[n] = TensorParallel(rank=tp_world.rank, size=n, device=tp_world.device, mesh=mesh) \
            if tp_world.rank < n else None
    return out


def run_item(spec: dict, tp, bws: list, args) -> dict:
    """One plan item on this rank (a member of its group); the row to record."""
    from tilespec.engine.native.tensor_parallel import BEST, SYMM_VARIANT, shard
    shape, n, batch, kind = spec["shape"], spec["tp"], spec["batch"], spec["kind"]
    row = dict(spec)
    if kind == "check":
        row.update(check_tokens(tp, spec["allreduce"] or "nccl"))
        return row
    if n == 1:
        model = random_model(shape, tp.device)
    else:
        model = shard(meta_model(shape), tp, allreduce=spec["allreduce"], seed=1)
        row["allreduce_resolved"] = model._tilespec_native.allreduce
        if kind == "nocomm":
            model._tilespec_native.drop_collectives()
    group = tp.mesh.get_group() if n > 1 else None
    row.update(measure(model, batch, args.spec_k if kind == "spec" else 0, group))
    del model
    if n > 1:
        row["allreduce_measured"] = [v for k, v in BEST.items() if k[0] == tp.group_name]
        row["symm_variant"] = SYMM_VARIANT[0]
    context = len(PROMPT) + NEW_TOKENS / 2
    row["weight_bytes_rank"] = weight_bytes(shape, n)
    row["kv_bytes_rank"] = kv_bytes(shape, n, batch, context)
    floor = (row["weight_bytes_rank"] + row["kv_bytes_rank"]) / min(bws[:n])
    if shape != "tiny":
        row["hbm_floor_ms"] = floor * 1e3
        row["share_of_floor"] = floor * 1e3 / row["per_step_ms"]
    return row


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True, help="result JSON (.json) or a folder for tensor-parallel.json")
    ap.add_argument("--plan", default=DEFAULT_PLAN, help="items SHAPE:TP[:nccl|symm|best|auto][:bN][:spec|nocomm|"
                                                         "check], in order")
    ap.add_argument("--budget-s", type=float, default=420.0, help="start no item after this many seconds")
    ap.add_argument("--spec-k", type=int, default=4)
    ap.add_argument("--alphas", default="0.5,0.6,0.7,0.8", help="acceptance rates of the projected speedups")
    ap.add_argument("--append", action="store_true", help="keep the items already in the output file")
    ap.add_argument("--timeout-s", type=float, default=180.0,
                    help="a collective waiting longer than this for another rank fails (and ends the run)")
    args = ap.parse_args()
    start = time.perf_counter()
    from tilespec.engine.native.tensor_parallel import init_tensor_parallel, run_rank
    world = int(os.environ.get("WORLD_SIZE", "1"))
    tp_world = init_tensor_parallel(world, timeout_s=args.timeout_s)
    return run_rank(lambda: _run(args, tp_world, start))


def _run(args, tp_world, start: float) -> int:
    specs = [parse_item(item, tp_world.size) for item in args.plan.split(",") if item.strip()]  # before any work
    alphas = [float(a) for a in args.alphas.split(",")]
    main_rank = tp_world.rank == 0
    by_degree = groups(tp_world, [s["tp"] for s in specs])
    import transformers
    import triton
    bw = copy_bandwidth(tp_world.device)
    bws = [None] * tp_world.size
    dist.all_gather_object(bws, bw)
    out = args.out / "tensor-parallel.json" if args.out.suffix != ".json" else args.out
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    device = tp_world.device
    result = {"what": "tensor-parallel decoding, random-init Qwen2.5 shapes, bf16, greedy, 128 new tokens",
              "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
              "gpus": tp_world.size, "torch": torch.__version__, "triton": triton.__version__,
              "transformers": transformers.__version__, "commit": os.environ.get("TILESPEC_COMMIT", commit),
              "date": datetime.date.today().isoformat(),
              "env": {k: os.environ.get(k) for k in ("NCCL_NVLS_ENABLE", "TORCH_SYMM_MEM_DISABLE_MULTICAST",
                                                     "NVSHMEM_DISABLE_NVLS")},
              "copy_bandwidth_Bps": bws, "method": __doc__, "items": []}
    if args.append and out.exists():
        result["items"] = json.loads(out.read_text()).get("items", [])

    def save():
        if main_rank:
            result["derived"] = derive(result["items"], alphas)
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_text(json.dumps(result, indent=1))

    for item, spec in zip(args.plan.split(","), specs):
        if time.perf_counter() - start > args.budget_s:
            result["items"].append({"item": item, "skipped": "time budget"})
            continue
        tp = by_degree.get(spec["tp"], tp_world)
        member = tp_world.rank == 0 if spec["tp"] == 1 else tp is not None
        row = {"item": item}
        if member:
            try:
                row.update(run_item(spec, tp, bws, args))
            except Exception as err:   # record and go on (a failed all-reduce variant must not cost the other items)
                row["error"] = f"{type(err).__name__}: {err}"[:800]
                print(f"[rank {tp_world.rank}] {item}: {row['error']}", file=sys.stderr, flush=True)
            release()
        dist.barrier()
        row["elapsed_s"] = round(time.perf_counter() - start, 1)
        result["items"].append(row)
        if main_rank:
            print(json.dumps({k: v for k, v in row.items() if k not in ("tp1", "tpN", "method")}), flush=True)
        save()
    save()
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
