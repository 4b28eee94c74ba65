# call F, right after call E (carry .h28/whl and .h28/p2): 28 layers with the two-node SwiGLU down projection
# (blocks of 2**28): full checkpointing, section 19's best policy, Liger + flex
source bench/results/2026-12-05-issue28-ranges/setup.sh >/dev/null 2>&1
T="tfcompat_fused[auto]"; A="$T@attention+mlp_in"
timeout 290 python3 bench/train_step.py --variants "$T@loss,$A:3..24..3/24..28+offload:24+loss,liger_flex" --out $OUT/train_step_28.json > $OUT/train_step_28.txt 2>&1
