#!/usr/bin/env bash
# Before a suite call decodes statically on a GPU machine: one needle batch of MODEL at LENGTH decoded eagerly and
# through captured steps under every policy (benchmarks/time_needle_batch.py --static); writes "true" to FLAG when
# every static (or reused) row gives the eager tokens for every prompt, or parts from them only at ties (both
# decodings' two best logits within 2 units in the last place of the logits' dtype, time_needle_batch.is_tie: a
# different summation order breaking a tie); else "false" (and when the check fails). _diverge.csv gives each
# parting's step and margins.
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
try:  # where a captured row parted from its eager row: a bf16 tie (time_needle_batch.is_tie) or not
    parts = [r for r in csv.DictReader(open(sys.argv[1][: -len(".csv")] + "_diverge.csv")) if r["variant"] in {x["variant"] for x in rows}]
except OSError:
    parts = []
same = bool(rows) and all(r["same"] == r["batch"] for r in rows)
ties = bool(rows) and not same and len(parts) > 0 and all(r["tie"] == "True" for r in parts)
ok = same or ties
open(sys.argv[2], "w").write("true" if ok else "false")
print("static:", "true" if ok else "false", f"({len(rows)} static rows;", "the same tokens)" if same else f"{len(parts)} partings, {sum(r['tie'] == 'True' for r in parts)} of them ties)")
PYEOF
