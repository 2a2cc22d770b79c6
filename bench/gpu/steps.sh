# Sourced by the session scripts (bash bench/gpu/sessionN.sh ...): results directory $OUT, the environment, a
# timed `step NAME SECONDS CMD...` that logs to $OUT/NAME.log and goes on after a failure, and $OUT/env.txt.
set -u
OUT=${OUT:-/tmp/gpu-out}
mkdir -p "$OUT"
START=$(date +%s)
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
export PYTHONPATH=$PWD/src${PYTHONPATH:+:$PYTHONPATH}
export TILESPEC_COMMIT=${TILESPEC_COMMIT:-$(git rev-parse HEAD 2>/dev/null || echo unknown)}
ts() { echo "[$(date -u +%H:%M:%S) +$(( $(date +%s) - START ))s] $*"; }
step() {  # step NAME SECONDS CMD...
  local name=$1 limit=$2; shift 2
  ts "start $name (timeout ${limit}s)"
  timeout -k 5 "$limit" "$@" > "$OUT/$name.log" 2>&1
  ts "end $name rc=$? : $(grep -v '^\s*$' "$OUT/$name.log" | tail -1 | cut -c1-200)"
}
{
  echo "commit $TILESPEC_COMMIT"
  nvidia-smi --query-gpu=name,memory.total,clocks.max.sm,driver_version --format=csv,noheader 2>&1
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, 'cuda', torch.version.cuda)"
} > "$OUT/env.txt" 2>&1
cat "$OUT/env.txt"
