#!/usr/bin/env python3
"""Offline sm_90 compile of the ``fused`` kernels and the draft sampler (``--set gumbel``; no GPU needed):
registers, spills and global-load widths.

Compiles with the installed Triton's frontend for ``GPUTarget("cuda", 90, 32)`` (ptxas from Triton's wheel), reads
the cubin's resource usage with Triton's ``cuobjdump`` and counts the PTX global loads by width. bf16 logits,
draft logits, no filters unless --filters; V and the strides are runtime (not specialised) as in ``launch``.

    TRITON_INTERPRET=0 python3 bench/scripts/sm90_regs.py [--json regs.json]

Register counts from Triton 3.9 may differ by a few from Triton 3.6's (the H100 machines' version).
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

os.environ["TRITON_INTERPRET"] = "0"   # compile, do not interpret (must precede the kernels' import)

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "src"))
from tilespec.env import run_record  # noqa: E402
from tilespec.verify.kernels import gumbel, residual, stream  # noqa: E402

TYPES = {"tgt_ptr": "*bf16", "drf_ptr": "*bf16", "nd_ptr": "*i32", "a_ptr": "*i32", "nrow_ptr": "*i32",
         "cnt_ptr": "*i32", "tok_ptr": "*i64", "seed_ptr": "*i64", "off_ptr": "*i64", "out_ptr": "*i64",
         "nacc_ptr": "*i64", "nemit_ptr": "*i64", "accd_ptr": "*i1", "ids_ptr": "*i64", "pos_ptr": "*i64", "idx_ptr": "*i32"}


def compile_one(fn, consts: dict, num_warps: int, dtype: str = "bf16", maxnreg: int = 0) -> dict:
    sig = {}
    for name in fn.arg_names:
        if name in consts:
            sig[name] = "constexpr"
        elif name in ("tgt_ptr", "drf_ptr", "x_ptr"):
            sig[name] = "*" + dtype
        elif name.endswith("_ptr"):
            sig[name] = TYPES.get(name, "*fp32")
        else:
            sig[name] = "i32"
    # pointers 16-byte aligned, as the JIT specialises them at a launch (V and the strides are not specialised)
    attrs = {(i,): [["tt.divisibility", 16]] for i, name in enumerate(fn.arg_names) if sig[name].startswith("*")}
    kernel = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=consts, attrs=attrs),
                            target=GPUTarget("cuda", 90, 32),
                            options=dict(num_warps=num_warps, **({"maxnreg": maxnreg} if maxnreg else {})))
    ptx = kernel.asm["ptx"]
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
        usage = subprocess.run([str(tool), "--dump-resource-usage", f.name], capture_output=True, text=True).stdout
        sass = subprocess.run([str(tool), "-sass", f.name], capture_output=True, text=True).stdout
    regs = int(re.search(r"REG:(\d+)", usage).group(1))
    stack = int(re.search(r"STACK:(\d+)", usage).group(1))   # register spills land in the stack frame
    loads = collections.Counter(re.findall(r"ld\.global(?:\.\w+)*?\.(v\d\.)?(b\d+|f\d+|u\d+|s\d+)", ptx))
    return dict(regs=regs, stack_bytes=stack, spill_insts=len(re.findall(r"\b(?:LDL|STL)\b", sass)),
                global_loads={(v or "") + w: n for (v, w), n in loads.items()},
                bar_sync=ptx.count("bar.sync"), ex2=ptx.count("ex2.approx"))


def configs(filters: bool, dtype: str, kernels: str = "fused"):
    if kernels == "gumbel":
        for has_ids in (False, True):
            for final in (False, True):
                for block, warps in ((2048, 4), (2048, 8)):
                    yield (f"gumbel.gumbel_chunks_kernel HAS_IDS={has_ids} FINAL={final} BLOCK={block} "
                           f"warps={warps}", gumbel.gumbel_chunks_kernel,
                           dict(PURPOSE=3, HAS_IDS=has_ids, FINAL=final, CHUNK=4096, BLOCK=block), warps)
            yield (f"gumbel.gumbel_pick_kernel HAS_IDS={has_ids}", gumbel.gumbel_pick_kernel,
                   dict(HAS_IDS=has_ids, CB=64), 4)
        return
    common = dict(DRAFT_KIND=1, HAS_THR=filters, NC_BLOCK=32, RB=8)
    for sub, warps in ((1024, 4), (2048, 4), (2048, 8), (512, 4)):
        for aligned in (True, False):
            for pre in (1, 2):
                yield (f"stream.row_stats_stream_kernel SUB={sub} warps={warps} ALIGNED={aligned} PREFETCH={pre}",
                       stream.row_stats_stream_kernel,
                       dict(common, CHUNK=8192, SUB=sub, CPP=2, ALIGNED=aligned, PREFETCH=pre, GROUP=8), warps)
    for tiles, warps in ((4, 8), (8, 8), (4, 4)):
        for aligned in (False, True):
            yield (f"residual.sample_wide_kernel BLOCK=1024 TILES={tiles} warps={warps} ALIGNED={aligned}",
                   residual.sample_wide_kernel,
                   dict(DRAFT_KIND=1, HAS_THR=filters, BLOCK=1024, TILES=tiles, NT_BLOCK=256, ALIGNED=aligned,
                        FAST=True, PDL=False), warps)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", default=None)
    ap.add_argument("--filters", action="store_true")
    ap.add_argument("--dtype", default="bf16", choices=("bf16", "fp16", "fp32"))
    ap.add_argument("--only", default="", help="substring of the config names to compile")
    ap.add_argument("--set", dest="kernels", default="fused", choices=("fused", "gumbel"), help="which kernels")
    ap.add_argument("--maxnreg", type=int, nargs="+", default=[0], help="register caps to compile (0 = none)")
    args = ap.parse_args(argv)
    rows = []
    for name, fn, consts, warps in configs(args.filters, args.dtype, args.kernels):
        if args.only not in name:
            continue
        if "ALIGNED" in consts and "ALIGNED" not in fn.arg_names:
            continue
        for cap in args.maxnreg:
            try:
                row = dict(name=name, maxnreg=cap, **compile_one(fn, consts, warps, args.dtype, cap))
            except Exception as err:  # report and go on
                row = dict(name=name, maxnreg=cap, error=repr(err)[:300])
            rows.append(row)
            print(json.dumps(row), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(dict(run_record(), triton=triton.__version__, dtype=args.dtype,
                                                   filters=args.filters, kernels=args.kernels, target="sm_90",
                                                   rows=rows), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
