#!/usr/bin/env bash
# Session 13 (issue 15) on one H100, two calls, from the repository root; results under $OUT.
#   bash bench/gpu/session13.sh a    # variants side by side + GPU kernel tests + ncu of the defaults (~6 min)
#   bash bench/gpu/session13.sh b    # the issue's "done when" run: `tilespec bench verify` with transformers and
#                                    # FlashInfer in the same process, exactness of fused + reference at 1e6 (~8 min)
# Call b needs the FlashInfer + apache-tvm-ffi wheels in .whl/ (carry it). Every step runs under `timeout`, writes
# its log under $OUT and continues on failure; a summary is printed last.
OUT=${OUT:-/tmp/s13-out}
source "$(dirname "$0")/steps.sh"
NCU_SECTIONS="--section SpeedOfLight --section Occupancy --section LaunchStats --section MemoryWorkloadAnalysis --section WarpStateStats --section SchedulerStats"
case "${1:-a}" in
a)
  step issue15-bench 200 python3 bench/scripts/issue15_bench.py --filters --time-budget 170 --json "$OUT/issue15.json"
  step pytest-gpu 120 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_kernels_gpu.py \
    tests/test_kernels_wide.py tests/test_kernels_stream.py
  for b in 64 1; do
    step ncu-B$b 60 ncu --nvtx --nvtx-include "tilespec_fused_B$b/" $NCU_SECTIONS \
      python3 bench/scripts/ncu_fused.py --batch $b --no-timing
  done
  step ncu-sigmoid-B64 45 ncu --nvtx --nvtx-include "tilespec_sigmoid_B64/" $NCU_SECTIONS \
    python3 bench/scripts/ncu_fused.py --batch 64 --method sigmoid --no-timing
  grep -A200 "^summary" "$OUT/issue15-bench.log" | head -60
  ;;
a2)   # after call a: the raw-logit pass 1 loop + linear reference; variants, GPU tests, exactness at 1e6
  step issue15-bench 200 python3 bench/scripts/issue15_bench.py --time-budget 170 --json "$OUT/issue15.json"
  step pytest-gpu 120 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_kernels_gpu.py
  D=$(date -u +%Y-%m-%d)
  step exactness 240 python3 -m tilespec check exactness --method fused --method reference --device cuda \
    --samples 1000000 --json "$OUT/exactness-gpu-H100-session13-fused-reference-1e6-$D.json"
  step ncu-B64 60 ncu --nvtx --nvtx-include "tilespec_fused_B64/" $NCU_SECTIONS \
      python3 bench/scripts/ncu_fused.py --batch 64 --no-timing
  grep -A200 "^summary" "$OUT/issue15-bench.log" | head -40
  tail -5 "$OUT/exactness.log"
  ;;
b)
  step issue15-bench 150 python3 bench/scripts/issue15_bench.py --filters --time-budget 120 --json "$OUT/issue15.json"
  grep -A40 "^summary" "$OUT/issue15-bench.log" | head -40
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl && export PYTHONPATH=$PYTHONPATH:/tmp/site
  python3 -c "import flashinfer; print('flashinfer', flashinfer.__version__)" 2>&1 | tail -1
  D=$(date -u +%Y-%m-%d)
  step bench-verify 300 python3 -m tilespec bench verify --batch 1 64 --draft 5 --vocab 151936 --dtype bf16 \
    --filters --check --json "$OUT/verify-H100-session13-$D.json"
  step exactness 120 python3 -m tilespec check exactness --method fused --method reference --device cuda \
    --samples 1000000 --json "$OUT/exactness-gpu-H100-session13-final-fused-reference-1e6-$D.json"
  step ncu-B64 60 ncu --nvtx --nvtx-include "tilespec_fused_B64/" $NCU_SECTIONS \
      python3 bench/scripts/ncu_fused.py --batch 64 --no-timing
  tail -3 "$OUT/exactness.log"; grep -v "^\s*$" "$OUT/bench-verify.log" | tail -30
  ;;
esac
ts done
