# call C, right after call B (carry .h28/whl and .h28/p2): long context, "mlp_in" in the last layer (on the GPU)
# and in the first (offloaded) against Liger + flex, profiled; then the GPU tests that need FA4's runtime
date
source bench/results/2026-12-05-issue28-ranges/setup.sh || exit 3
t0=$(date +%s)
T="tfcompat_fused[auto]"
A="$T@attention+mlp_in"
timeout 330 python3 bench/train_step.py --long --variants "$A:1+offload:3+loss,$A:0..1/3..4+offload:3+loss,$A:0..2/3..4+offload:3+loss,liger_flex" --profile "$A:1+offload:3+loss,$A:0..1/3..4+offload:3+loss" --out $OUT/train_step_long.json 2>&1 | tee $OUT/train_step_long.txt | grep -v "^speed-up\|^top" | tail -16
grep "^speed-up" $OUT/train_step_long.txt | grep -E "/ liger_flex$"
echo "long done at $(( $(date +%s) - t0 )) s"
timeout $(( 560 - ($(date +%s) - t0) )) python3 -m pytest tests/gpu/test_fa4.py tests/gpu/test_varlen_cuda.py tests/gpu/test_vision_attention_cuda.py tests/gpu/test_heads_check_cuda.py -q -rs -p no:cacheprovider 2>&1 | tee $OUT/gpu_fa4.txt | grep -v Warning | tail -4
echo "call took $(( $(date +%s) - t0 )) s"; date
