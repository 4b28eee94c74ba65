# call A (carry .h28/whl and .h28/p1: liger-kernel, FA4 not yet runnable): long context, the peak memory of each
# phase (--memory) of Liger + flex
date
source bench/results/2026-12-05-issue28-ranges/setup.sh || exit 3
t0=$(date +%s)
timeout 400 python3 bench/train_step.py --long --variants "liger_flex" --memory --out $OUT/train_step_long_liger.json 2>&1 | tee $OUT/train_step_long_liger.txt | grep -v "^speed-up\|^top" | tail -8
echo "call took $(( $(date +%s) - t0 )) s"; date
