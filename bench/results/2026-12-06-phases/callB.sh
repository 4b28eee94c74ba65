# call B, right after call A (carry .h28/whl and .h28/p2: FA4's runtime): long context, the peak memory of each
# phase (--memory) of the policy at Liger's memory ("mlp_in" in the last layer), with the first layer's offloaded, and of
date
source bench/results/2026-12-05-issue28-ranges/setup.sh || exit 3
t0=$(date +%s)
T="tfcompat_fused[auto]"
A="$T@attention+mlp_in"
timeout 500 python3 bench/train_step.py --long --variants "$A:1+offload:3+loss,$A:0..1/3..4+offload:3+loss,liger_flex" --memory --out $OUT/train_step_long.json 2>&1 | tee $OUT/train_step_long.txt | grep -v "^speed-up\|^top" | tail -10
echo "call took $(( $(date +%s) - t0 )) s"; date
