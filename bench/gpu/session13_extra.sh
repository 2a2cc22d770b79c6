#!/usr/bin/env bash
# Session 13 extra (issue 15's missed targets): what bounds the filtered step (ncu over every kernel of one fused
# call at B=64 with top-k 50 / top-p 0.9) and the eager B=1 call (torch.profiler CUDA times vs host wall time, and
# cProfile of 200 eager calls). Results under $OUT.
set -u
OUT=${OUT:-/tmp/s13x-out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD/src${PYTHONPATH:+:$PYTHONPATH}
S="--section SpeedOfLight --section LaunchStats --section Occupancy"
timeout 120 ncu --nvtx --nvtx-include "tilespec_fused_B64/" $S python3 bench/scripts/ncu_fused.py --batch 64 \
  --top-k 50 --no-timing > "$OUT/ncu-B64-topk50.log" 2>&1; echo "topk rc=$?"
timeout 120 ncu --nvtx --nvtx-include "tilespec_fused_B64/" $S python3 bench/scripts/ncu_fused.py --batch 64 \
  --top-p 0.9 --no-timing > "$OUT/ncu-B64-topp09.log" 2>&1; echo "topp rc=$?"
timeout 120 python3 bench/scripts/ncu_fused.py --batch 1 --json "$OUT/eager-B1-profile.json" > "$OUT/eager-B1.log" 2>&1
echo "eager rc=$?"
timeout 60 python3 - > "$OUT/eager-B1-cprofile.txt" 2>&1 <<'PY'
import cProfile, pstats, sys, torch
sys.path.insert(0, "bench/scripts")
from ncu_fused import make_inputs
from tilespec import verify
t, d, k = make_inputs(torch, 1, 5, 151936, torch.bfloat16, "logits", 0)
seeds = torch.zeros(1, dtype=torch.int64, device="cuda"); off = torch.full((1,), 1000, dtype=torch.int64, device="cuda")
call = lambda: verify(t, k, draft_logits=d, method="fused", seed=seeds, offsets=off, check_values=False)
for _ in range(20): call()
torch.cuda.synchronize()
pr = cProfile.Profile(); pr.enable()
for _ in range(200):
    call(); torch.cuda.synchronize()
pr.disable()
pstats.Stats(pr).sort_stats("cumulative").print_stats(30)
PY
echo "cprofile rc=$?"
for f in "$OUT"/ncu-B64-*.log; do echo "== $f"; grep -E "^\s+[a-zA-Z_0-9]+.*\(\d*|Duration|DRAM Throughput|Grid Size" "$f" | head -40; done
grep -E "eager|graph|kernel" "$OUT/eager-B1.log" | head -20
head -45 "$OUT/eager-B1-cprofile.txt" | tail -35
