# call D, right after call C (carry .h28/whl and .h28/p2: FA4's runtime): call B's vision-attention CUDA test failed
# for FA4 at head dim 80 (dq 0.98 of the largest entry); which head dims FA4 gets right, causal and not
D=bench/results/2026-12-06-fused-loss
date
source bench/results/2026-12-05-issue28-ranges/setup.sh || exit 3
t0=$(date +%s)
timeout 300 python3 bench/flash_head_dims.py --out $OUT/flash_head_dims.json 2>&1 | tee $OUT/flash_head_dims.txt | grep -v Warn | tail -40
echo "call took $(( $(date +%s) - t0 )) s"; date
