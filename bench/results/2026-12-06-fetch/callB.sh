# call B, right after call A (carry .h28/whl and .h28/p2: FA4's runtime): long context with the next layers' copies
# fetched after each layer's MLP backward (checkpoint_fetch="attention") against at the recompute, by phase;
# 28 layers the same; against Liger + flex; then the GPU tests that need FA4's runtime
date
source bench/results/2026-12-05-issue28-ranges/setup.sh || exit 3
t0=$(date +%s)
T="tfcompat_fused[auto]"; A="$T@attention+mlp_in"; F="+fetch:attention"
timeout 240 python3 bench/train_step.py --long --variants "$A:2..4+offload:3+loss,$A:2..4+offload:3$F+loss,$A:0..1/2..4+offload:3$F+loss,$A:1..4+offload:3$F+loss,$A:0..4+offload:3$F+loss,liger_flex" --memory --out $OUT/train_step_long.json 2>&1 | tee $OUT/train_step_long.txt | grep -v "^speed-up\|^top\|^memory" | tail -10
grep "^speed-up" $OUT/train_step_long.txt | grep -E "/ liger_flex$"
grep "^memory" $OUT/train_step_long.txt | cut -c1-600
echo "long done at $(( $(date +%s) - t0 )) s"
timeout 200 python3 bench/train_step.py --variants "$A:2..24..3/24..28+offload:24+loss,$A:2..24..3/24..28+offload:24$F+loss,liger_flex" --out $OUT/train_step_28.json 2>&1 | tee $OUT/train_step_28.txt | grep -v "^speed-up\|^top\|^memory" | tail -6
grep "^speed-up" $OUT/train_step_28.txt | grep -E "/ liger_flex$"
echo "28 done at $(( $(date +%s) - t0 )) s"
timeout $(( 570 - ($(date +%s) - t0) )) python3 -m pytest tests/gpu/test_fa4.py tests/gpu/test_varlen_cuda.py tests/gpu/test_vision_attention_cuda.py tests/gpu/test_heads_check_cuda.py -q -rs -p no:cacheprovider 2>&1 | tee $OUT/gpu_fa4.txt | grep -v Warning | grep -v "^SKIPPED" | tail -4
echo "call took $(( $(date +%s) - t0 )) s"; date
