# call A (carry .h28/whl and .h28/p1): tests/gpu without FA4's runtime, the fetch in two parts among them
date
source bench/results/2026-12-05-issue28-ranges/setup.sh >/dev/null 2>&1 || exit 3
t0=$(date +%s)
timeout 120 python3 -m pytest tests/gpu/test_checkpoint_offload_cuda.py -q -rs -s -p no:cacheprovider 2>&1 | tee $OUT/gpu_offload.txt | grep -E "peak GiB|passed|failed|Error" | tail -12
timeout $(( 560 - ($(date +%s) - t0) )) python3 -m pytest tests/gpu -q -rs -p no:cacheprovider 2>&1 | tee $OUT/gpu_tests.txt | grep -v Warning | grep -v "^SKIPPED" | tail -6
echo "call took $(( $(date +%s) - t0 )) s"; date
