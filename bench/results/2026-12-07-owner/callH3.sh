# call H3, right after call H2 (carry .h28/wC: tilelang and z3): the linear-attention CUDA tests with fla's gated
# backward through tilelang, and the heads' check, on the H200
source bench/results/2026-12-05-issue28-ranges/setup.sh > /tmp/setup.txt 2>&1; tail -1 /tmp/setup.txt; timeout 180 python3 -m pytest tests/gpu/test_linear_attention_cuda.py tests/gpu/test_heads_check_cuda.py -q -rs -p no:cacheprovider 2>&1 | tee $OUT/gpu_linear_h200.txt | grep -v Warning | tail -5
