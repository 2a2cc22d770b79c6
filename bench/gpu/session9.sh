#!/usr/bin/env bash
# Session 9's GPU chain on one offline H100 (over bench/gpu/chain.sh; .parts built by bench/gpu/make_parts.sh): one
# job, started by the extras call, waits for the two Qwen models while their parts upload, then runs:
#   1. the T=0 repeatability experiment on the eval chunk where `tiled` parted from itself in session 8 (XSum
#      examples 80-95): our target-only greedy decoding beside hf / tiled / fused, twice each, interleaved, the
#      target's top logits probed at every divergence;
#   2. issue 16's multi-draft stage (bf16, 50 prompts per dataset, K = 2..4, then the tokens/s timing);
#   3. the repeatability run again with --fresh (every cached runner, its graphs and K/V buffers dropped before each
#      run): a divergence that disappears there depends on what earlier runs left in the shared buffers.
#
#   session9.sh extras-d      # (fourth machine) only the XSum drafter rows, resumed from bench/results
#   session9.sh extras-r      # (third machine) only the repeatability run, with the fixed probe
#   session9.sh extras        # first call, carrying .parts/u00 and the tree WITH bench/results
#   session9.sh part NN       # one call per .parts/uNN (u01-u26: the Qwen parts); a complete model is converted
#   session9.sh wait SECONDS  # returns when the job is done or after SECONDS; results in $OUT/res.tgz
# Set TILESPEC_COMMIT in the extras call (the device's .git is stale).
set -u
CHAIN_SCRIPT=bench/gpu/session9.sh CHAIN_WORK=${S9_WORK:-/root/ts9}
export CHAIN_MODELS="qwen2.5-coder-0.5b-instruct qwen2.5-coder-1.5b-instruct"
source bench/gpu/chain.sh   # RES, PARTS, EXTRA, ts, env_setup, step, convert, snapshot, bg, wait_ready, ...

repeat_step() {  # repeat_step NAME TIMEOUT EXTRA_ARGS...: the T=0 repeatability run on XSum examples 80-95
  step "$1" "$2" python3 bench/scripts/repeatability.py --dataset xsum --offset 80 --repeats 2 --probe \
    --committed bench/results/eval-scale-H100-xsum-t0-2026-11-23.json --json "$RES/$1.json" "${@:3}"
}

job_e() {
  env_setup
  ts "job E waits for the models"
  wait_ready
  ts "job E starts"
  repeat_step repeatability-xsum80 300 --methods target,hf,tiled,fused
  touch $RES/.jobE-repeat-done
  EVAL_RES=$RES/eval-scale EVAL_SEED_DIR=bench/results EVAL_TOTAL_S=${MD_TOTAL_S:-700} \
    EVAL_MD_BUDGET_S=${MD_ROUNDS_S:-520} EVAL_MD_TIMING_PROMPTS=2 EVAL_MD_TIMING_TOKENS=48 \
    EVAL_MD_ARGS="--max-new-tokens 8 --reps 8 --max-k 4" \
    step eval-multidraft $(( ${MD_TOTAL_S:-700} + 40 )) bash bench/gpu/eval_scale.sh multidraft
  touch $RES/.jobE-md-done
  repeat_step repeatability-xsum80-fresh 300 --methods target,tiled,fused --fresh
  touch $RES/.jobE-done
}

job_r() {  # the third machine: the repeatability run alone, with the probe that feeds the prompt (fixed after machine 2)
  env_setup
  wait_ready
  repeat_step repeatability-xsum80-probe 300 --methods target,hf,tiled,fused
  touch $RES/.jobE-done
}

job_d() {  # the fourth machine: the rest of the XSum context-drafter rows (issue 16), resumed from the committed run
  env_setup
  wait_ready
  EVAL_RES=$RES/eval-scale EVAL_SEED_DIR=bench/results EVAL_TOTAL_S=${DR_TOTAL_S:-220} \
    step eval-drafters $(( ${DR_TOTAL_S:-220} + 40 )) bash bench/gpu/eval_scale.sh drafters
  touch $RES/.jobE-done
}

case ${1:-} in
  extras-d) extras_setup; touch $RES/.jobA-done; bg job-d; ts "job D started" ;;
  job-d) job_d ;;
  extras-r) extras_setup; touch $RES/.jobA-done; bg job-r; ts "job R started" ;;
  job-r) job_r ;;
  extras) extras_setup; touch $RES/.jobA-done
          # a multidraft run cut on an earlier machine resumes from its JSON (carried in .parts/u00/seed/)
          [ -f .parts/u00/seed/multidraft.json ] && mkdir -p $RES/eval-scale && cp .parts/u00/seed/multidraft.json $RES/eval-scale/
          bg job-e; ts "job E started" ;;
  part) part_call "$2" ;;
  wait) WAIT_MARK=${WAIT_MARK:-.jobE-done} wait_call "${2:-500}" ;;
  job-e) job_e ;;
  convert) convert "$2" ;;
  *) echo "usage: session9.sh extras | part NN | wait SECONDS" >&2; exit 2 ;;
esac
