#!/usr/bin/env bash
# Session 12's GPU chain on one offline H100 (over bench/gpu/chain.sh; .parts built by bench/gpu/make_parts.sh).
# Job A (random-init weights, runs while the Qwen parts upload): the runtime after this session's changes
#   (residual add fused into the next norm, compiled prologue / head, logits kept in bf16, compiled argmax):
#   1. native_kernels.py: decode attention SDPA vs the split-KV kernel per SPLIT; forwards with kernels "" and
#      "attn" (1.5B and 0.5B, B 1/8, q 1/6) and engine target-only tok/s with the faster one;
#   2. engine_profile.py --host-profile: GPU busy / idle per step and the host functions that keep the GPU idle
#      (target-only, n-gram, 0.5B draft at gamma 2);
#   3. the native-runtime / engine GPU tests.
# Job E (started by its own call once the models are in): issue 13's e2e on the real Qwen2.5-Coder weights.
#   session12.sh extras        # first call: carry .parts/u00, the tree WITH bench/results; set TILESPEC_COMMIT
#   session12.sh probes        # a later machine's first call (carry .parts/u00): setup + job B (sdpa backends,
#                              # run-ahead profiles, GPU tests, bench/gpu/issue15.sh) in the background
#   session12.sh part NN       # one call per .parts/uNN (bench/results moved out so the tree fits in 64 MiB)
#   session12.sh e2e STAGES    # snapshot the current tree, start job E (e2e_fast.sh STAGES) in the background
#   session12.sh wait SECONDS [MARK]  # returns when MARK (.jobE-done) exists or after SECONDS; results in $OUT/res.tgz
set -u
CHAIN_SCRIPT=bench/gpu/session12.sh CHAIN_WORK=${S12_WORK:-/root/ts12}
export CHAIN_MODELS="qwen2.5-coder-0.5b-instruct qwen2.5-coder-1.5b-instruct"
source bench/gpu/chain.sh   # RES, PARTS, EXTRA, ts, env_setup, step, convert, snapshot, bg, wait_ready, ...

fastest_setting() {  # fastest_setting FILE KEY...: the setting with the fastest B=1 q=1 forward under
                    # json[KEY][KEY2]... of FILE ("" when it is the default / "none", or on any error)
  python3 - "$@" <<'PY'
import json, sys
try:
    section = json.load(open(sys.argv[1]))
    for key in sys.argv[2:]:
        section = section[key]
    q1 = {k: next(r["graph_replay_ms"] for r in v["rows"] if r["batch"] == 1 and r["q"] == 1)
          for k, v in section.items() if "rows" in v}
    best = min(q1, key=q1.get)
    print("" if best in ("none", "default") else best)
except Exception:
    print("")
PY
}
best_kernels() { fastest_setting "$RES/native-kernels.json" forwards qwen2.5-1.5b; }   # job A's kernels setting
best_sdpa() { fastest_setting "$RES/sdpa-backends.json" forwards; }                    # job B's TILESPEC_SDPA

job_a() {
  env_setup
  step native-kernels 420 python3 bench/scripts/native_kernels.py --quick --skip projections \
    --json $RES/native-kernels.json --settings "" attn
  export TILESPEC_NATIVE_KERNELS=$(best_kernels)
  step engine-profile 240 python3 bench/scripts/engine_profile.py --host-profile --json $RES/engine-profile.json \
    --runs target-only,ngram-gamma5,draft0.5b-gamma2
  step pytest-gpu 300 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_native.py \
    tests/test_native_attention_kernel.py tests/test_engine_gpu.py
  touch $RES/.jobA-done
}

job_b() {  # second machine: random-init probes while the parts upload, then issue 15's script
  env_setup
  step sdpa-backends 330 python3 bench/scripts/sdpa_backends.py --json $RES/sdpa-backends.json --settings "" efficient
  export TILESPEC_SDPA=$(best_sdpa)
  ts "job B: TILESPEC_SDPA='$TILESPEC_SDPA'"
  step engine-profile-ahead 240 python3 bench/scripts/engine_profile.py --host-profile \
    --json $RES/engine-profile-run-ahead.json --runs target-only,draft0.5b-gamma2,draft0.5b-optimal-fallback
  TILESPEC_RUN_AHEAD=0 step engine-profile-no-ahead 150 python3 bench/scripts/engine_profile.py \
    --json $RES/engine-profile-no-run-ahead.json --runs draft0.5b-gamma2
  step pytest-gpu 300 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_native.py tests/test_engine_gpu.py \
    tests/test_native_attention_kernel.py tests/test_run_ahead.py
  mkdir -p $RES/issue15
  OUT=$RES/issue15 step issue15 360 bash bench/gpu/issue15.sh
  touch $RES/.jobA-done $RES/.jobB-done
}

job_e() {
  env_setup
  wait_ready
  export TILESPEC_NATIVE_KERNELS=${S12_KERNELS-$(best_kernels)} TILESPEC_SDPA=${S12_SDPA-$(best_sdpa)}
  ts "job E: TILESPEC_NATIVE_KERNELS='$TILESPEC_NATIVE_KERNELS' TILESPEC_SDPA='$TILESPEC_SDPA' stages: $*"
  echo "$TILESPEC_NATIVE_KERNELS" > $RES/e2e-kernels-setting.txt
  E2E_RES=$RES/e2e-fast E2E_TOTAL_S=${E2E_TOTAL_S:-540} E2E_BUDGET_S=${E2E_BUDGET_S:-250} \
    step e2e 900 bash bench/gpu/e2e_fast.sh "$@"
  touch $RES/.jobE-done
}

case ${1:-} in
  extras) extras_setup; bg job-a; ts "job A started" ;;
  setup) extras_setup ;;
  probes) extras_setup; bg job-b; ts "job B started" ;;
  job-b) job_b ;;
  job-a) job_a ;;
  job-e) shift; job_e "$@" ;;
  e2e) shift; snapshot; rm -f $RES/.jobE-done; bg job-e "$@"; ts "job E started: $*" ;;
  part) part_call "$2"; tail -3 $RES/jobs.log ;;
  wait) WAIT_MARK=${3:-.jobE-done} wait_call "${2:-500}" ;;
  convert) convert "$2" ;;
  *) echo "usage: session12.sh extras | part NN | e2e STAGES | wait SECONDS [MARK]" >&2; exit 2 ;;
esac
