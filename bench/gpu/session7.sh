#!/usr/bin/env bash
# Session 7's GPU chain on one offline H100 (the mechanics of session6.sh, over bench/gpu/chain.sh): the work runs in
# the background while the model parts are uploaded; the calls that follow only wait and bring the results back.
#
#   session7.sh extras [kernels-fg]  # first call, carrying .parts/u00 (wheels, FlashInfer, shared data, manifests):
#                                    #   installs the wheels, starts job V (no weights) and job E (waits for weights);
#                                    #   "kernels-fg": only job V, in the foreground (a kernel-only machine);
#                                    #   "second": job E2 (upload whisper-base's parts first: ASR starts at once)
#   session7.sh part NN              # one call per .parts/uNN; a model whose parts are all there is converted
#   session7.sh wait SECONDS         # returns when job E's e2e is done (WAIT_MARK=.jobE-exactness-done: its last
#                                    #   step) or after SECONDS; results in $OUT/res.tgz
#
# Job V (no weights, overlaps the uploads): the kernel GPU tests (kernel vs reference token for token after the
#   session-6 review refactors), the verify benchmark with filters under the new threshold routing (FlashInfer and
#   transformers in the same run), the threshold-kernel sweep.
# Job E (weights, after job V): issue 16's paper-scale evaluation, resumed from the committed partial runs (text,
#   drafters, side studies, ASR, multi-draft), then issue 13's e2e comparison (XSum 16 x 128, T=0/1, B=1/8: ar,
#   hf-static, hf-assisted, ours + 0.5B draft at constant gamma 2 and the optimal schedule with its cost memory),
#   then the exactness suite on the GPU (fused, reference, 10^6 samples) if the machine is still held.
# Every step has its own timeout; logs and JSONs go to /root/res. Set TILESPEC_COMMIT (the device's .git is stale).
set -u
CHAIN_SCRIPT=bench/gpu/session7.sh CHAIN_WORK=${S7_WORK:-/root/ts7}
source bench/gpu/chain.sh   # RES, PARTS, EXTRA, ts, env_setup, step, convert, snapshot, bg, wait_ready, ...

job_v() {  # ordered by importance: a call that ends early keeps what finished
  env_setup
  kernel_steps 220
  step filter-thresholds 90 python3 bench/scripts/filter_thresholds.py --quick --json $RES/filter-thresholds.json
  touch $RES/.jobA-done
}

job_e2() {  # the second machine (the first went back mid-job): ASR while the Qwen parts upload, the GPU exactness
           # suite, then the drafters and multi-draft stages, then the e2e rows
  env_setup
  while [ ! -e $RES/.ready-whisper-base ]; do sleep 2; done
  EVAL_RES=$RES/eval-scale EVAL_SEED_DIR=bench/results EVAL_TOTAL_S=170 \
    step eval-scale-asr 230 bash bench/gpu/eval_scale.sh ${E2_ASR_STAGES:-asr-t0 asr-t1 studies-asr}
  [ "${E2_EXACTNESS:-1}" = 1 ] && exactness_step
  wait_ready
  EVAL_RES=$RES/eval-scale EVAL_SEED_DIR=bench/results EVAL_TOTAL_S=${E2_TEXT_S:-490} EVAL_BUDGET_SCALE=6 \
    step eval-scale-text 560 bash bench/gpu/eval_scale.sh drafters multidraft
  e2e_rows
  touch $RES/.jobB-done
}

e2e_rows() {
  E2E_RES=$RES/e2e E2E_TOTAL_S=${E2E_TOTAL_S:-380} E2E_BUDGET_S=${E2E_BUDGET_S:-340} E2E_MAX_S=6 \
    E2E_ARGS="--ignore-eos --temperature 0,1 --systems ar,hf-static,tilespec,hf-assisted --gamma 2 --gamma-schedule constant,optimal" \
    step e2e-runtime 540 bash bench/gpu/e2e_fast.sh runtime-t0
}

job_e3() {  # replaces job E2's last step: after its drafters / multi-draft step, ASR again (the first ASR call gave
           # LJSpeech too small a share to start), then shorter e2e rows
  env_setup
  while ! grep -q "end eval-scale-text" $RES/jobs.log; do sleep 2; done
  pkill -f "session7.sh job-e2"; pkill -f "e2e_fast.sh"; pkill -f "tilespec bench e2e"; sleep 2
  ts "job E3: job E2 stopped after its eval step"
  EVAL_RES=$RES/eval-scale EVAL_TOTAL_S=${ASR_TOTAL_S:-170} \
    step eval-scale-asr2 230 bash bench/gpu/eval_scale.sh asr-t0 asr-t1
  E2E_TOTAL_S=${E2E3_TOTAL_S:-250} E2E_BUDGET_S=${E2E3_BUDGET_S:-210} e2e_rows
  touch $RES/.jobB-done
}

job_e() {
  env_setup
  ts "job E waits for job V and the models"
  wait_ready
  ts "job E starts"
  EVAL_RES=$RES/eval-scale EVAL_SEED_DIR=bench/results EVAL_TOTAL_S=${EVAL_TOTAL_S:-780} EVAL_BUDGET_SCALE=1.3 \
    step eval-scale 840 bash bench/gpu/eval_scale.sh xsum-t0 cnndm-t0 xsum-t1 cnndm-t1 drafters studies-text \
    asr-t0 asr-t1 studies-asr multidraft
  e2e_rows
  touch $RES/.jobB-done
  exactness_step
  touch $RES/.jobE-exactness-done
}

case ${1:-} in
  extras)
    extras_setup
    case ${2:-} in
      kernels-fg) (cd $WORK && timeout -k 5 ${V_TOTAL_S:-540} bash $CHAIN_SCRIPT job-v >> $RES/jobs.log 2>&1)
                  cat $RES/jobs.log; tar -czf "$OUT/res.tgz" -C $RES . ;;
      second) touch $RES/.jobA-done; bg job-e2; ts "job E2 started" ;;   # E2_* variables reach the job
      *) bg job-v; bg job-e; ts "jobs V and E started" ;;
    esac ;;
  part) part_call "$2" ;;
  wait) wait_call "${2:-500}" ;;
  job-v) job_v ;;
  job-e) job_e ;;
  job-e2) job_e2 ;;
  job-e3) job_e3 ;;
  restart) snapshot; bg "$2"; ts "$2 started from a fresh snapshot in $WORK" ;;   # S7_WORK must name a new folder
  convert) convert "$2" ;;
  *) echo "usage: session7.sh extras [kernels-fg] | part NN | wait SECONDS" >&2; exit 2 ;;
esac
