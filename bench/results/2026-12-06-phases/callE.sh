# call E, right after call D on the same warm machine (carry .h28/whl and .h28/p2): long context with the backward
# blocks halved (2**27 elements): does the block's transient set the peak?
source bench/results/2026-12-05-issue28-ranges/setup.sh >/dev/null 2>&1; source bench/results/2026-12-06-phases/block.sh
T="tfcompat_fused[auto]"; A="$T@attention+mlp_in"
run '2**27' --long --variants "$A:2..4+offload:3+loss,$A:0..1/3..4+offload:3+loss,liger_flex" --memory --out $OUT/train_step_long_block27.json > $OUT/train_step_long_block27.txt 2>&1
