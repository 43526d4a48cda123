#!/usr/bin/env bash
# throwaway: is a setsid-detached process slower on the host than an attached one? (same machine, same job)
OUTDIR=${OUT:-/tmp/out}; mkdir -p "$OUTDIR"
A="benchmarks/profile_grid.py --shape qwen2.5 --length 8192 --batch 16 --batches 5 --no-perplexity --prefill rows"
info() { echo "[$1] nice $(nice) $(taskset -p $$ 2>/dev/null) cg $(cat /proc/self/cgroup | tr '\n' ' ') mhz $(grep MHz /proc/cpuinfo | awk '{s+=$4} END {print s/NR}')"; }
info host; nproc; lscpu | grep "Model name"
timeout 110 python3 $A --out "$OUTDIR/a1.csv" > "$OUTDIR/a1.txt" 2>&1; echo "a1 rc $?"
rm -f /tmp/det_done
export -f info; export A OUTDIR
setsid bash -c 'info detached; timeout 110 python3 $A --out "$OUTDIR/d1.csv" > "$OUTDIR/d1.txt" 2>&1; echo $? > /tmp/det_done' < /dev/null > "$OUTDIR/dinfo.txt" 2>&1 &
while [ ! -e /tmp/det_done ]; do sleep 1; done; echo "d1 rc $(cat /tmp/det_done)"; cat "$OUTDIR/dinfo.txt"
timeout 110 python3 $A --out "$OUTDIR/a2.csv" > "$OUTDIR/a2.txt" 2>&1; echo "a2 rc $?"
for f in a1 d1 a2; do echo "== $f"; grep "^batch\|^{\|Error\|error" "$OUTDIR/$f.txt" | tail -8; done
