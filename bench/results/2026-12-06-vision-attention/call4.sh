# call 4, right after call 3 on the same machine (carry .h28/whl and .h28/p2: FA4's runtime): FA4 importable, so
# `auto` runs flash-attn's varlen kernels in the text stack and, non-causal, in the routed tower. The CUDA tests of
# the non-causal flash path and of FA4; the tower alone (bench/vision_tower.py)
D=bench/results/2026-12-06-vision-attention
date
source bench/results/2026-12-05-issue28-ranges/setup.sh || exit 3
t0=$(date +%s)
timeout 120 python3 -m pytest tests/gpu/test_vision_attention_cuda.py tests/gpu/test_fa4.py -q -rs -p no:cacheprovider 2>&1 | tee $OUT/gpu_fa4.txt | grep -v Warning | tail -4
echo "tests done at $(( $(date +%s) - t0 )) s"
timeout 90 python3 bench/vision_tower.py --reps 3 --out $OUT/vision_tower.json 2>&1 | tee $OUT/vision_tower.txt | tail -9
echo "call took $(( $(date +%s) - t0 )) s"; date
