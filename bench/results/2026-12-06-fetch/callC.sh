# call C (fresh machine; carry .h28/whl and .h28/p1): the offload GPU tests with checkpoint_fetch "mlp_in" and
# "attention" (the fetch hook holding the stash alone), peaks printed
date; nvidia-smi --query-gpu=name --format=csv,noheader
source bench/results/2026-12-05-issue28-ranges/setup.sh >/dev/null 2>&1 || exit 3
timeout 150 python3 -m pytest tests/gpu/test_checkpoint_offload_cuda.py -q -rs -s -p no:cacheprovider 2>&1 | tee $OUT/gpu_offload.txt | grep -E "peak GiB|passed|failed|Error" | tail -10
date
