#!/usr/bin/env bash
# Session 6's GPU chain on one offline H100 (same mechanics as session5.sh: the work runs in the background while the
# model parts are uploaded; the calls that follow only wait and bring the results back).
#
#   session6.sh extras [kernels|second]  # first call, carrying .parts/u00 (wheels, FlashInfer, shared data, manifests):
#                                 #   installs the wheels and starts job A (no weights) and job B (waits for weights);
#                                 #   "kernels": only job K (verification kernels, no weights, no parts needed);
#                                 #   "second": job K, then job B2 (e2e optimal-schedule rows, eval-scale continued)
#   session6.sh part NN           # one call per .parts/uNN; a model whose parts are all there is converted
#   session6.sh wait SECONDS      # returns when the running jobs are done or after SECONDS; results in $OUT/res.tgz
#
# Job A (no weights): the engine's GPU tests (run-ahead on CUDA graphs, native paths, drafters, bad inputs), the
#   engine step profile (bench/scripts/engine_profile.py) after the run-ahead fix.
# Job B (weights): whisper-base e2e on all 32 LJSpeech clips; Qwen e2e at T=0 and T=1, B=1 and 8 in one process
#   (hf-static, hf-assisted (B=1), ours target-only, ours + 0.5B draft at gamma 2 and the optimal schedule);
#   bench/gpu/eval_scale.sh (issue 16) continuing the committed partial runs, text first, then ASR, multidraft,
#   context drafters, side studies.
# Job K (no weights): kernel GPU tests, the exactness suite on the GPU (fused, reference, 10^6 samples), the verify
#   benchmark (FlashInfer + transformers in the same run, filters), the threshold kernel sweep, Nsight Compute of
#   fused at B=1 and 64.
# Every step has its own timeout; logs and JSONs go to /root/res. Set TILESPEC_COMMIT (the device's .git is stale).
set -u
CHAIN_SCRIPT=bench/gpu/session6.sh CHAIN_WORK=${S6_WORK:-/root/ts6}
source bench/gpu/chain.sh   # RES, PARTS, EXTRA, ts, env_setup, step, convert, snapshot, bg, wait_ready, part_call, wait_call

job_a() {
  env_setup
  step pytest-gpu 300 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_native.py tests/test_engine_gpu.py \
    tests/test_drafters.py tests/test_bad_inputs_engine.py
  step engine-profile 200 python3 bench/scripts/engine_profile.py --json $RES/engine-profile.json
  touch $RES/.jobA-done
}

job_k() {  # ordered by importance: a call that ends early keeps what finished
  env_setup
  kernel_steps 200
  exactness_step
  step verify-bench-split0 90 env TILESPEC_FUSED_SPLIT=0 python3 -m tilespec bench verify --batch 1 64 --draft 5 \
    --vocab 151936 --dtype bf16 --contenders fused sigmoid --json $RES/verify-split0.json
  if command -v ncu > /dev/null; then
    for b in 64 1; do
      step ncu-fused-B$b 60 ncu --nvtx --nvtx-include "tilespec_fused_B$b/" --section SpeedOfLight \
        --section Occupancy --section LaunchStats --section MemoryWorkloadAnalysis --csv \
        python3 bench/scripts/ncu_fused.py --batch $b --no-timing
    done
  fi
  step filter-thresholds 90 python3 bench/scripts/filter_thresholds.py --quick --json $RES/filter-thresholds.json
  touch $RES/.jobK-done $RES/.jobA-done
}

job_c() {  # the last machine (whisper parts only): the fixed kernel test, run-ahead of the optimal fallback on
           # random-init Qwen shapes (B=1, 8), where a whisper-base clip's time goes
  env_setup
  step pytest-kernels-gpu 120 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_kernels_gpu.py \
    tests/test_native.py::test_run_ahead_target_only_on_cuda_graphs
  for b in 1 8; do
    step engine-profile-B$b 150 python3 bench/scripts/engine_profile.py --batch $b \
      --runs target-only,draft0.5b-optimal-fallback --json $RES/engine-profile-B$b.json
  done
  while [ ! -e $RES/.ready-whisper-base ]; do sleep 2; done
  step whisper-profile 150 python3 bench/scripts/whisper_profile.py --json $RES/whisper-profile.json --clips 8
  touch $RES/.jobB-done
}

job_d() {  # the last call: whisper encoder graph + short-prefix prefill (tests, e2e on all 32 clips, profile)
  mkdir -p $RES/e2e
  env_setup
  step pytest-whisper-gpu 150 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_native.py \
    tests/test_engine_gpu.py::test_graphs_whisper_match_eager
  while [ ! -e $RES/.ready-whisper-base ]; do sleep 2; done
  step e2e-whisper 150 python3 -m tilespec bench e2e --whisper --prompts 32 --max-new-tokens 96 --batch 1,8 \
    --temperature 0 --systems ar,hf-static --dtype float16 --device cuda --compile auto --max-seconds 8 \
    --budget-s 110 --json $RES/e2e/e2e-whisper.json
  step whisper-profile 120 python3 bench/scripts/whisper_profile.py --json $RES/whisper-profile.json --clips 8
  touch $RES/.jobB-done
}

job_b2() {  # the second machine: after job K and the models, what the first machine's release cut short
  env_setup
  wait_ready
  ts "job B2 starts"
  E2E_RES=$RES/e2e E2E_TOTAL_S=200 E2E_BUDGET_S=170 E2E_MAX_S=5 \
    E2E_ARGS="--ignore-eos --temperature 0,1 --batch 1,8 --systems ar,tilespec --gamma 2 --gamma-schedule optimal" \
    step e2e-optimal 330 bash bench/gpu/e2e_fast.sh runtime-t0
  step whisper-profile 120 python3 bench/scripts/whisper_profile.py --json $RES/whisper-profile.json --clips 8
  EVAL_RES=$RES/eval-scale EVAL_SEED_DIR=bench/results EVAL_TOTAL_S=${EVAL_TOTAL_S:-560} EVAL_BUDGET_SCALE=1.3 \
    step eval-scale 620 bash bench/gpu/eval_scale.sh xsum-t0 cnndm-t0 xsum-t1 cnndm-t1 asr-t0 asr-t1 multidraft
  touch $RES/.jobB-done
}

job_b() {
  env_setup
  ts "job B waits for job A and the models"
  wait_ready
  ts "job B starts"
  step e2e-whisper 150 python3 -m tilespec bench e2e --whisper --prompts 32 --max-new-tokens 96 --batch 1,8 \
    --temperature 0 --systems ar,hf-static,tilespec,hf --gamma 3 --gamma-schedule optimal \
    --dtype float16 --device cuda --compile auto --methods fused --max-seconds 8 --budget-s 110 \
    --json $RES/e2e/e2e-whisper.json
  E2E_RES=$RES/e2e E2E_TOTAL_S=${E2E_TOTAL_S:-370} E2E_BUDGET_S=${E2E_BUDGET_S:-330} E2E_MAX_S=6 \
    E2E_ARGS="--ignore-eos --temperature 0,1 --systems ar,hf-static,tilespec,hf-assisted --gamma 2 --gamma-schedule constant,optimal" \
    step e2e-runtime 480 bash bench/gpu/e2e_fast.sh runtime-t0
  EVAL_RES=$RES/eval-scale EVAL_SEED_DIR=bench/results EVAL_TOTAL_S=${EVAL_TOTAL_S:-640} EVAL_BUDGET_SCALE=1.4 \
    step eval-scale 620 bash bench/gpu/eval_scale.sh xsum-t0 cnndm-t0 xsum-t1 cnndm-t1 asr-t0 asr-t1 multidraft
  EVAL_RES=$RES/eval-scale EVAL_SEED_DIR=bench/results EVAL_TOTAL_S=300 \
    step eval-scale-2 380 bash bench/gpu/eval_scale.sh drafters studies-text studies-asr xsum-t0 xsum-t1 cnndm-t1
  touch $RES/.jobB-done
}

case ${1:-} in
  extras)
    extras_setup
    case ${2:-} in
      kernels) bg job-k; ts "job K started" ;;
      kernels-fg) (cd $WORK && timeout -k 5 ${K_TOTAL_S:-540} bash bench/gpu/session6.sh job-k >> $RES/jobs.log 2>&1)
                  cat $RES/jobs.log; tar -czf "$OUT/res.tgz" -C $RES . ;;
      second) bg job-k; bg job-b2; ts "jobs K and B2 started" ;;
      third) bg job-c; ts "job C started" ;;
      fourth) bg job-d; ts "job D started" ;;
      *) bg job-a; bg job-b; ts "jobs A and B started" ;;
    esac ;;
  part) part_call "$2" ;;
  wait) wait_call "${2:-500}" ;;
  job-a) job_a ;;
  job-b) job_b ;;
  job-k) job_k ;;
  job-b2) job_b2 ;;
  job-c) job_c ;;
  job-d) job_d ;;
  convert) convert "$2" ;;
  *) echo "usage: session6.sh extras [kernels] | part NN | wait SECONDS" >&2; exit 2 ;;
esac
