# call H, right after call G (carry .h28/whl and .h28/p2): blocks of 2**29, 28 layers, "mlp_in" every third layer from 0
# and from 2 (and 24-27); Liger + flex from call G, same warm machine (no device time was left for it here)
source bench/results/2026-12-05-issue28-ranges/setup.sh >/dev/null 2>&1; source bench/results/2026-12-06-phases/block.sh
T="tfcompat_fused[auto]"; A="$T@attention+mlp_in"
run '2**29' --variants "$A:0..24..3/24..28+offload:24+loss,$A:2..24..3/24..28+offload:24+loss" --out $OUT/train_step_28_block29_more.json > $OUT/train_step_28_block29_more.txt 2>&1
