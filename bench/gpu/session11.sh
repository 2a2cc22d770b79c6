#!/usr/bin/env bash
# Session 11's GPU chain on one offline H100 (over bench/gpu/chain.sh; .parts built by bench/gpu/make_parts.sh).
# Job A (no weights, runs while the Qwen parts upload):
#   1. native_kernels.py over the kernel settings that can win after session 10 (the projection kernel alone lost
#      to cuBLAS; decode attention as a custom op and the MLP part were not measured): "", attn, mlp, attn,mlp, all;
#   2. the native-runtime and kernel GPU tests; 3. the exactness suite at 10^6 (fused + reference) on the GPU.
# Job E (after job A and both models): issue 13's e2e comparison on the real Qwen2.5-Coder 1.5B / 0.5B weights
#   (XSum, 16 prompts x 128 tokens, B=1 and 8, T=0: hf, hf-static, hf-assisted, ours target-only, ours + 0.5B draft
#   gamma 2/3/optimal) with the fastest kernels setting of step 1 (or S11_KERNELS).
#   session11.sh extras       # first call: carry .parts/u00, the tree WITH bench/results; set TILESPEC_COMMIT
#   session11.sh part NN      # one call per .parts/uNN (bench/results moved out so the tree fits in 64 MiB)
#   session11.sh wait SECONDS # returns when job E is done or after SECONDS; results in $OUT/res.tgz
set -u
CHAIN_SCRIPT=bench/gpu/session11.sh CHAIN_WORK=${S11_WORK:-/root/ts11}
export CHAIN_MODELS="qwen2.5-coder-0.5b-instruct qwen2.5-coder-1.5b-instruct"
source bench/gpu/chain.sh   # RES, PARTS, EXTRA, ts, env_setup, step, convert, snapshot, bg, wait_ready, ...

best_kernels() {  # the setting with the fastest B=1 q=1 1.5B forward in step 1 ("" when none wins or on error)
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
  step native-kernels 480 python3 bench/scripts/native_kernels.py --quick --json $RES/native-kernels.json \
    --settings "" attn mlp attn,mlp all
  step pytest-gpu 300 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_native.py \
    tests/test_native_linear.py tests/test_native_attention_kernel.py tests/test_engine_gpu.py \
    tests/test_kernels_gpu.py tests/test_kernels_pass1_loop.py
  exactness_step
  touch $RES/.jobA-done
}

job_e() {
  env_setup
  wait_ready
  export TILESPEC_NATIVE_KERNELS=${S11_KERNELS-$(best_kernels)}
  ts "job E: TILESPEC_NATIVE_KERNELS='$TILESPEC_NATIVE_KERNELS'"
  echo "$TILESPEC_NATIVE_KERNELS" > $RES/e2e-kernels-setting.txt
  E2E_RES=$RES/e2e-fast E2E_TOTAL_S=${E2E_TOTAL_S:-540} E2E_BUDGET_S=${E2E_BUDGET_S:-500} \
    step e2e-runtime-t0 620 bash bench/gpu/e2e_fast.sh runtime-t0
  touch $RES/.jobE-done
}

case ${1:-} in
  extras) extras_setup; bg job-a; bg job-e; ts "jobs A and E started" ;;
  job-a) job_a ;;
  job-e) job_e ;;
  part) part_call "$2" ;;
  wait) WAIT_MARK=${WAIT_MARK:-.jobE-done} wait_call "${2:-500}" ;;
  convert) convert "$2" ;;
  *) echo "usage: session11.sh extras | part NN | wait SECONDS" >&2; exit 2 ;;
esac
