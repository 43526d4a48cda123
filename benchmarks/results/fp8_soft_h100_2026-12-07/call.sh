export PYTHONPATH=$PWD
nvidia-smi --query-gpu=name,clocks.max.sm --format=csv,noheader; date -u
python3 -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__, torch.cuda.get_device_capability())"
HF_SPARSE_KV_TEST_DEVICE=cuda timeout 240 python3 -m pytest -q -n 8 -p no:benchmark tests/test_fp8_keys.py > $OUT/gpu_tests_fp8_soft.txt 2>&1; echo rc=$?; tail -4 $OUT/gpu_tests_fp8_soft.txt
timeout 200 python3 benchmarks/probe_fp8_keys.py --library --out $OUT/probe_fp8_keys_soft.csv > $OUT/probe_fp8_keys_soft.txt 2>&1; echo rc=$?; tail -33 $OUT/probe_fp8_keys_soft.txt; date -u
