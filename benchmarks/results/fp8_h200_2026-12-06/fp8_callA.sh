export PYTHONPATH=$PWD
nvidia-smi --query-gpu=name --format=csv,noheader; git log --oneline 2>/dev/null | head -1; date -u
HF_SPARSE_KV_TEST_DEVICE=cuda timeout 120 python3 -m pytest -q -n 4 -p no:benchmark tests/test_fp8_keys.py tests/test_quant_keys.py --tb=line > $OUT/tests.txt 2>&1; T=$?
grep -v Warn $OUT/tests.txt | tail -6 | cut -c1-300
timeout 150 python3 .stage/fp8_ab.py > $OUT/fp8_ab.txt 2>&1; echo rc=$?; tail -13 $OUT/fp8_ab.txt
timeout 100 python3 .stage/sel_fp8.py > $OUT/sel_fp8.txt 2>&1; echo rc=$?; tail -7 $OUT/sel_fp8.txt
[ $T -eq 0 ] || { echo "tests failed: no e2e"; exit 0; }
timeout 300 python3 benchmarks/bench_e2e.py --shapes 1x131072,8x32768 --ttft "" --generate "" --steps 20 --phases decode,compiled --no-static \
  --out $OUT/bench_e2e_fp8.csv --rows "floor: dense,graph+compile+merged+linear: Quest 1/16 block,graph+compile+merged+linear: Fp8 1/16 block" > $OUT/e2e_fp8.txt 2>&1; echo rc=$?
grep "row=" $OUT/e2e_fp8.txt | sed 's/tokens_per_s.*floor_ms/floor_ms/' | cut -c1-200; tail -3 $OUT/e2e_fp8.txt | cut -c1-300; date -u
