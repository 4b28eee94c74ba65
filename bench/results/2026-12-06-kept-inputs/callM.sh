# call M, fresh machine (carry .h28/whl): the kept-output and offload CUDA tests again on the final code (an input
# written in place by the kept module is held)
source bench/results/2026-12-05-issue28-ranges/setup.sh >/dev/null 2>&1; timeout 100 python3 -m pytest tests/gpu/test_checkpoint_keep_cuda.py tests/gpu/test_checkpoint_offload_cuda.py -q -rs -p no:cacheprovider 2>&1 | tee $OUT/gpu_keep_final.txt | tail -2
