#!/usr/bin/env bash
# One device call that measures what the 2026-12-05 CPU changes aimed at Qwen2.5's suite grid buy (issue 12), on
# random weights of a suite model's shape (no model file to stage): benchmarks/profile_grid.py
#   1. needle-like batches at LONG, BATCH prompts, the batch prefill   -> $OUT/levers_batch.csv
#   2. the same, each prompt prefilled alone and the caches stacked    -> $OUT/levers_rows.csv
#   3. the same with twice the prompts a batch (stacked prefill)       -> $OUT/levers_rows_x2.csv
#   4. simulated perplexity at SHORT, one window, then WINDOWS at once -> $OUT/levers_ppl_w1/_wN.csv
#   5. part 2 again with the kept slot refilled whole at every turn     -> $OUT/levers_rows_whole.csv
# and every part's log in $OUT/levers.txt, each after a line "== part NAME" (seven files: a device call brings back
# at most eight). Each part has SECONDS (default 90: the six fit a 10-minute call) and goes on after a failure (an
# out-of-memory batch says so in the log).
# usage: profile_levers.sh [SHAPE [LONG [SHORT [BATCH [WINDOWS [SECONDS [profile_grid args, e.g. --device cpu]]]]]]]
set -u
SHAPE=${1:-qwen2.5}; LONG=${2:-32768}; SHORT=${3:-8192}; B=${4:-8}; W=${5:-4}; S=${6:-90}
shift $(( $# < 6 ? $# : 6 ))
OUTDIR=${OUT:-/tmp/out}
PY=${PY:-python3}
mkdir -p "$OUTDIR"
LOG=$OUTDIR/levers.txt  # every part's log in one file: a device call brings back at most eight files
: > "$LOG"
part() {  # NAME, then profile_grid's arguments
  local name=$1; shift
  echo "== part $name" >> "$LOG"
  timeout "$S" "$PY" benchmarks/profile_grid.py --shape "$SHAPE" --out "$OUTDIR/levers_$name.csv" "$@" >> "$LOG" 2>&1 \
    || echo "[profile_levers] $name ended with status $?" | tee -a "$LOG"
  awk -v p="== part $name" '$0 == p {on = 1; next} /^== part / {on = 0} on' "$LOG" | tail -12
}
part batch --length "$LONG" --batch "$B" --batches 3 --no-perplexity --prefill batch "$@"
part rows --length "$LONG" --batch "$B" --batches 3 --no-perplexity --prefill rows "$@"
part rows_x2 --length "$LONG" --batch $(( 2 * B )) --batches 2 --no-perplexity --prefill rows "$@"
part ppl_w1 --length "$SHORT" --batches 0 --windows 1 "$@"
part "ppl_w$W" --length "$SHORT" --batches 0 --windows "$W" "$@"
part rows_whole --length "$LONG" --batch "$B" --batches 3 --no-perplexity --prefill rows --whole-refills "$@"
