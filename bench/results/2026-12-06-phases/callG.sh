# call G, right after call F (carry .h28/whl and .h28/p2): blocks of 2**29 (one block at 19,679 tokens): 28 layers
# (section 19's best policy) and long context ("mlp_in" in the last two layers), each against Liger + flex
source bench/results/2026-12-05-issue28-ranges/setup.sh >/dev/null 2>&1; source bench/results/2026-12-06-phases/block.sh
T="tfcompat_fused[auto]"; A="$T@attention+mlp_in"
run '2**29' --variants "$A:3..24..3/24..28+offload:24+loss,liger_flex" --out $OUT/train_step_28_block29.json > $OUT/train_step_28_block29.txt 2>&1
run '2**29' --long --variants "$A:2..4+offload:3+loss,liger_flex" --out $OUT/train_step_long_block29.json > $OUT/train_step_long_block29.txt 2>&1
