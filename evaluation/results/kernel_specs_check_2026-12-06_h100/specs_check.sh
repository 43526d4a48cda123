#!/usr/bin/env bash
# throwaway: specializations recorded in one run, built ahead into an empty Triton cache, found by the next run?
OUTDIR=${OUT:-/tmp/out}; mkdir -p "$OUTDIR"
ARGS="--shape qwen2.5 --length 8192 --batch 16 --batches 2 --no-perplexity --prefill rows"
S=$OUTDIR/specs.jsonl
rec() {
  python3 - "$@" <<'PY'
import runpy, sys
from evaluation.kernel_specs import record
path = sys.argv[1]
sys.argv = ["benchmarks/profile_grid.py"] + sys.argv[2:]
with record(path):
    runpy.run_path("benchmarks/profile_grid.py", run_name="__main__")
PY
}
T0=$SECONDS
TRITON_CACHE_DIR=/tmp/cA timeout 90 bash -c "$(declare -f rec); rec $S $ARGS --out $OUTDIR/r1.csv" > "$OUTDIR/r1.txt" 2>&1
echo "r1 rc $? specs $(wc -l < "$S") at $((SECONDS - T0)) s"
TRITON_CACHE_DIR=/tmp/cB timeout 70 python3 -c "
import time
from evaluation.kernel_specs import Prebuild, read_specs, default_workers
s = read_specs('$S'); p = Prebuild(s, default_workers()); ok = p.wait(65); print(ok, default_workers(), p.summary()); p.close()
" > "$OUTDIR/pb.txt" 2>&1
echo "pb rc $? at $((SECONDS - T0)) s: $(tail -c 600 "$OUTDIR/pb.txt")"
TRITON_CACHE_DIR=/tmp/cB timeout 60 python3 benchmarks/profile_grid.py $ARGS --out "$OUTDIR/r2.csv" > "$OUTDIR/r2.txt" 2>&1
echo "r2 rc $? at $((SECONDS - T0)) s"
for f in r1 r2; do echo "== $f"; grep "^batch\|Error" "$OUTDIR/$f.txt" | tail -4; done
