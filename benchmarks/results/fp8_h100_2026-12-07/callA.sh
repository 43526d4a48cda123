export PYTHONPATH=$PWD
nvidia-smi --query-gpu=name,clocks.max.sm --format=csv,noheader; date -u
python3 -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__)"
HF_SPARSE_KV_TEST_DEVICE=cuda timeout 90 python3 -m pytest -q -n 4 -p no:benchmark tests/test_fp8_keys.py 2>&1 | tail -2
timeout 200 python3 .stage/ab/fp8_ab2.py > $OUT/fp8_ab2.txt 2>&1; echo rc=$?; tail -24 $OUT/fp8_ab2.txt
bash .stage/ab/apply_winner.sh
timeout 100 python3 .stage/ab/sel_fp8.py 2>&1 | tee $OUT/sel_fp8.txt | tail -5; date -u
timeout 180 python3 benchmarks/bench_e2e.py --shapes 1x131072,8x32768 --ttft "" --generate "" --steps 20 --phases decode,compiled --no-static \
  --out $OUT/bench_e2e_fp8.csv --rows "floor: dense,graph+compile+merged+linear: Quest 1/16 block,graph+compile+merged+linear: Fp8 1/16 block" > $OUT/e2e_fp8.txt 2>&1; echo rc=$?
grep "row=" $OUT/e2e_fp8.txt | sed 's/tokens_per_s.*floor_ms/floor_ms/' | cut -c1-200; date -u
