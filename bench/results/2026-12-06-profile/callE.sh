# call E (fresh machine; carry .h28/whl and .h28/p1): the kept-modules CUDA tests on this stop's code (indices)
date
source bench/results/2026-12-05-issue28-ranges/setup.sh || exit 3
python3 -m pytest tests/gpu/test_checkpoint_keep_cuda.py tests/gpu/test_checkpoint_offload_cuda.py -q -p no:cacheprovider 2>&1 | tail -2
date
