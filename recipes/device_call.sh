#!/usr/bin/env bash
# One call of a quality run on a GPU machine that reaches no network and copies the working tree into each call
# (README, "A GPU machine without network"): after the model's staging calls (`hf-sparse-kv stage --model M`) and with
# `.stage/extras` carried, run the suite (or parts of recipes/suite_gaps.sh) into a results folder outside the tree
# that lives as long as the machine, seeded from the tree's cells.jsonl on its first call. While it runs, and at the
# end, the cells the tree's file lacks and the log are copied to $OUT (so a call killed at its time limit still brings
# back every finished cell). Run from the repository root.
# usage: device_call.sh SUITE SECONDS [PART ...] [-- suite args...]
#   SUITE: smollm2 | gemma3 | qwen2.5;  no PART: `hf-sparse-kv suite SUITE` on its own config, else the parts in order
#   (recipes/suite_chain.sh).  Outputs: $OUT/cells_suite_SUITE.jsonl (the cells the tree's
#   evaluation/results/suite_SUITE/cells.jsonl lacks: append them to it; past HF_SPARSE_KV_PART_BYTES, 15 MB, in parts
#   cells_suite_SUITE.jsonl.part00, .part01, ... of whole lines: append them in order), $OUT/log_suite_SUITE.txt
#   `--workers N` among the suite args runs N suite processes on the folder (evaluation.suite.run_workers)
# Environment (defaults): HF_SPARSE_KV_ASSETS (/root/hfsk_assets), HF_SPARSE_KV_EXTRAS (.stage/extras: the texts and
# the gguf wheel), HF_SPARSE_KV_SITE (/tmp/site: where the wheel goes), HF_SPARSE_KV_DEQUANTIZED ($ASSETS/dequantized:
# the model kept de-quantized by the first call, loaded by the next ones), PY (python3), OUT (/tmp/out)
set -u
SUITE=$1; S=$2; shift 2
ASSETS=${HF_SPARSE_KV_ASSETS:-/root/hfsk_assets}
EXTRAS=${HF_SPARSE_KV_EXTRAS:-.stage/extras}
SITE=${HF_SPARSE_KV_SITE:-/tmp/site}
PY=${PY:-python3}
R=$ASSETS/results/suite_$SUITE
OUTDIR=${OUT:-/tmp/out}
mkdir -p "$ASSETS" "$OUTDIR"
cp "$EXTRAS"/*.txt "$ASSETS"/
[ -d "$SITE/gguf" ] || "$PY" -m pip install -q --no-index --no-deps --target "$SITE" "$EXTRAS"/gguf-*.whl
if [ ! -d "$R" ]; then
  mkdir -p "$R"
  cp "evaluation/results/suite_$SUITE/cells.jsonl" "$R"/ 2>/dev/null || true
fi
LOG=$OUTDIR/log_suite_$SUITE.txt
PART_BYTES=${HF_SPARSE_KV_PART_BYTES:-15000000}
SEED=evaluation/results/suite_$SUITE/cells.jsonl
ALL=$R.snapshot.jsonl
# the cells so far, with those of running `--workers` merged in (python -m evaluation.suite_workers snapshot), less
# the lines of the tree's cells.jsonl: only new cells travel back (the whole file outgrew what a call returns), as
# one file, or, past PART_BYTES, as parts of whole lines (.part00, .part01, ...: a call brings back files of at most
# 16 MiB each; `cat` them in order)
keep() {
  PYTHONPATH=$PWD python3 -m evaluation.suite_workers snapshot "$R" "$ALL" 2>/dev/null \
    || cp "$R/cells.jsonl" "$ALL" 2>/dev/null || return 0
  if [ -s "$SEED" ]; then grep -vxFf "$SEED" "$ALL" > "$ALL.new"; else cp "$ALL" "$ALL.new"; fi
  local base=$OUTDIR/cells_suite_$SUITE.jsonl
  if [ "$(wc -c < "$ALL.new")" -le "$PART_BYTES" ]; then
    mv "$ALL.new" "$base"
    rm -f "$base".part*
  else
    rm -rf "$ALL.parts" && mkdir "$ALL.parts"
    split -C "$PART_BYTES" -d -a 2 "$ALL.new" "$ALL.parts/part"
    rm -f "$base" "$base".part* "$ALL.new"
    for f in "$ALL.parts"/part*; do mv "$f" "$base.${f##*/}"; done
  fi
}
( while sleep 20; do keep; done ) &
COPIER=$!
export PYTHONPATH=$SITE:$PWD HF_SPARSE_KV_ASSETS=$ASSETS PYTHONUNBUFFERED=1 PY
export HF_SPARSE_KV_DEQUANTIZED=${HF_SPARSE_KV_DEQUANTIZED:-$ASSETS/dequantized}
{
  if [ $# -eq 0 ] || [ "$1" = "--" ]; then
    [ "${1:-}" = "--" ] && shift
    "$PY" -m evaluation.cli suite "$SUITE" --out "$R" --time-limit "$S" "$@"
  else
    bash recipes/suite_chain.sh "$R" "$S" "$@"
  fi
} >> "$LOG" 2>&1
rc=$?
kill "$COPIER" 2>/dev/null
keep
tail -c 3000 "$LOG" | tr '\r' '\n' | grep -v "it/s\]\|s/it\]" | tail -25
exit $rc
