# call D, right after call C (carry .h28/whl and .h28/p2: FA4's runtime): long context with the two-node SwiGLU
# down projection (fused "swiglu"), by phase: "mlp_in" in the last layer, in the first and last, in the last two;
# against Liger + flex
date
source bench/results/2026-12-05-issue28-ranges/setup.sh || exit 3
t0=$(date +%s)
T="tfcompat_fused[auto]"
A="$T@attention+mlp_in"
timeout 400 python3 bench/train_step.py --long --variants "$A:3..4+offload:3+loss,$A:0..1/3..4+offload:3+loss,$A:2..4+offload:3+loss,liger_flex" --memory --out $OUT/train_step_long.json 2>&1 | tee $OUT/train_step_long.txt | grep -v "^speed-up\|^top" | grep -v "^memory" | tail -12
grep "^speed-up" $OUT/train_step_long.txt | grep -E "/ liger_flex$"
grep "^memory" $OUT/train_step_long.txt | cut -c1-600
echo "call took $(( $(date +%s) - t0 )) s"; date
