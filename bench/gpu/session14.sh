#!/usr/bin/env bash
# Session 14 (issue 15 follow-up) on one H100, from the repository root; results under $OUT.
#   bash bench/gpu/session14.sh a   # GPU kernel tests + the 16-bit top-k / filtered-fused bench (~5 min)
#   bash bench/gpu/session14.sh b   # exactness of fused + reference at 1e6, then `tilespec bench verify --filters`
#                                   # (fused, sigmoid, transformers, FlashInfer in one process; ~2.5 min; carry .whl)
OUT=${OUT:-/tmp/s14-out}
source "$(dirname "$0")/steps.sh"
D=$(date -u +%Y-%m-%d)
case "${1:-a}" in
a)
  step pytest-gpu 200 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_kernels_gpu.py
  step filters16 240 python3 bench/scripts/filters16_bench.py --json "$OUT/filters16-H100-session14-${RUN:-run}-$D.json"
  for b in 64 1; do
    step ncu-topk16-B$b 60 ncu --nvtx --nvtx-include "topk16/" --section SpeedOfLight --section LaunchStats \
      python3 bench/scripts/ncu_topk16.py --batch $b
    grep -E "^  [_a-zA-Z]|Duration|DRAM Throughput|Compute \(SM\) Throughput" "$OUT/ncu-topk16-B$b.log" | cut -c1-100
  done
  tail -4 "$OUT/pytest-gpu.log"
  cat "$OUT/filters16.log"
  ;;
b)
  step exactness 110 python3 -m tilespec check exactness --method fused --method reference --device cuda \
    --samples 1000000 --json "$OUT/exactness-gpu-H100-session14-fused-reference-1e6-$D.json"
  tail -5 "$OUT/exactness.log"
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl && export PYTHONPATH=$PYTHONPATH:/tmp/site
  step bench-verify 150 python3 -m tilespec bench verify --batch 1 64 --draft 5 --vocab 151936 --dtype bf16 \
    --filters --check --contenders fused sigmoid hf flashinfer --time-budget 100 --json "$OUT/verify-H100-session14-$D.json"
  grep -v '^\s*$' "$OUT/bench-verify.log" | tail -40
  ;;
esac
ts "done"
