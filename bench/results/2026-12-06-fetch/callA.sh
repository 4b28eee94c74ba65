# call A (carry .h28/whl and .h28/p1: liger-kernel, FA4 not yet runnable): every GPU test, among them the offload
# tests with checkpoint_fetch="attention" and the fused SwiGLU down projection's fixed fp32 bound
date; nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
source bench/results/2026-12-05-issue28-ranges/setup.sh || exit 3
t0=$(date +%s)
timeout 150 python3 -m pytest tests/gpu/test_checkpoint_offload_cuda.py -q -rs -s -p no:cacheprovider 2>&1 | tee $OUT/gpu_offload.txt | grep -E "peak GiB|passed|failed|Error" | tail -8
timeout 330 python3 -m pytest tests/gpu -q -rs -p no:cacheprovider --deselect tests/gpu/test_checkpoint_offload_cuda.py 2>&1 | tee $OUT/gpu_tests.txt | grep -v Warning | grep -v "^SKIPPED" | tail -6
echo "call took $(( $(date +%s) - t0 )) s"; date
