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
#   `--workers N` among the suite args runs N suite processes on the folder (evaluation.suite.run_workers);
#   $OUT/kernel_specs_SUITE.jsonl: the Triton specializations recorded so far (below)
# Detached (HF_SPARSE_KV_DETACH=TOTAL seconds): the suite (or the chain) runs in its own process session within TOTAL
#   seconds, outliving the call (the device tool ends a call's processes, not a new session's), and the call waits for
#   it at most SECONDS, copying its cells and log (kept in $ASSETS/results/suite_SUITE.run/) to $OUT as above. The next
#   call with the same arguments, back to back on the same warm machine, finds it running and waits again instead of
#   starting another: a grid longer than one call runs in one process (one model load, its captured steps kept for
#   every job) instead of one per call. The call's status: the run's, once it ended (a run that ended between two
#   calls is reported by the next one, which starts none); 0 while it still runs ("still running" on the log's last
#   line). After a call saw it end, the next detached call starts a new run (on a finished suite: nothing to do).
#   A call without HF_SPARSE_KV_DETACH while a detached run is alive starts nothing and exits with status 75.
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
# Triton specializations (evaluation/kernel_specs.py): those recorded by earlier runs (the tree's
# recipes/kernel_specs_SUITE.jsonl) built ahead in parallel while the model loads, each new one appended; the file
# travels back as $OUT/kernel_specs_SUITE.jsonl (replace the tree's with it to keep what this run added)
export HF_SPARSE_KV_KERNEL_SPECS=${HF_SPARSE_KV_KERNEL_SPECS:-$ASSETS/kernel_specs_$SUITE.jsonl}
[ -s "$HF_SPARSE_KV_KERNEL_SPECS" ] || cp "recipes/kernel_specs_$SUITE.jsonl" "$HF_SPARSE_KV_KERNEL_SPECS" 2>/dev/null || true
LOG=$OUTDIR/log_suite_$SUITE.txt
PART_BYTES=${HF_SPARSE_KV_PART_BYTES:-15000000}
SEED=evaluation/results/suite_$SUITE/cells.jsonl
ALL=$R.snapshot.jsonl
# the cells so far, with those of running `--workers` merged in (python -m evaluation.suite_workers snapshot), less
# the lines of the tree's cells.jsonl: only new cells travel back (the whole file outgrew what a call returns), as
# one file, or, past PART_BYTES, as parts of whole lines (.part00, .part01, ...: a call brings back files of at most
# 16 MiB each; `cat` them in order)
keep() {
  cp "$HF_SPARSE_KV_KERNEL_SPECS" "$OUTDIR/kernel_specs_$SUITE.jsonl" 2>/dev/null
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
EVERY=${HF_SPARSE_KV_COPY_EVERY:-20}
export PYTHONPATH=$SITE:$PWD HF_SPARSE_KV_ASSETS=$ASSETS PYTHONUNBUFFERED=1 PY
export HF_SPARSE_KV_DEQUANTIZED=${HF_SPARSE_KV_DEQUANTIZED:-$ASSETS/dequantized}
# the suite, or the chain of parts, within $1 seconds (the arguments after SECONDS are the script's own)
suite() {
  local limit=$1; shift
  if [ $# -eq 0 ] || [ "$1" = "--" ]; then
    [ "${1:-}" = "--" ] && shift
    "$PY" -m evaluation.cli suite "$SUITE" --out "$R" --time-limit "$limit" "$@"
  else
    bash recipes/suite_chain.sh "$R" "$limit" "$@"
  fi
}
show() { tail -c 3000 "$1" | tr '\r' '\n' | grep -v "it/s\]\|s/it\]" | tail -25; }
RUN=$R.run  # a detached run's: pid (the detached shell's), rc (once it ended), log
alive() { [ -s "$RUN/pid" ] && [ ! -e "$RUN/rc" ] && kill -0 "$(cat "$RUN/pid")" 2>/dev/null; }
if [ -z "${HF_SPARSE_KV_DETACH:-}" ] && alive; then  # a second suite on the same folder would redo its jobs
  echo "== a detached run (pid $(cat "$RUN/pid")) is still running on $R: call with HF_SPARSE_KV_DETACH to wait for it" \
    | tee -a "$LOG"
  exit 75
fi
if [ -n "${HF_SPARSE_KV_DETACH:-}" ]; then
  if ! alive && [ ! -e "$RUN/rc" ]; then
    rm -rf "$RUN" && mkdir -p "$RUN"
    export -f suite && export SUITE R RUN
    setsid bash -c 'echo $$ > "$RUN/pid.new" && mv "$RUN/pid.new" "$RUN/pid"; suite "$@" >> "$RUN/log" 2>&1 < /dev/null; echo $? > "$RUN/rc"' \
      _ "$HF_SPARSE_KV_DETACH" "$@" > /dev/null 2>&1 < /dev/null &
    while [ ! -s "$RUN/pid" ] && [ ! -e "$RUN/rc" ]; do sleep 0.2; done
    echo "== detached run started (pid $(cat "$RUN/pid" 2>/dev/null), within $HF_SPARSE_KV_DETACH s)" >> "$RUN/log"
  fi
  end=$((SECONDS + S)) next=$((SECONDS + EVERY))
  while alive && [ "$SECONDS" -lt "$end" ]; do
    sleep 1
    if [ "$SECONDS" -ge "$next" ]; then keep; cp "$RUN/log" "$LOG"; next=$((SECONDS + EVERY)); fi
  done
  keep
  ended=0 rc=0 said="still running (pid $(cat "$RUN/pid")): call again to wait for it"
  if [ -e "$RUN/rc" ]; then ended=1 rc=$(cat "$RUN/rc") said="ended with status $rc"; fi
  echo "== detached run $said" >> "$RUN/log" && cp "$RUN/log" "$LOG"
  [ "$ended" = 1 ] && mv "$RUN" "$RUN.ended.$(date +%s)"  # ended: the next detached call starts afresh
  show "$LOG"
  exit "$rc"
fi
( while sleep "$EVERY"; do keep; done ) &
COPIER=$!
suite "$S" "$@" >> "$LOG" 2>&1
rc=$?
kill "$COPIER" 2>/dev/null
keep
show "$LOG"
exit $rc
