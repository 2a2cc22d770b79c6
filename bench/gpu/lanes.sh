#!/usr/bin/env bash
# Several GPUs of one host, one lane of run.sh stages per GPU, in the background, all ending before one deadline.
# A machine of several GPUs is held for at most 30 minutes: the lanes run while the model parts upload, and every
# `run` call after `start` either brings a part or waits and collects (the machine stays held only while calls come).
#
#   bash bench/gpu/lanes.sh start [SECONDS]   # first call (carry .parts/u00): extras, wheels, the code copied to
#                                             # /root/code, the deadline now + SECONDS (1500), lanes A..D started
#   bash bench/gpu/lanes.sh part NN           # carry .parts/uNN: one model part; a complete model converts
#   bash bench/gpu/lanes.sh collect [SECONDS] # wait up to SECONDS (0), print each lane's progress, tar $RES to $OUT
#
# Lanes (GPU, 16 CPU cores each: the launch-bound timings of one lane do not share cores with another's):
#   A  tests, exactness, verify, thresholds (kernels only), then serve (with the head once lane D has trained it)
#   B  soak (random weights), then crash-sequence, sampling-plain, sampling-qwen (Qwen 1.5B)
#   C  whisper-train, whisper-asr (whisper-base), then trees-md, heads-t1, heads-optimal (after the head)
#   D  heads-train (Qwen 1.5B), then trees-t0, trees-t1
# Timings are compared only within one lane (one GPU, one process per system pair); the JSON name the device.
set -u
ROOT=${LANES_ROOT:-/root}; CODE=$ROOT/code; RES=$ROOT/res; PARTS=$ROOT/parts; EXTRA=$ROOT/extra
export RES PARTS EXTRA TILESPEC_HOME=$ROOT/tscache
export MODELS=${MODELS:-"whisper-base qwen2.5-coder-1.5b-instruct qwen2.5-coder-0.5b-instruct"}
Q15=qwen2.5-coder-1.5b-instruct
now() { date +%s; }
left() { echo $(( $(cat "$ROOT/deadline") - $(now) )); }
log() { echo "[$(date -u +%H:%M:%S) left $(left)s] $*" >> "$RES/lane-$LANE.log"; }

wait_for() {  # wait_for FILE...: until each exists or the deadline is near; false if one is missing
  local f
  for f in "$@"; do
    while [ ! -e "$f" ]; do (( $(left) < 90 )) && { log "gave up waiting for $f"; return 1; }; sleep 5; done
  done
}

stage() {  # stage MIN_SECONDS run.sh-args...: one run.sh stage if MIN_SECONDS are left, bounded by the deadline
  local need=$1; shift
  if (( $(left) < need )); then log "skip $* ($(left)s left)"; return 1; fi
  log "start $*"
  (cd "$CODE" && E2E_TOTAL_S=$(( $(left) - 20 )) OUT=$ROOT/lane-out/$LANE timeout -k 10 $(( $(left) - 10 )) \
    bash bench/gpu/run.sh "$@" >> "$RES/lane-$LANE.log" 2>&1)
  log "end $* rc=$?"
}

lane_A() {
  stage 200 tests; stage 150 exactness; VERIFY_BUDGET_S=${VERIFY_BUDGET_S:-200} stage 300 verify
  stage 120 thresholds
  wait_for "$RES/.head-done" || true
  local systems=tilespec:none,tilespec:ngram,hf
  [ -e "$RES/.head-ready" ] && systems=tilespec:none,tilespec:ngram,tilespec:head,hf
  SERVE_SYSTEMS=${SERVE_SYSTEMS:-$systems} SERVE_LIMIT_S=$(( $(left) - 30 )) SERVE_SOAK_S=${SERVE_SOAK_S:-45} \
    stage 300 serve
}
lane_B() {
  SOAK_LIMIT_S=${SOAK_LIMIT_S:-400} stage 200 soak
  wait_for "$RES/.ready-$Q15" && stage 200 e2e crash-sequence sampling-plain sampling-qwen
}
lane_C() {
  wait_for "$RES/.ready-whisper-base" && WHISPER_MINUTES=${WHISPER_MINUTES:-3} E2E_BUDGET_S=330 \
    stage 400 e2e whisper-train whisper-asr
  wait_for "$RES/.head-done" && [ -e "$RES/.head-ready" ] || return
  TREES_BUDGET_S=${TREES_MD_BUDGET_S:-330} stage 200 e2e trees-md
  stage 150 e2e heads-t1 heads-optimal
}
lane_D() {
  wait_for "$RES/.ready-$Q15" && stage 400 e2e heads-train
  [ -f "$RES/heads-train.json" ] && touch "$RES/.head-ready"
  touch "$RES/.head-done"
  TREES_BUDGET_S=${TREES_BUDGET_S:-300} stage 200 e2e trees-t0 trees-t1
}

# One GPU shared by two lanes (LANES="S H", then LANES="T" on a second machine; SHARE_GPU=1): the soak is not a
# timing, so it may share the GPU with the head's training; every timing (serve levels, trees) runs alone.
lane_S() {   # a 10-minute saturation soak of tilespec serve (n-gram drafts, 64 clients), then .soak-done
  wait_for "$RES/.ready-${SERVE_TARGET:-$Q15}" && SERVE_NAME=serve-soak SERVE_SYSTEMS=tilespec:ngram SERVE_CLIENTS=1,64 \
    SERVE_SOAK_S=${SERVE_SOAK_S:-600} SERVE_PORT=8421 SERVE_LIMIT_S=$(( $(left) - 30 )) stage 700 serve
  touch "$RES/.soak-done"
}
lane_H() {   # the head's training (beside the soak), then the serve levels alone: none / ngram / head
  wait_for "$RES/.ready-$Q15" && stage 400 e2e heads-train
  [ -f "$RES/heads-train.json" ] && touch "$RES/.head-ready"
  wait_for "$RES/.soak-done" || true
  local systems=tilespec:none,tilespec:ngram
  [ -e "$RES/.head-ready" ] && systems=tilespec:none,tilespec:ngram,tilespec:head
  SERVE_SYSTEMS=${SERVE_SYSTEMS:-$systems} SERVE_LIMIT_S=$(( $(left) - 30 )) SERVE_SOAK_S=0 stage 300 serve
}
lane_T() {   # the tree and chain steps' cost (random weights), the tree sampler's exactness and the GPU tests while
             # the model uploads, then the head's training (beside a soak, if any) and, alone, its trees against its
             # chain (t0, t1) and its sampled chains with the seed-004 schemes (md)
  (cd "$CODE" && OUT=$ROOT/lane-out/T STEPCOST_RUNS=${STEPCOST_RUNS:-} bash bench/gpu/run.sh stepcost \
    >> "$RES/lane-T.log" 2>&1)
  EXACTNESS_PARTS=tree stage 150 exactness
  stage 200 tests
  wait_for "$RES/.ready-$Q15" && stage 400 e2e heads-train
  [ -f "$RES/heads-train.json" ] || return
  [[ " ${LANES:-} " == *" S "* ]] && { wait_for "$RES/.soak-done" || true; }
  TREES_BUDGET_S=${TREES_BUDGET_S:-240} stage 200 e2e trees-t0 trees-t1
  TREES_BUDGET_S=${TREES_MD_BUDGET_S:-240} stage 150 e2e trees-md
}

case ${1:-} in
  start)
    mkdir -p "$EXTRA" "$PARTS" "$RES" "$CODE" "$TILESPEC_HOME" "$ROOT/lane-out"
    echo $(( $(now) + ${2:-1500} )) > "$ROOT/deadline"
    bash bench/gpu/run.sh extras 2>&1 | tail -3     # extras from .parts/u00, wheels into /tmp/site
    (cd "${CODE_FROM:-.}" && cp -r src bench tests pyproject.toml "$CODE"/)   # CODE_FROM: a committed copy
    export XSUM_FILE=$EXTRA/xsum-test.jsonl HEADS_PROMPTS_FILE=$EXTRA/train-prompts.json HEADS_MINUTES=${HEADS_MINUTES:-3.5}
    export E2E_ARGS="--ignore-eos --xsum-wheel $XSUM_FILE" SYNTH_JOBS=12 OMP_NUM_THREADS=8
    gpus=$(nvidia-smi -L | wc -l); lanes=(${LANES:-A B C D}); per=$(( $(nproc) / ${#lanes[@]} )); i=0
    for LANE in "${lanes[@]}"; do
      (( i >= gpus )) && [ "${SHARE_GPU:-0}" != 1 ] && { echo "lane $LANE: no GPU $i"; continue; }
      pin=(taskset -c $(( per * i ))-$(( per * i + per - 1 )))
      (( per >= 2 )) && "${pin[@]}" true 2> /dev/null || pin=()
      (export LANE CUDA_VISIBLE_DEVICES=$(( i % gpus )); setsid nohup "${pin[@]}" \
        bash "$CODE/bench/gpu/lanes.sh" "lane_$LANE" > "$RES/lane-$LANE.out" 2>&1 < /dev/null &)
      i=$(( i + 1 ))
    done
    echo "lanes started on $gpus GPUs; deadline in ${2:-1500}s" ;;
  lane_[A-Z]) "$1" ;;
  part)
    cp .parts/u"$2"/*.part* "$PARTS"/
    (cd "$CODE" && bash bench/gpu/run.sh part "$2") 2>&1 | tail -1 ;;
  collect)
    end=$(( $(now) + ${2:-0} ))
    while (( $(now) < end )) && pgrep -f "lanes.sh lane_" > /dev/null; do sleep 5; done
    for f in "$RES"/lane-?.log; do echo "== $f"; tail -n 4 "$f"; done
    mkdir -p "$OUT" && tar -czf "$OUT/res.tgz" -C "$RES" --exclude='*.safetensors' --exclude='*.pt' . ;;
  *) sed -n '2,17p' "$0"; exit 2 ;;
esac
