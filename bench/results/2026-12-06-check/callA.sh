# call A (fresh machine; carry .h28/whl and .h28/p1): the GPU tests without FA4's runtime, among them the new
# tests/gpu/test_heads_check_cuda.py (the heads' input check read through a side stream)
date
source bench/results/2026-12-05-issue28-ranges/setup.sh || exit 3
timeout 120 python3 -m pytest tests/gpu/test_heads_check_cuda.py -q -rs -p no:cacheprovider 2>&1 | tee $OUT/heads_check.txt | grep -v Warning | tail -4
timeout 400 python3 -m pytest tests/gpu -q -rs -p no:cacheprovider 2>&1 | tee $OUT/gpu_tests.txt | grep -v Warning | tail -4
date
