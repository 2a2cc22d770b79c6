#!/usr/bin/env bash
# Issue 4 on a GPU machine prepared by bench/gpu/setup.sh: exactness of fused/tiled at 1e6 samples, the verify
# benchmark against transformers and FlashInfer (one run, same inputs), and an Nsight Compute profile if ncu exists.
#   VERIFY_BUDGET_S  seconds for the benchmark grid (default 150)
set -u
ts() { echo "[$(date +%H:%M:%S)] $*"; }
ts "exactness fused+tiled, 1e6 samples"
python3 -m tilespec check exactness --method fused --method tiled --device cuda --samples 1000000 --no-power-check \
  --json "$OUT/exactness-gpu.json" 2>&1 | tail -4
ts "bench verify"
python3 -m tilespec bench verify --check --batch 1 8 64 --draft 1 5 10 20 --vocab 151936 32000 256000 \
  --dtype bf16 fp32 --sweep --time-budget "${VERIFY_BUDGET_S:-150}" --json "$OUT/verify.json" --plot "$OUT/verify.png" \
  2>&1 | tail -8
if [ "${NCU:-0}" = 1 ] && command -v ncu >/dev/null && [ -f bench/scripts/ncu_fused.py ]; then
  ts "ncu"
  timeout 120 ncu --set full --nvtx --target-processes all -o "$OUT/ncu-fused" -f \
    python3 bench/scripts/ncu_fused.py --json "$OUT/ncu-kernels.json" 2>&1 | tail -5
  ncu --import "$OUT/ncu-fused.ncu-rep" --page details --csv > "$OUT/ncu-fused-details.csv" 2>/dev/null || true
elif [ -f bench/scripts/ncu_fused.py ]; then
  ts "kernel times from torch.profiler (NCU=1 for an Nsight Compute profile)"
  python3 bench/scripts/ncu_fused.py --json "$OUT/ncu-kernels.json" 2>&1 | tail -3
fi
ts done
