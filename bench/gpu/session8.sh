#!/usr/bin/env bash
# Session 8's GPU chain on one offline H100 (over bench/gpu/chain.sh): job V needs no weights and runs while the Qwen
# parts upload; job E waits for the two Qwen models (whisper-base is not uploaded: the ASR runs are complete).
#
#   session8.sh extras        # first call, carrying .parts/u00 and the tree WITH bench/results (job E resumes from it)
#   session8.sh part NN       # one call per .parts/uNN (01-29: the Qwen parts); a complete model is converted
#   session8.sh wait SECONDS  # returns when job E is done or after SECONDS; results in $OUT/res.tgz
#
# Job V: the kernel GPU tests, the verify benchmark with filters (the two unmeasured filter-path changes of session
#   7; FlashInfer and transformers in the same run), the threshold-kernel sweep (radix with / without its stop).
# Job E, by importance: the T=0 repeatability experiment on the eval chunk where `hf` parted from `tiled`/`fused`;
#   issue 16's multi-draft stage (bf16, 50 prompts per dataset, K = 2..4, timing even when the rounds are cut);
#   the rest of the XSum drafter rows; issue 13's e2e rows at T=0 (target-only vs hf-static, the 0.5B draft at
#   constant gamma 2 and the optimal schedule with its cost memory); the repeatability run again with torch's
#   deterministic algorithms. Set TILESPEC_COMMIT in the extras call (the device's .git is stale).
set -u
CHAIN_SCRIPT=bench/gpu/session8.sh CHAIN_WORK=${S8_WORK:-/root/ts8}
export CHAIN_MODELS="qwen2.5-coder-0.5b-instruct qwen2.5-coder-1.5b-instruct"
source bench/gpu/chain.sh   # RES, PARTS, EXTRA, ts, env_setup, step, convert, snapshot, bg, wait_ready, ...

job_v() {
  env_setup
  kernel_steps 220
  step filter-thresholds 120 python3 bench/scripts/filter_thresholds.py --quick --json $RES/filter-thresholds.json
  touch $RES/.jobA-done
}

repeat_step() {  # repeat_step NAME EXTRA_ARGS...: the T=0 repeatability run on XSum examples 80-95
  step "$1" 240 python3 bench/scripts/repeatability.py --dataset xsum --offset 80 --repeats 2 --probe \
    --committed bench/results/eval-scale-H100-xsum-t0-2026-11-23.json --json "$RES/$1.json" "${@:2}"
}

job_e() {
  env_setup
  ts "job E waits for job V and the models"
  wait_ready
  ts "job E starts"
  repeat_step repeatability-xsum80
  EVAL_RES=$RES/eval-scale EVAL_SEED_DIR=bench/results EVAL_TOTAL_S=${MD_TOTAL_S:-470} \
    EVAL_MD_BUDGET_S=${MD_ROUNDS_S:-280} EVAL_MD_TIMING_PROMPTS=2 EVAL_MD_TIMING_TOKENS=48 \
    EVAL_MD_ARGS="--max-new-tokens 8 --reps 8 --max-k 4" \
    step eval-multidraft 530 bash bench/gpu/eval_scale.sh multidraft
  EVAL_RES=$RES/eval-scale EVAL_SEED_DIR=bench/results EVAL_TOTAL_S=${DR_TOTAL_S:-170} \
    step eval-drafters 230 bash bench/gpu/eval_scale.sh drafters
  E2E_RES=$RES/e2e E2E_TOTAL_S=${E2E_TOTAL_S:-260} E2E_BUDGET_S=${E2E_BUDGET_S:-220} E2E_MAX_S=6 \
    E2E_ARGS="--ignore-eos --temperature 0 --systems ar,hf-static,tilespec --gamma 2 --gamma-schedule constant,optimal" \
    step e2e-runtime 420 bash bench/gpu/e2e_fast.sh runtime-t0
  touch $RES/.jobB-done
  repeat_step repeatability-xsum80-deterministic --deterministic
  touch $RES/.jobE-done
}

case ${1:-} in
  extras) extras_setup; bg job-v; bg job-e; ts "jobs V and E started" ;;
  part) part_call "$2" ;;
  wait) WAIT_MARK=${WAIT_MARK:-.jobE-done} wait_call "${2:-500}" ;;
  job-v) job_v ;;
  job-e) job_e ;;
  convert) convert "$2" ;;
  *) echo "usage: session8.sh extras | part NN | wait SECONDS" >&2; exit 2 ;;
esac
