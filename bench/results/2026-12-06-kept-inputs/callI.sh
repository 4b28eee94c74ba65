# call I, right after call H on the same machine (carry .h28/whl and .h28/p2: FA4's runtime): the 28-layer and
# long-context steps with the kept modules' inputs recomputed (less kept, fewer bytes over the host link), the
# policies that now fit Liger's memory; then FA4's CUDA tests (the head-dim rule's message, not re-run last stop)
date
source bench/results/2026-12-05-issue28-ranges/setup.sh || exit 3
t0=$(date +%s)
T="tfcompat_fused[auto]"
timeout 280 python3 bench/train_step.py --variants "$T@loss,$T@attention+mlp_in:4+offload:24+loss,$T@attention+mlp_in:6+offload:22+loss,$T@attention+mlp_in:8+offload:20+loss,$T@attention+mlp_in:6+offload:24+loss,liger_flex" --out $OUT/train_step.json 2>&1 | tee $OUT/train_step.txt | grep -v "^speed-up" | tail -9
grep "^speed-up" $OUT/train_step.txt | grep -E "/ liger_flex$"
echo "28 layers done at $(( $(date +%s) - t0 )) s"
timeout $(( 480 - ($(date +%s) - t0) )) python3 bench/train_step.py --long --variants "$T@loss,$T@attention+loss,$T@attention+offload:2+loss,$T@attention+mlp_in:1+offload:3+loss,$T@attention+mlp_in:1+offload:2+loss,liger_flex" --out $OUT/train_step_long.json 2>&1 | tee $OUT/train_step_long.txt | grep -v "^speed-up" | tail -9
grep "^speed-up" $OUT/train_step_long.txt | grep -E "/ liger_flex$"
echo "long done at $(( $(date +%s) - t0 )) s"
timeout $(( 580 - ($(date +%s) - t0) )) python3 -m pytest tests/gpu/test_fa4.py tests/gpu/test_vision_attention_cuda.py -q -rs -p no:cacheprovider 2>&1 | tee $OUT/gpu_fa4.txt | grep -v Warning | tail -5
echo "call took $(( $(date +%s) - t0 )) s"; date
