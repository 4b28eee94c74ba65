# call D, right after call C on the same warm machine (carry .h28/whl and .h28/p2: FA4's and quack's runtime):
# the gated MLP alone (cuBLAS + Liger's SwiGLU against quack's GEMMs with the activation in the epilogue), then
# "mlp_in" spread over the offloaded layers (the host link's spare time in the forward), profiled
date
source bench/results/2026-12-05-issue28-ranges/setup.sh || exit 3
t0=$(date +%s)
timeout 150 python3 bench/mlp_kernels.py --out $OUT/mlp_kernels.json 2>&1 | tee $OUT/mlp_kernels.txt | grep -v Warn | tail -12  # quack 0.6.5 failed here (see callD_mlp_kernels_quack_failed.txt); the script was then removed
echo "mlp done at $(( $(date +%s) - t0 )) s"
T="tfcompat_fused[auto]"
timeout $(( 560 - ($(date +%s) - t0) )) python3 bench/train_step.py --variants "$T@attention+mlp_in:7+offload:24+loss,$T@attention+mlp_in:8..24..3/24..28+offload:24+loss,$T@attention+mlp_in:6..24..2/24..28+offload:24+loss,$T@attention+mlp_in:12..28+offload:24+loss,liger_flex" --profile "$T@attention+mlp_in:8..24..3/24..28+offload:24+loss,$T@attention+mlp_in:6..24..2/24..28+offload:24+loss,$T@attention+mlp_in:12..28+offload:24+loss" --out $OUT/train_step.json 2>&1 | tee $OUT/train_step.txt | grep -v "^speed-up\|^top" | tail -16
grep "^speed-up" $OUT/train_step.txt | grep -E "/ liger_flex$"
echo "call took $(( $(date +%s) - t0 )) s"; date
