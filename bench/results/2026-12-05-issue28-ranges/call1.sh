# call 1 (fresh machine; carry .h28/whl .h28/p1): liger-kernel and FA4's MLIR module unpacked (FA4 needs call 2's
# runtime); the CUDA tests of checkpoint_offload (the lookahead fetch, a range policy) and checkpoint_keep
D=bench/results/2026-12-05-issue28-ranges
nvidia-smi -L; date; free -g | head -2
source $D/setup.sh || exit 3
timeout 200 python3 -m pytest tests/gpu/test_checkpoint_offload_cuda.py tests/gpu/test_checkpoint_keep_cuda.py -q -rs -s -p no:cacheprovider 2>&1 | tee $OUT/call1_gpu_tests.txt | grep -v Warning | tail -8
date
