"""GPU: decode attention alone, cuDNN SDPA (the native layer's default) against tilespec's split-KV kernels
(engine/native/attention.py), over the shapes the engine meets: B in {1, 8, 64} requests, q in {1, 2, 5, 16, 32}
query tokens (a step, a chain's verify, a token tree), C in {512, 1280, 4352} cache slots (a decoder's capacity, a
server's rows), ``used`` slots valid per request. Qwen2.5-1.5B heads (12 query, 2 KV, D 128), bf16, CUDA-graph
replay µs per call. Decides which attention the native layer picks per traced shape (llama.decoder_layer).

Usage: python3 bench/scripts/attention_shapes.py --json OUT.json [--batches 1,8 --queries 5,32 --capacities 512]
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(__file__))
from native_kernels import attention_inputs, graph_us  # noqa: E402


def split_us(attention, split: int, q, k, v, mask) -> float:
    """The kernels' µs at another SPLIT (cache slots per program; the module's constant is restored)."""
    default = attention.SPLIT
    attention.SPLIT = split
    try:
        return graph_us(lambda: torch.ops.tilespec.decode_attention(q, k, v, mask))
    finally:
        attention.SPLIT = default


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", required=True)
    ints = lambda text: tuple(int(x) for x in text.split(","))    # noqa: E731
    ap.add_argument("--batches", type=ints, default=(1, 8, 64))
    ap.add_argument("--queries", type=ints, default=(1, 2, 5, 16, 32))
    ap.add_argument("--capacities", type=ints, default=(512, 1280, 4352))
    args = ap.parse_args()
    from tilespec.engine.native import attention    # registers torch.ops.tilespec.decode_attention
    from tilespec.env import run_record
    rows = []
    for b, nq, c in itertools.product(args.batches, args.queries, args.capacities):
        used = min(c - nq, 400)
        q, k, v, mask = attention_inputs(b, nq, c, used)
        ref = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
        out = torch.ops.tilespec.decode_attention(q, k, v, mask).transpose(1, 2)
        row = dict(batch=b, q=nq, capacity=c, used=used,
                   sdpa_us=graph_us(lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)),
                   kernel_us=graph_us(lambda: torch.ops.tilespec.decode_attention(q, k, v, mask)),
                   **{f"kernel_us_split{split}": split_us(attention, split, q, k, v, mask) for split in (64, 128, 512)},
                   max_abs_diff=(out.float() - ref.float()).abs().max().item())
        print(row, flush=True)
        rows.append(row)
    with open(args.json, "w") as f:
        json.dump(dict(run_record("cuda"), heads=dict(q=12, kv=2, d=128), dtype="bfloat16", rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
