export PYTHONPATH=$PWD
nvidia-smi --query-gpu=name --format=csv,noheader; date -u
HF_SPARSE_KV_TEST_DEVICE=cuda timeout 60 python3 -m pytest -q -n 4 -p no:benchmark tests/test_fp8_keys.py tests/test_cache_storage.py --tb=line 2>&1 | grep -v Warn | tail -3 | cut -c1-300
timeout 300 python3 benchmarks/bench_e2e.py --shapes 1x131072,8x32768 --ttft "" --generate "" --steps 20 --phases decode,compiled --no-static \
  --out $OUT/bench_e2e_fp8b.csv --rows "floor: dense,graph+compile+merged+linear: Quest 1/16 block,graph+compile+merged+linear: Fp8 1/16 block" > $OUT/e2e_fp8b.txt 2>&1; echo rc=$?
grep "row=" $OUT/e2e_fp8b.txt | sed 's/tokens_per_s.*floor_ms/floor_ms/' | cut -c1-200; date -u
