W=.stage/keep/fp8_winner.txt
F=hf_sparse_kv/ops/triton/fp8.py
if [ -f $W ]; then read bm w t s < $W
  sed -i "s/^BLOCKS_PER_PROGRAM = .*/BLOCKS_PER_PROGRAM = $bm/; s/^WARPS = .*/WARPS = $w/; s/^TILES_PER_PROGRAM = .*/TILES_PER_PROGRAM = $t/; s/^STAGES = .*/STAGES = $s/" $F
  echo "fp8 defaults from the winner file: $bm $w $t $s"
else echo "no winner file: the tree's fp8 defaults"; fi
grep "^BLOCKS_PER_PROGRAM\|^WARPS\|^TILES_PER_PROGRAM\|^STAGES" $F | tr '\n' ' '; echo
