#!/usr/bin/env bash
# Before a suite call decodes statically on a GPU machine: one needle batch of MODEL at LENGTH decoded eagerly and
# through captured steps under every policy (benchmarks/time_needle_batch.py --static); writes "true" to FLAG when
# every static (or reused) row gives the eager tokens for every prompt, else "false" (and "false" when the check
# fails). Where a row parts from its eager row, _diverge.csv gives the step and both margins (tie or not).
# Needs the model staged (hf-sparse-kv stage) and .stage/extras carried; run from the repository root.
# usage: static_check.sh MODEL LENGTH BATCH FLAG [SECONDS [time_needle_batch args, e.g. --reuse]]
#   outputs: $OUT/static_check_MODEL{.csv,.txt,_policies.csv,_diverge.csv}
set -u
M=$1; L=$2; B=$3; FLAG=$4; S=${5:-240}
shift $(( $# < 5 ? $# : 5 ))
OUTDIR=${OUT:-/tmp/out}
ASSETS=${HF_SPARSE_KV_ASSETS:-/root/hfsk_assets}
EXTRAS=${HF_SPARSE_KV_EXTRAS:-.stage/extras}
SITE=${HF_SPARSE_KV_SITE:-/tmp/site}
PY=${PY:-python3}
mkdir -p "$ASSETS" "$OUTDIR"
cp "$EXTRAS"/*.txt "$ASSETS"/
[ -d "$SITE/gguf" ] || "$PY" -m pip install -q --no-index --no-deps --target "$SITE" "$EXTRAS"/gguf-*.whl
CSV=$OUTDIR/static_check_$M.csv
PYTHONPATH=$SITE:$PWD HF_SPARSE_KV_ASSETS=$ASSETS timeout "$S" "$PY" benchmarks/time_needle_batch.py --model "$M" \
  --length "$L" --batch "$B" --static --kinds padded \
  --sparse quest,oracle,quant4,token_topk,block_topk,sink_window,snapkv,snapkv1/4+quest \
  --out "$CSV" "$@" > "$OUTDIR/static_check_$M.txt" 2>&1
tail -30 "$OUTDIR/static_check_$M.txt"
cat "${CSV%.csv}_diverge.csv" 2>/dev/null
"$PY" - "$CSV" "$FLAG" <<'PYEOF'
import csv, sys
try:
    rows = [r for r in csv.DictReader(open(sys.argv[1])) if "static" in r["variant"] or "reused" in r["variant"]]
except OSError:
    rows = []
ok = bool(rows) and all(r["same"] == r["batch"] for r in rows)
open(sys.argv[2], "w").write("true" if ok else "false")
print("static:", "true" if ok else "false", f"({len(rows)} static rows)")
PYEOF
