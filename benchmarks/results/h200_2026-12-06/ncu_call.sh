export PYTHONPATH=$PWD
nvidia-smi --query-gpu=name --format=csv,noheader
which ncu || ls /opt/nvidia/nsight-compute/*/ncu
python3 .stage/ncu_probe.py 2>&1 | tail -2
S="--section SpeedOfLight --section MemoryWorkloadAnalysis --section Occupancy --section LaunchStats --section WarpStateStats --section SchedulerStats --section ComputeWorkloadAnalysis --section InstructionStats"
timeout 400 ncu --clock-control none -k regex:"quant_block_lse_diag|block_scores_kernel|topk_indices_kernel|sparse_decode_fwd|merge_partials|quant_lse_stats|quant_mass" --launch-skip-before-match 0 $S python3 .stage/ncu_probe.py > $OUT/ncu_selection.txt 2>&1; echo rc=$?
grep -E "^  [a-z_]+.*\(|Duration|DRAM Throughput|Memory Throughput|Achieved Occupancy|Registers Per|Theoretical Occupancy|Compute \(SM\) Throughput|Warp Cycles Per Issued|Issue Slots Busy|No Eligible|Block Limit Registers|Dynamic Shared|Grid Size|Block Size|Stall|L1/TEX Hit|L2 Hit" $OUT/ncu_selection.txt | head -300
