# call F, right after call E (carry .h28/whl and .h28/p2: FA4's runtime): the head-dim rule on FA4 (auto right at
# every head dim, an explicit flash right or refused), the routed tower's CUDA tests, FA4's
date
source bench/results/2026-12-05-issue28-ranges/setup.sh || exit 3
t0=$(date +%s)
timeout 330 python3 -m pytest tests/gpu/test_fa4.py tests/gpu/test_vision_attention_cuda.py -q -rs -p no:cacheprovider 2>&1 | tee $OUT/gpu_fa4.txt | grep -v Warning | tail -8
echo "call took $(( $(date +%s) - t0 )) s"; date
