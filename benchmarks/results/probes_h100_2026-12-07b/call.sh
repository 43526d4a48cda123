export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
G=$(nvidia-smi --query-gpu=name --format=csv,noheader); echo "$G"; date -u
python3 -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__)"
git log --oneline -1 2>/dev/null
if echo "$G" | grep -q H200; then
  timeout 90 python3 .stage/h200/sel_fp8.py 2>&1 | tee $OUT/sel_fp8_h200.txt | tail -5; date -u
  timeout 250 python3 benchmarks/bench_e2e.py --shapes "" --ttft "" --generate 8x32768 --phases generate,compiled \
    --out $OUT/bench_e2e_gen_fp8_h200.csv --rows "generate: graph+compile+merged: Quest 1/16 block,generate: graph+compile+merged: Fp8 1/16 block" > $OUT/e2e_gen_fp8_h200.txt 2>&1; echo rc=$?
  grep "row=" $OUT/e2e_gen_fp8_h200.txt | cut -c1-330; date -u
  timeout 130 python3 benchmarks/probe_overlap.py 2>&1 | tee $OUT/probe_overlap_h200.txt | tail -30; date -u
  timeout 80 python3 benchmarks/probe_read_floor.py 2>&1 | tee $OUT/probe_read_floor_h200.txt | tail -30; date -u
else
  timeout 150 python3 benchmarks/probe_overlap.py 2>&1 | tee $OUT/probe_overlap_h100.txt | tail -30; date -u
  timeout 100 python3 benchmarks/probe_read_floor.py 2>&1 | tee $OUT/probe_read_floor_h100.txt | tail -30; date -u
  HF_SPARSE_KV_TEST_DEVICE=cuda timeout 250 python3 -m pytest -q -n 14 -p no:benchmark -p no:cacheprovider tests/ > $OUT/gpu_suite.txt 2>&1; echo rc=$?; tail -15 $OUT/gpu_suite.txt; date -u
fi
