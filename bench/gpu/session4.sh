#!/usr/bin/env bash
# Session 4's GPU chain on one offline H100 (see bench/gpu/README.md for the upload calls that come first:
# .parts/u00 = extras + manifests -> /root/extra, /root/parts; .parts/uNN = one model part each -> /root/parts).
#   bench/gpu/session4.sh convert-draft   # background-able: unpack + GGUF->safetensors of the 0.5B
#   bench/gpu/session4.sh prep            # unpack + convert whatever is still GGUF-only
#   bench/gpu/session4.sh kernels         # GPU tests of the native runtime and kernels, compile cache, verify bench
#   bench/gpu/session4.sh e2e STAGES...   # bench/gpu/e2e_fast.sh stages
# Results go to /root/res and are tarred to $OUT/res.tgz at the end of every stage.
set -u
RES=/root/res; mkdir -p $RES
ts() { echo "[$(date -u +%H:%M:%S)] $*"; }
export PYTHONUNBUFFERED=1
export MODELS=${MODELS:-"qwen2.5-coder-0.5b-instruct qwen2.5-coder-1.5b-instruct"}   # only those whose parts are here
source bench/gpu/setup.sh
set +e
export TILESPEC_COMMIT=${TILESPEC_COMMIT:-unknown}
convert() {  # the first bf16 load of a GGUF model saves its safetensors copy (hf-bfloat16/) in the cache
  for m in "$@"; do
    ts "convert $m"
    python3 -c "import tilespec; tilespec.load('$m', dtype='bfloat16', device='cpu')" > $RES/convert-$m.log 2>&1 \
      || tail -3 $RES/convert-$m.log
  done
}
stage=$1; shift
case $stage in
  convert-draft) convert qwen2.5-coder-0.5b-instruct ;;
  prep) convert qwen2.5-coder-0.5b-instruct qwen2.5-coder-1.5b-instruct ;;
  kernels)
    ts "GPU tests: native runtime, engine graphs, kernels"
    timeout 240 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_native.py tests/test_kernels_gpu.py \
      tests/test_drafters.py tests/test_bad_inputs_engine.py > $RES/pytest-gpu.log 2>&1
    echo "pytest rc=$? $(tail -1 $RES/pytest-gpu.log)"; grep -E "FAILED|Error" $RES/pytest-gpu.log | head -20
    ts "compile cache: cold then warm process"
    for i in 1 2; do timeout 120 python3 bench/scripts/compile_cache.py --json $RES/compile-cache.json 2>&1 | tail -1; done
    ts "bench verify"
    timeout 240 bash -c "${VERIFY_CMD:-python3 -m tilespec bench verify --batch 1 64 --draft 5 --vocab 151936 --dtype bf16 --filters --check --json $RES/verify.json --plot $RES/verify.png}" \
      > $RES/verify.log 2>&1; echo "verify rc=$?"; tail -25 $RES/verify.log ;;
  e2e) E2E_RES=$RES/e2e-fast E2E_TOTAL_S=${E2E_TOTAL_S:-420} bash bench/gpu/e2e_fast.sh "$@" ;;
  *) echo "unknown stage $stage" >&2 ;;
esac
tar -czf $OUT/res.tgz -C $RES .
ts "done $stage"
