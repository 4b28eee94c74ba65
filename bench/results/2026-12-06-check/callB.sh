# call B, right after call A on the same warm machine (carry .h28/whl and .h28/p2: FA4's runtime): 28 layers with
# the heads' check off the critical path: full checkpointing, "mlp_in" every third offloaded layer from 3 and from 0,
# against Liger + flex, profiled; then the best and Liger + flex again in a second process
date
source bench/results/2026-12-05-issue28-ranges/setup.sh || exit 3
t0=$(date +%s)
T="tfcompat_fused[auto]"
A="$T@attention+mlp_in"
timeout 330 python3 bench/train_step.py --variants "$T@loss,$A:3..24..3/24..28+offload:24+loss,$A:0..24..3/24..28+offload:24+loss,liger_flex" --profile "$T@loss,$A:3..24..3/24..28+offload:24+loss" --out $OUT/train_step.json 2>&1 | tee $OUT/train_step.txt | grep -v "^speed-up\|^top" | tail -16
grep "^speed-up" $OUT/train_step.txt | grep -E "/ liger_flex$"
echo "first done at $(( $(date +%s) - t0 )) s"
timeout $(( 560 - ($(date +%s) - t0) )) python3 bench/train_step.py --variants "$A:3..24..3/24..28+offload:24+loss,liger_flex" --out $OUT/train_step_again.json 2>&1 | tee $OUT/train_step_again.txt | grep -v "^speed-up\|^top" | tail -4
grep "^speed-up" $OUT/train_step_again.txt | grep -E "/ liger_flex$"
echo "call took $(( $(date +%s) - t0 )) s"; date
