export PYTHONPATH=$PWD
nvidia-smi --query-gpu=name --format=csv,noheader; date -u
HF_SPARSE_KV_TEST_DEVICE=cuda timeout 300 python3 -m pytest -q -n 14 -p no:benchmark -p no:cacheprovider tests/test_selector_ops.py tests/test_fp8_keys.py tests/test_product_codes.py tests/test_auto_mode.py tests/test_bench_linear.py tests/test_pair_policies.py tests/test_selectors.py > $OUT/gpu_tests_rerun.txt 2>&1; echo rc=$?
grep -E "^(FAILED|ERROR)|passed|failed" $OUT/gpu_tests_rerun.txt | tail -12; date -u
