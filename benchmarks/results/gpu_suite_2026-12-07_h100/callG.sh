export PYTHONPATH=$PWD
nvidia-smi --query-gpu=name --format=csv,noheader; date -u; git log --oneline 2>/dev/null | head -1
HF_SPARSE_KV_TEST_DEVICE=cuda timeout 330 python3 -m pytest -q -n 14 -p no:benchmark -p no:cacheprovider tests/ > $OUT/gpu_suite.txt 2>&1; echo rc=$?
grep -E "^(FAILED|ERROR)|passed|failed" $OUT/gpu_suite.txt | tail -30; date -u
