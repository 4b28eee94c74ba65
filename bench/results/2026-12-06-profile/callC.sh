# call C (fresh machine; carry .h28/whl and .h28/p1): the GPU tests without FA4's runtime (this stop's code)
date
source bench/results/2026-12-05-issue28-ranges/setup.sh || exit 3
timeout 420 python3 -m pytest tests/gpu -q -rs -p no:cacheprovider -x 2>&1 | tee $OUT/gpu_tests.txt | grep -v Warning | tail -4
date
