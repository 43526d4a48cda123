export PYTHONPATH=$PWD
nvidia-smi --query-gpu=name --format=csv,noheader; date -u
bash .stage/ab/apply_winner.sh
for S in "32,8,128" "12,2,128"; do
  n=$(echo $S | tr , _)
  timeout 150 python3 -m hf_sparse_kv.calibrate --timing graph --batches 1,8 --shapes "$S" --policy Fp8BlockTopK --out $OUT/graph_fp8_$n.json > $OUT/cal_fp8_$n.txt 2>&1; echo "$S rc=$?"; tail -2 $OUT/cal_fp8_$n.txt
done; date -u
timeout 250 python3 benchmarks/bench_e2e.py --shapes "" --ttft "" --generate 8x32768 --phases generate,compiled \
  --out $OUT/bench_e2e_gen_fp8.csv --rows "generate: graph+compile+merged: Quest 1/16 block,generate: graph+compile+merged: Fp8 1/16 block" > $OUT/e2e_gen_fp8.txt 2>&1; echo rc=$?
grep "row=" $OUT/e2e_gen_fp8.txt | cut -c1-330; date -u
