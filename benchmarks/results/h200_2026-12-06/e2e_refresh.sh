set -x
export PYTHONPATH=$PWD
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv
python3 -c "import torch,triton,transformers;print(torch.__version__,triton.__version__,transformers.__version__)"
git log --oneline 2>/dev/null | head -1
timeout 560 python3 benchmarks/bench_e2e.py --shapes ${1:-1x131072,8x32768} --ttft "" --generate "" \
  --steps 20 --phases decode,compiled --no-static --out $OUT/bench_e2e_refresh.csv --rows "floor: dense,graph+compile+merged: patched Dense,graph+compile+merged+linear: patched Dense,graph+compile+merged: Quest 1/16 block,graph+compile+merged+linear: Quest 1/16 block" > $OUT/e2e_refresh.txt 2>&1; echo rc=$?
grep "row=" $OUT/e2e_refresh.txt | sed 's/tokens_per_s.*floor_ms/floor_ms/'
tail -3 $OUT/e2e_refresh.txt | cut -c1-300
