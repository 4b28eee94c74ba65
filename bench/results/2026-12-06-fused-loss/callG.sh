# call G, fresh machine (carry .h28/whl: liger-kernel): Liger's fused kernels against the unfused patch at head dims
# 64, 80, 96 and 128 (after FA4's wrong backward at 80)
source bench/results/2026-12-05-issue28-ranges/setup.sh > /dev/null 2>&1 || exit 3
timeout 75 python3 -m pytest tests/gpu/test_fused_cuda.py -q -rs -p no:cacheprovider 2>&1 | tee $OUT/gpu_fused.txt | grep -v Warning | tail -4
