#!/usr/bin/env python3
"""Offline sm_90 compile of the 16-bit keep-threshold kernels (topk16, topp16; no GPU needed): every variant the
launchers use compiles, with its registers and spills.

    TRITON_INTERPRET=0 python3 bench/scripts/sm90_thresholds.py [--json out.json]

Compiles with the installed Triton's frontend for ``GPUTarget("cuda", 90, 32)`` (ptxas from Triton's wheel), as
``sm90_regs.py`` does for the ``fused`` kernels: pointers 16-byte aligned, integers not specialised, the
programmatic-dependent-launch variants with ``launch_pdl``. Register counts from Triton 3.9 may differ by a few
from Triton 3.6's (the H100 machines' version).
"""
from __future__ import annotations

import argparse
import itertools
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
from tilespec.verify.kernels import pivot16, thresholds, topk16, topp16  # noqa: E402

POINTERS = {"t_ptr": "*bf16", "d_ptr": "*bf16", "k_ptr": "*i64", "area_ptr": "*i32", "hist_ptr": "*i32",
            "vals_ptr": "*i32", "seg_ptr": "*i32", "x_ptr": "*bf16"}


def compile_one(fn, consts: dict, num_warps: int, pointers: dict = None, pdl: bool = False) -> dict:
    types = dict(POINTERS, **(pointers or {}))
    sig = {name: "constexpr" if name in consts else (types.get(name, "*fp32") if name.endswith("_ptr") else "i32")
           for name in fn.arg_names}
    attrs = {(i,): [["tt.divisibility", 16]] for i, name in enumerate(fn.arg_names) if sig[name].startswith("*")}
    options = dict(num_warps=num_warps, **({"launch_pdl": True} if pdl else {}))
    kernel = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=consts, attrs=attrs),
                            target=GPUTarget("cuda", 90, 32), options=options)
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
        usage = subprocess.run([str(tool), "--dump-resource-usage", f.name], capture_output=True, text=True).stdout
    regs = re.search(r"REG:(\d+)", usage)
    spill = re.search(r"STACK:(\d+)", usage)
    return dict(kernel=fn.__name__, consts={k: v for k, v in consts.items()}, num_warps=num_warps, pdl=pdl,
                registers=int(regs.group(1)) if regs else None, stack=int(spill.group(1)) if spill else None)


def variants():
    bits = dict(DIGITS=topk16.digits16.DIGITS)
    b = dict(zip(("B0", "B1", "B2", "B3"), (*bits["DIGITS"], 0, 0, 0)))
    for fp16, aligned, pdl in itertools.product((False, True), (True, False), (True, False)):
        rows = dict(t_ptr="*fp16", d_ptr="*fp16") if fp16 else None
        yield topp16._max_kernel, dict(CHUNK=topp16.CHUNK, ALIGNED=aligned, AREA=2 + topp16.WINDOW, MIN_P=True,
                                       PDL=pdl), topp16.NUM_WARPS, rows, False
        yield topp16._window_kernel, dict(CHUNK=topp16.CHUNK, ALIGNED=aligned, FP16=fp16, WINDOW=topp16.WINDOW,
                                          AREA=2 + topp16.WINDOW, PDL=pdl), topp16.NUM_WARPS, rows, pdl
        for min_p, search in ((False, True), (True, True), (True, False)):
            yield topp16._finish_kernel, dict(NC_PAD=64, FP16=fp16, WINDOW=topp16.WINDOW, AREA=2 + topp16.WINDOW,
                                              MIN_P=min_p, SEARCH=search, BLOCK=topp16.SEARCH_BLOCK,
                                              BITS=thresholds.BITS, PDL=pdl), 4, rows, pdl
        common = dict(CHUNK=topk16.CHUNK, ALIGNED=aligned)
        yield pivot16.segment_max_kernel, dict(SEG=topk16.SEG, FP16=fp16, PDL=pdl, **common), topk16.NUM_WARPS, \
            rows, False
        yield pivot16.pivot_kernel, dict(SEG_PAD=512, PDL=pdl), 4, None, pdl
        yield pivot16.collect_pivot_kernel, dict(CAP=256, FP16=fp16, PDL=pdl, **common), topk16.NUM_WARPS, rows, pdl
        for has_p, min_p in ((False, False), (True, False), (True, True), (False, True)):
            yield topk16._finish_kernel, dict(CAP=256, HAS_P=has_p, MIN_P=min_p, FP16=fp16, PDL=pdl, **common, **b), \
                topk16.NUM_WARPS, rows, pdl
    yield thresholds._thresholds_kernel, dict(DO_K=True, DO_P=True, BLOCK=2048, BITS=thresholds.BITS), 8, \
        dict(x_ptr="*bf16"), False


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    rows = []
    for fn, consts, warps, pointers, pdl in variants():
        row = compile_one(fn, consts, warps, pointers, pdl)
        print(row, flush=True)
        rows.append(row)
    if args.json:
        from tilespec.env import run_record
        doc = dict(run_record("cpu"), target="sm_90 (offline compile: no GPU ran these kernels)", rows=rows)
        with open(args.json, "w") as fh:
            json.dump(doc, fh, indent=1)


if __name__ == "__main__":
    main()
