# call H, fresh machine (carry .h28/whl and .h28/p1: FA4's MLIR module; the runtime comes in call I): the CUDA
# tests of kept outputs (a kept module's input now comes back from the recompute), offload under the real streams,
# and Liger's fused kernels at head dims 64-128 (added in the last stop, never run)
nvidia-smi -L; date
source bench/results/2026-12-05-issue28-ranges/setup.sh || exit 3
t0=$(date +%s)
timeout 300 python3 -m pytest tests/gpu/test_checkpoint_keep_cuda.py tests/gpu/test_checkpoint_offload_cuda.py tests/gpu/test_fused_cuda.py -q -rs -p no:cacheprovider 2>&1 | tee $OUT/gpu_keep_fused.txt | grep -v Warning | tail -8
echo "call took $(( $(date +%s) - t0 )) s"; date
