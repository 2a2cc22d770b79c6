#!/usr/bin/env bash
# Issue 4 on a GPU machine prepared by bench/gpu/setup.sh: exactness of fused/tiled at 1e6 samples, the verify
# benchmark against transformers and FlashInfer (one run, same inputs), the GPU tests, per-kernel times, and with
# NCU=1 an Nsight Compute profile of the two fused kernels (B=1 and B=64).
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
ts "GPU tests (kernels vs the PyTorch reference, engine graphs vs eager)"
python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_kernels_gpu.py tests/test_engine_gpu.py \
  > "$OUT/pytest-gpu.log" 2>&1; echo "pytest rc=$? ($(tail -1 "$OUT/pytest-gpu.log"))"
if [ -f bench/scripts/ncu_fused.py ]; then
  ts "kernel times (torch.profiler, eager, graph replay) of the fused path"
  python3 bench/scripts/ncu_fused.py --json "$OUT/ncu-kernels.json" > "$OUT/ncu-kernels.log" 2>&1 || tail -3 "$OUT/ncu-kernels.log"
  if [ "${NCU:-0}" = 1 ] && command -v ncu >/dev/null; then
    for b in 1 64; do  # only the two kernels of one call inside the NVTX range (not the warm-up)
      timeout 120 ncu --nvtx --nvtx-include "tilespec_fused_B$b/" --set full --clock-control none -f \
        -o "$OUT/ncu-fused-B$b" python3 bench/scripts/ncu_fused.py --batch $b --no-timing > "$OUT/ncu-B$b.log" 2>&1
      ncu --import "$OUT/ncu-fused-B$b.ncu-rep" --page details --csv > "$OUT/ncu-fused-B$b.csv" 2>/dev/null || true
    done
  fi
fi
ts done
