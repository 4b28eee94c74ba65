# call 3, fresh machine (carry .h28/whl and .h28/p1: FA4's MLIR module, unpacked to /tmp/fa4site; flash-attn stays
# hidden without its runtime): the softcap cases of the attention-features CUDA tests (call 2 stopped at its first
# failure there: flex's softcap dk, against a bound the test now states); the device time left allowed no more
nvidia-smi -L; date
source bench/results/2026-12-05-issue28-ranges/setup.sh || exit 3  # liger-kernel, FA4's parts as they travel
t0=$(date +%s)
timeout 60 python3 -m pytest tests/gpu/test_attention_features_cuda.py -k softcap -q -rs -p no:cacheprovider 2>&1 | tee $OUT/gpu_all.txt | grep -v Warning | tail -4
echo "call took $(( $(date +%s) - t0 )) s"; date
