#!/usr/bin/env bash
# Issue 15 (fast exact `fused`) on one offline H100: ~5 minutes wall, no model weights, no FlashInfer, nothing to
# carry (torch / triton / transformers of the machine; wheels in /tmp/site are used if an earlier setup left them).
#   bash bench/gpu/issue15.sh            # from the repository root; results under $OUT (default /tmp/issue15-out)
# Steps (each under `timeout`, each continues on failure, all against one wall-clock deadline ISSUE15_WALL_S=290):
#   1. bench/scripts/issue15_bench.py: old vs new fused variants side by side in one process (graph replay + eager,
#      B=1 and 64, K=5, V=151936, bf16, T=1, per-kernel CUDA times, agreement with `reference`), sigmoid as the
#      yardstick, then top-k 50 / top-p 0.9 (old, new, sigmoid)          -> $OUT/issue15.json, issue15-bench.log
#   2. GPU kernel tests (tests/test_kernels_gpu.py incl. the stream pass-1 checks; the CPU-only files in the list
#      are deselected by -m gpu)                                          -> $OUT/pytest-gpu.log
#   3. tune_fused.py --sweeps stream pass2 --quick: the stream pass 1's launch parameters (slice / warps, register
#      cap, chunks per program, prefetch), the classic kernel, then pass 2's tiles per program x warps, B=1 and 64
#                                                                         -> $OUT/tune-stream.json, tune-stream.log
#   4. if time is left: the exactness suite for fused at 2e5 samples      -> $OUT/exactness-fused.json
# A summary table is printed last (and written to $OUT/summary.txt).
set -u
OUT=${OUT:-/tmp/issue15-out}
mkdir -p "$OUT"
START=$(date +%s)
WALL=${ISSUE15_WALL_S:-290}
export PYTHONUNBUFFERED=1 TRITON_DEFAULT_FP_FUSION=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
export PYTHONPATH=$PWD/src${PYTHONPATH:+:$PYTHONPATH}
[ -d /tmp/site ] && export PYTHONPATH=/tmp/site:$PYTHONPATH
export TILESPEC_COMMIT=${TILESPEC_COMMIT:-$(git rev-parse HEAD 2>/dev/null || echo unknown)}
ts() { echo "[$(date -u +%H:%M:%S) +$(( $(date +%s) - START ))s] $*"; }
left() { echo $(( WALL - ($(date +%s) - START) )); }
step() {  # step NAME MAX_SECONDS CMD...: run under timeout min(MAX, time left - 5), log to $OUT/NAME.log
  local name=$1 max=$2; shift 2
  local limit=$(( $(left) - 5 )); [ "$limit" -gt "$max" ] && limit=$max
  if [ "$limit" -lt 15 ]; then ts "skip $name (wall-clock budget spent)"; return; fi
  ts "start $name (timeout ${limit}s)"
  timeout -k 5 "$limit" "$@" > "$OUT/$name.log" 2>&1
  ts "end $name rc=$? : $(grep -v '^\s*$' "$OUT/$name.log" | tail -1 | cut -c1-160)"
}

{
  echo "commit $TILESPEC_COMMIT"
  nvidia-smi --query-gpu=name,memory.total,clocks.max.sm,driver_version --format=csv,noheader 2>&1
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, \
'cuda', torch.version.cuda)" 2>&1
} > "$OUT/env.txt"
cat "$OUT/env.txt"

step issue15-bench 115 python3 bench/scripts/issue15_bench.py --filters --time-budget 95 --json "$OUT/issue15.json"
step pytest-gpu 90 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_kernels_gpu.py \
  tests/test_kernels_pass1_loop.py tests/test_kernels_stream.py
step tune-stream 85 python3 bench/scripts/tune_fused.py --sweeps stream pass2 --quick --batch 1 64 \
  --profiler-iters 0 --graph-iters 100 --time-budget 60 --json "$OUT/tune-stream.json"
step exactness-fused 60 python3 -m tilespec check exactness --method fused --device cuda --samples 200000 \
  --json "$OUT/exactness-fused.json"

python3 - "$OUT" > "$OUT/summary.txt" 2>&1 <<'PY'
import json, sys
from pathlib import Path
out = Path(sys.argv[1])
print("== issue 15 summary (us; H100 graph replay / eager; not a substitute for the JSON) ==")
print((out / "env.txt").read_text().strip())
try:
    rep = json.loads((out / "issue15.json").read_text())
    sig = {(r["batch"], r["filter"]): r for r in rep["rows"] if r["method"] == "sigmoid" and not r["error"]}
    print(f"{'B':>3} {'filter':9} {'variant':16} {'graph':>8} {'eager':>8} {'x sigm':>7} {'pass1':>7} {'pass2':>7} "
          f"{'same':>5}")
    for r in rep["rows"]:
        if r["error"]:
            print(f"{r['batch']:>3} {r['filter']:9} {r['variant']:16} ERROR {r['error'][:80]}")
            continue
        s = sig.get((r["batch"], r["filter"]))
        sp = r.get("split") or {}
        p1, p2 = sp.get("pass1_us"), sp.get("pass2_us")
        f = lambda x, w=7: f"{x:{w}.1f}" if isinstance(x, (int, float)) else f"{'-':>{w}}"  # noqa: E731
        ratio = r["graph_us"] / s["graph_us"] if s and r["graph_us"] and s["graph_us"] else None
        name = r["variant"] if r["method"] == "fused" else "sigmoid"
        print(f"{r['batch']:>3} {r['filter']:9} {name:16} {f(r['graph_us'], 8)} {f(r['eager_us'], 8)} "
              f"{f(ratio) if ratio is None else f'{ratio:7.2f}'} {f(p1)} {f(p2)} "
              f"{str(r['same_rows_as_reference'])[:5]:>5}")
except Exception as err:  # noqa: BLE001
    print("issue15.json:", err)
try:
    tune = json.loads((out / "tune-stream.json").read_text())
    for b, best in tune["best"].items():
        d = tune["default_runs"].get(b, {})
        print(f"tune B={b}: default {d.get('graph_us')} us")
        for kind, run in best.items():
            if run:
                diff = {k: v for k, v in (run.get("params") or {}).items() if tune["defaults"].get(k) != v}
                print(f"  {kind}: {run.get('graph_us')} us same={run.get('same_outputs')} vs defaults: {diff}")
except Exception as err:  # noqa: BLE001
    print("tune-stream.json:", err)
for name in ("pytest-gpu", "exactness-fused"):
    p = out / f"{name}.log"
    lines = [x for x in p.read_text().splitlines() if x.strip()] if p.exists() else ["(not run)"]
    print(f"{name}: {lines[-1][:200]}")
PY
ts "done"
cat "$OUT/summary.txt"
