export PYTHONPATH=$PWD
nvidia-smi --query-gpu=name --format=csv,noheader; date -u
grep "^TILES_PER_PROGRAM\|^STAGES" hf_sparse_kv/ops/triton/fp8.py | tr '\n' ' '; echo
for S in "9,3,64" "4,1,256"; do
  n=$(echo $S | tr , _)
  timeout 120 python3 -m hf_sparse_kv.calibrate --timing graph --batches 1,8 --shapes "$S" --policy Fp8BlockTopK --out $OUT/graph_fp8_$n.json > $OUT/cal_fp8_$n.txt 2>&1; echo "$S rc=$?"; tail -2 $OUT/cal_fp8_$n.txt
done; date -u
