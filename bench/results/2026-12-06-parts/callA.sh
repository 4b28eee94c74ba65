# call A (carry .h28/whl and .h28/p1): the offload GPU tests, the fetch in two parts among them
date
source bench/results/2026-12-05-issue28-ranges/setup.sh >/dev/null 2>&1 || exit 3
t0=$(date +%s)
timeout 400 python3 -m pytest tests/gpu/test_checkpoint_offload_cuda.py -q -rs -s -p no:cacheprovider 2>&1 | tee $OUT/gpu_offload.txt | grep -E "peak GiB|passed|failed|Error" | tail -12
echo "call took $(( $(date +%s) - t0 )) s"; date
