#!/usr/bin/env bash
# Session 5's GPU chain on one offline H100: the GPU work runs in the background while the model parts are still
# being uploaded, and the calls that follow only wait and bring the results back.
#
#   session5.sh extras [lite] # first call, carrying .parts/u00 (wheels, FlashInfer, shared data, manifests):
#                             #   installs the wheels, starts job A (needs no model weights)
#   session5.sh part NN       # one call per .parts/uNN (a model part or the synthetic ASR set): copies it into
#                             #   /root/parts or /root/extra; a model whose parts are all there is unpacked and
#                             #   converted in the background; after the last part job B starts
#   session5.sh wait SECONDS  # returns when job B is done or after SECONDS; results tarred to $OUT/res.tgz
#
# Job A (no weights): GPU tests, the exactness suite on the GPU (fused, reference: 10^6 samples), the verify
#   benchmark (FlashInfer, transformers in the same run), the top-k/top-p threshold kernel's key bits per pass,
#   Nsight Compute of fused, the engine step profile
#   (bench/scripts/engine_profile.py), the compile cache cold/warm.
# Job B (after job A and the conversions): bench/gpu/e2e_fast.sh runtime-t0 (B=1, 8; --ignore-eos: 16 x 128 tokens), whisper-base e2e on the
#   LJSpeech clips, bench/gpu/eval_scale.sh (issue 16), e2e runtime at T=1.
# Every step has its own timeout; logs and JSONs go to /root/res. Set TILESPEC_COMMIT (the device's .git is stale).
set -u
source bench/gpu/chain.sh   # RES, PARTS, EXTRA, ts, env_setup, step, convert, wait_ready, part_call, wait_call

job_a() {
  env_setup
  step pytest-gpu 360 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_native.py tests/test_engine_gpu.py \
    tests/test_kernels_gpu.py tests/test_drafters.py tests/test_bad_inputs_engine.py
  step exactness-gpu 300 python3 -m tilespec check exactness --method fused --method reference --device cuda \
    --samples 1000000 --json $RES/exactness-gpu-fused-reference-1e6.json
  step verify-bench 300 python3 -m tilespec bench verify --batch 1 64 --draft 5 --vocab 151936 --dtype bf16 \
    --filters --check --json $RES/verify.json --plot $RES/verify.png
  step filter-thresholds 150 python3 bench/scripts/filter_thresholds.py --json $RES/filter-thresholds.json
  step engine-profile 240 python3 bench/scripts/engine_profile.py --json $RES/engine-profile.json
  if command -v ncu > /dev/null; then
    for b in 64; do
      step ncu-fused-B$b 120 ncu --nvtx --nvtx-include "tilespec_fused_B$b/" --section SpeedOfLight \
        --section Occupancy --section LaunchStats --section MemoryWorkloadAnalysis --csv \
        python3 bench/scripts/ncu_fused.py --batch $b --no-timing
    done
  fi
  for i in 1 2; do
    step compile-cache-$i 150 python3 bench/scripts/compile_cache.py --json $RES/compile-cache.json
  done
  touch $RES/.jobA-done
}

job_a_lite() {  # a second machine: only the GPU tests that failed on the first one, then job B
  env_setup
  step pytest-gpu-rerun 240 python3 -m pytest -q -m gpu -p no:cacheprovider \
    "tests/test_engine_gpu.py::test_graphs_whisper_match_eager" \
    "tests/test_engine_gpu.py::test_compiled_graphs_greedy_matches_target" \
    "tests/test_bad_inputs_engine.py::test_two_streams_and_an_abandoned_one_on_cuda_graphs"
  touch $RES/.jobA-done
}

job_b() {
  env_setup
  ts "job B waits for job A and the models"
  wait_ready
  ts "job B starts"
  E2E_RES=$RES/e2e E2E_TOTAL_S=330 E2E_BUDGET_S=280 E2E_MAX_S=${E2E_MAX_S:-12} E2E_ARGS="--ignore-eos" \
    step e2e-runtime-t0 400 bash bench/gpu/e2e_fast.sh runtime-t0
  step e2e-whisper 200 python3 -m tilespec bench e2e --whisper --prompts 32 --max-new-tokens 96 --batch 1,8 \
    --temperature 0 --systems ar,hf-static,tilespec,hf --gamma 3 --gamma-schedule optimal \
    --dtype float16 --device cuda --compile auto --methods fused --max-seconds 10 --budget-s 130 \
    --json $RES/e2e/e2e-whisper.json
  if [ -f bench/gpu/eval_scale.sh ]; then
    EVAL_RES=$RES/eval-scale EVAL_TOTAL_S=${EVAL_TOTAL_S:-420} step eval-scale 600 bash bench/gpu/eval_scale.sh
  fi
  E2E_RES=$RES/e2e E2E_TOTAL_S=200 E2E_BUDGET_S=150 E2E_MAX_S=10 \
    E2E_ARGS="--ignore-eos --batch 1 --systems ar,hf-static,tilespec --gamma 2 --gamma-schedule constant,optimal" \
    step e2e-runtime-t1 260 bash bench/gpu/e2e_fast.sh runtime-t1
  touch $RES/.jobB-done
}

job_b2() {  # the short plan for what is left of the budget: e2e runtime T=0 (B=1, 8), whisper, text eval
  env_setup
  wait_ready
  ts "job B2 starts"
  E2E_RES=$RES/e2e E2E_TOTAL_S=260 E2E_BUDGET_S=215 E2E_MAX_S=8 \
    E2E_ARGS="--ignore-eos --systems ar,hf-static,tilespec --gamma 2 --gamma-schedule constant,optimal" \
    step e2e-runtime-t0 300 bash bench/gpu/e2e_fast.sh runtime-t0
  step e2e-whisper 110 python3 -m tilespec bench e2e --whisper --prompts 32 --max-new-tokens 96 --batch 1,8 \
    --temperature 0 --systems ar,hf --dtype float16 --device cuda --compile auto --max-seconds 8 --budget-s 70 \
    --json $RES/e2e/e2e-whisper.json
  EVAL_RES=$RES/eval-scale EVAL_TOTAL_S=${EVAL_TOTAL_S:-260} step eval-scale 330 bash bench/gpu/eval_scale.sh \
    xsum-t0 cnndm-t0 xsum-t1 cnndm-t1
  touch $RES/.jobB-done
}

bg() { [ "$1" = job-b2 ] && set -- job-b2-run; setsid nohup bash bench/gpu/session5.sh "$@" >> $RES/jobs.log 2>&1 < /dev/null & }

case ${1:-} in
  extras)
    cp -r .parts/u00/extra/* $EXTRA/ && cp .parts/u00/*.json $PARTS/
    MODELS=none source bench/gpu/setup.sh; set +e
    python3 -c "import flashinfer, soundfile, jiwer, rouge_score, gguf; print('wheels ok')" 2>&1 | tail -1
    nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader
    job=job-a; [ "${2:-}" = lite ] && job=job-a-lite
    [ -n "${S5_NO_JOBS:-}" ] || { bg $job; bg job-b; ts "jobs $job and B started"; } ;;
  part) part_call "$2" ;;
  wait) wait_call "${2:-500}" ;;
  job-a) job_a ;;
  job-a-lite) job_a_lite ;;
  job-b) job_b ;;
  job-b2) pkill -f "session5.sh job-b$" ; bg job-b2; ts "job B2 started" ;;
  job-b2-run) job_b2 ;;
  convert) convert "$2" ;;
  *) echo "usage: session5.sh extras | part NN | wait SECONDS" >&2; exit 2 ;;
esac
