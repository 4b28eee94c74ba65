# call C (carry .h28/whl and .h28/p1): the fused tests with Liger's real kernels, the new two-node SwiGLU down
# projection among them, and the kept-module tests (fused kernels on)
date
source bench/results/2026-12-05-issue28-ranges/setup.sh || exit 3
t0=$(date +%s)
timeout 300 python3 -m pytest tests/gpu/test_fused_cuda.py tests/gpu/test_checkpoint_keep_cuda.py -q -rs -p no:cacheprovider 2>&1 | tee $OUT/gpu_fused.txt | grep -v Warning | tail -15
echo "call took $(( $(date +%s) - t0 )) s"; date
