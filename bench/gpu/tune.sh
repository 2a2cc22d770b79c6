#!/usr/bin/env bash
# Kernel-only GPU session (no models needed): launch-parameter sweep of `fused`, the GPU kernel tests with and
# without direct launches, eager/graph call times with and without direct launches, and the exactness suite.
#   TUNE_PART  1: sweep + tests (default), 2: call times + exactness + verify benchmark with direct launches
# Writes everything under $R (default /root/res) and tars it to $OUT/res.tgz (the device returns at most 8 files).
set -u
R=${R:-/root/res}; mkdir -p "$R"
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
ts() { echo "[$(date +%H:%M:%S)] $*"; }
if [ "${TUNE_PART:-1}" = 1 ]; then
  ts "tune_fused sweep"
  python3 bench/scripts/tune_fused.py --json "$R/tune-fused.json" --time-budget "${TUNE_BUDGET_S:-200}" > "$R/tune.log" 2>&1
  tail -12 "$R/tune.log"
  for direct in 0 1; do
    ts "GPU kernel tests, TILESPEC_DIRECT_LAUNCH=$direct"
    TILESPEC_DIRECT_LAUNCH=$direct python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_kernels_gpu.py \
      > "$R/pytest-direct$direct.log" 2>&1; echo "rc=$? $(tail -1 "$R/pytest-direct$direct.log")"
  done
else
  for direct in 0 1; do
    ts "fused call times, TILESPEC_DIRECT_LAUNCH=$direct"
    TILESPEC_DIRECT_LAUNCH=$direct python3 bench/scripts/ncu_fused.py --batch 1 --batch 64 \
      --json "$R/fused-times-direct$direct.json" > "$R/fused-times-direct$direct.log" 2>&1 || tail -3 "$R/fused-times-direct$direct.log"
  done
  ts "exactness fused+tiled, 1e6 samples, direct launches"
  TILESPEC_DIRECT_LAUNCH=1 python3 -m tilespec check exactness --method fused --method tiled --device cuda \
    --samples 1000000 --no-power-check --json "$R/exactness-direct.json" > "$R/exactness.log" 2>&1; tail -1 "$R/exactness.log"
  ts "bench verify with direct launches"
  TILESPEC_DIRECT_LAUNCH=1 python3 -m tilespec bench verify --check --batch 1 8 64 --draft 1 5 20 --vocab 151936 \
    --dtype bf16 --sweep --time-budget "${VERIFY_BUDGET_S:-120}" --json "$R/verify-direct.json" \
    --plot "$R/verify-direct.png" > "$R/verify.log" 2>&1; tail -4 "$R/verify.log"
fi
ts done
tar -czf "$OUT/res.tgz" -C "$R" .
