#!/usr/bin/env bash
# Session 10's GPU chain on one offline H100 (over bench/gpu/chain.sh; .parts built by bench/gpu/make_parts.sh).
# Job A (no model weights; starts with the extras call, runs while the Qwen parts upload):
#   1. bench/scripts/native_kernels.py: the decode-shape Triton kernels (fused norm/projection/epilogue, decode
#      attention) per projection and in the whole native forward, per TILESPEC_NATIVE_KERNELS setting;
#   2. tune_fused.py pass-1 sweep incl. CHUNKS_PER_PROGRAM (issue 15);
#   3. filter_thresholds.py --quick (the single-value stop and the routing, unmeasured since session 7);
#   4. GPU tests (kernels, native runtime, engine) and the verify benchmark with FlashInfer.
# Job E (after job A and the models): the issue-13 e2e comparison on real Qwen weights (XSum, 16 prompts x 128
#   tokens, B=1 and 8, T=0: hf, hf-static, ours target-only, ours + 0.5B draft gamma 2/3/optimal) with the fastest
#   kernels setting of step 1 (or S10_KERNELS).
#   session10.sh extras       # first call, carrying .parts/u00 and the tree WITH bench/results
#   session10.sh part NN      # one call per .parts/uNN (u01-u26: the Qwen parts); a complete model is converted
#   session10.sh wait SECONDS # returns when job E is done or after SECONDS; results in $OUT/res.tgz
# Set TILESPEC_COMMIT in the extras call (the device's .git is stale).
set -u
CHAIN_SCRIPT=bench/gpu/session10.sh CHAIN_WORK=${S10_WORK:-/root/ts10}
export CHAIN_MODELS="qwen2.5-coder-0.5b-instruct qwen2.5-coder-1.5b-instruct"
source bench/gpu/chain.sh   # RES, PARTS, EXTRA, ts, env_setup, step, convert, snapshot, bg, wait_ready, ...

best_kernels() {  # the TILESPEC_NATIVE_KERNELS setting with the fastest B=1 q=1 forward in step 1 ("" if none)
  python3 - "$RES/native-kernels.json" <<'PY'
import json, sys
try:
    fw = json.load(open(sys.argv[1]))["forwards"]["qwen2.5-1.5b"]
    q1 = {k: next(r["graph_replay_ms"] for r in v["rows"] if r["batch"] == 1 and r["q"] == 1)
          for k, v in fw.items() if "rows" in v}
    best = min(q1, key=q1.get)
    print("" if best == "none" else best)
except Exception:
    print("")
PY
}

job_a() {
  env_setup
  step native-kernels 460 python3 bench/scripts/native_kernels.py --json $RES/native-kernels.json
  step tune-pass1 220 python3 bench/scripts/tune_fused.py --sweeps pass1 --batch 1 64 --quick --time-budget 170 \
    --json $RES/tune-pass1.json
  step filter-thresholds 200 python3 bench/scripts/filter_thresholds.py --quick --json $RES/filter-thresholds.json
  step pytest-native-gpu 300 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_native.py \
    tests/test_native_linear.py tests/test_native_attention_kernel.py tests/test_engine_gpu.py
  kernel_steps 260
  touch $RES/.jobA-done
}

job_e() {
  env_setup
  wait_ready
  export TILESPEC_NATIVE_KERNELS=${S10_KERNELS-$(best_kernels)}
  ts "job E: TILESPEC_NATIVE_KERNELS='$TILESPEC_NATIVE_KERNELS'"
  echo "$TILESPEC_NATIVE_KERNELS" > $RES/e2e-kernels-setting.txt
  E2E_RES=$RES/e2e-fast E2E_TOTAL_S=${E2E_TOTAL_S:-520} E2E_BUDGET_S=${E2E_BUDGET_S:-480} \
    step e2e-runtime-t0 600 bash bench/gpu/e2e_fast.sh runtime-t0
  touch $RES/.jobE-done
}

job_k() {  # native-kernels again (after a fix carried by a later call), then job E
  env_setup
  wait_ready
  step native-kernels 460 python3 bench/scripts/native_kernels.py --json $RES/native-kernels.json
  job_e
}

job_k2() {  # machine 1 re-planned: native-kernels right after job A's current step, then the rest of job A
  env_setup
  while pgrep -f "tune_fused.py|filter_thresholds.py|tilespec bench verify" > /dev/null; do sleep 2; done
  step native-kernels 460 python3 bench/scripts/native_kernels.py --json $RES/native-kernels.json
  [ -f $RES/filter-thresholds.json ] || step filter-thresholds 200 python3 bench/scripts/filter_thresholds.py \
    --quick --json $RES/filter-thresholds.json
  step pytest-native-gpu 300 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_native.py \
    tests/test_native_linear.py tests/test_native_attention_kernel.py tests/test_engine_gpu.py
  [ -f $RES/verify.json ] || kernel_steps 260
  touch $RES/.jobK-done
}

kernels_fg() {  # machine 2 (foreground, no weights): native-kernels with the fixes, native GPU tests
  MODELS=none source bench/gpu/setup.sh; set +e
  step native-kernels2 370 python3 bench/scripts/native_kernels.py --quick --json $RES/native-kernels2.json
  step pytest-native-gpu2 150 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_native.py \
    tests/test_native_linear.py tests/test_native_attention_kernel.py
  tar -czf $OUT/res.tgz -C $RES .
}

case ${1:-} in
  kernels-fg) kernels_fg ;;
  job-k) job_k ;;
  job-k2) job_k2 ;;
  restart-k2) cp bench/scripts/native_kernels.py $WORK/bench/scripts/ && cp bench/gpu/session10.sh $WORK/bench/gpu/
              pkill -f "session10.sh job-k2?$"; pkill -f "session10.sh job-a$"; pkill -f "native_kernels.py"
              sleep 1; bg job-k2; ts "job K2 started" ;;
  restart-k) cp bench/scripts/native_kernels.py $WORK/bench/scripts/ && cp bench/gpu/session10.sh $WORK/bench/gpu/
             pkill -f "session10.sh job-e" ; bg job-k; ts "job K started" ;;
  extras) extras_setup; bg job-a; bg job-e; ts "jobs A and E started" ;;
  job-a) job_a ;;
  job-e) job_e ;;
  part) part_call "$2" ;;
  wait) WAIT_MARK=${WAIT_MARK:-.jobE-done} wait_call "${2:-500}" ;;
  convert) convert "$2" ;;
  *) echo "usage: session10.sh extras | part NN | wait SECONDS" >&2; exit 2 ;;
esac
