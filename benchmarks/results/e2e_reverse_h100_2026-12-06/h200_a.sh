set -x
export PYTHONPATH=$PWD
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv
python3 -c "import torch,triton,transformers;print(torch.__version__,triton.__version__,transformers.__version__)"
timeout 540 python3 benchmarks/bench_e2e.py --shapes 1x131072 --ttft "" --generate "" \
  --steps 20 --phases decode,compiled --no-static --out $OUT/bench_e2e_1x128k.csv --rows "floor: dense,graph+compile+merged: patched Dense,graph+compile+merged+linear: patched Dense,graph+compile+merged: Quest 1/16 block,graph+compile+merged+linear: Quest 1/16 block" > $OUT/e2e_1x128k.txt 2>&1; echo rc=$?
grep "row=" $OUT/e2e_1x128k.txt | sed 's/tokens_per_s.*floor_ms/floor_ms/'
tail -8 $OUT/e2e_1x128k.txt | cut -c1-200
