# call B, right after call A on the same machine (carry .h28/whl and .h28/p2: FA4's runtime): FA4 importable, so
# `auto` runs flash-attn 4's varlen kernels. 28 layers (19,679 tokens) and long context (4 layers, 70,703 tokens):
# the head keeping its logits (`@logits`) against the loss inside the head (`@loss`), kept-output policies that the
# freed memory allows, Liger + flex; then FA4's CUDA tests and the routed vision tower's
D=bench/results/2026-12-06-fused-loss
date
source bench/results/2026-12-05-issue28-ranges/setup.sh || exit 3
t0=$(date +%s)
T="tfcompat_fused[auto]"
timeout 300 python3 bench/train_step.py --variants "$T@logits,$T@loss,$T@attention+offload+loss,$T@attention+offload:14+loss,$T@attention+mlp_in:2+offload:26+loss,$T@attention+mlp_in:4+offload:24+loss,liger_flex" --out $OUT/train_step.json 2>&1 | tee $OUT/train_step.txt | grep -v "^speed-up" | tail -10
grep "^speed-up" $OUT/train_step.txt | grep -E "/ liger_flex$"
echo "28 layers done at $(( $(date +%s) - t0 )) s"
timeout $(( 470 - ($(date +%s) - t0) )) python3 bench/train_step.py --long --variants "$T@logits,$T@loss,$T@attention+loss,$T@attention+offload:2+loss,$T@attention+mlp_in:1+offload:3+loss,liger_flex" --out $OUT/train_step_long.json 2>&1 | tee $OUT/train_step_long.txt | grep -v "^speed-up" | tail -9
grep "^speed-up" $OUT/train_step_long.txt | grep -E "/ liger_flex$"
echo "long done at $(( $(date +%s) - t0 )) s"
timeout $(( 575 - ($(date +%s) - t0) )) python3 -m pytest tests/gpu/test_fa4.py tests/gpu/test_vision_attention_cuda.py -q -rs -p no:cacheprovider 2>&1 | tee $OUT/gpu_fa4.txt | grep -v Warning | tail -5
echo "call took $(( $(date +%s) - t0 )) s"; date
