# call A (carry .h28/whl and .h28/p1): the CUDA tests of kept modules and offload on the final code of stop 37
# (View refactor, the RNG restore on the CUDA generator: new test), without FA4's runtime
date
source bench/results/2026-12-05-issue28-ranges/setup.sh || exit 3
python3 -m pytest tests/gpu/test_checkpoint_keep_cuda.py tests/gpu/test_checkpoint_offload_cuda.py -q -rs -p no:cacheprovider 2>&1 | tee $OUT/gpu_keep.txt | grep -v Warning | tail -5
date
