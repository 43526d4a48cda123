export PYTHONPATH=$PWD
nvidia-smi --query-gpu=name --format=csv,noheader
timeout 570 python3 benchmarks/bench_e2e.py --shapes ${1:-1x131072} --ttft "" --generate "" --steps 20 --phases decode,compiled --out $OUT/bench_e2e_static.csv --rows "floor: dense,unpatched StaticCache + compile,graph+compile+merged+linear: patched Dense,graph+compile+merged+linear: Quest 1/16 block" > $OUT/e2e_static.txt 2>&1; echo rc=$?
grep "row=" $OUT/e2e_static.txt | sed 's/tokens_per_s.*floor_ms/floor_ms/'
tail -4 $OUT/e2e_static.txt | cut -c1-200
