# call 1 (fresh machine; carry .h28/whl .h28/p1): liger-kernel and FA4's MLIR module unpacked (FA4 needs call 2's
# runtime, so tfcompat's attention is torch's varlen_attn here); the CUDA tests of checkpoint_offload (the lookahead
# fetch, a range policy) and checkpoint_keep; the Qwen2.5-VL-7B-shaped step with images
D=bench/results/2026-12-05-issue28-ranges
nvidia-smi -L; date; free -g | head -2
source $D/setup.sh || exit 3
t0=$(date +%s)
timeout 110 python3 -m pytest tests/gpu/test_checkpoint_offload_cuda.py tests/gpu/test_checkpoint_keep_cuda.py -q -rs -s -p no:cacheprovider 2>&1 | tee $OUT/call1_gpu_tests.txt | grep -v Warning | tail -6
T="tfcompat_fused[auto]"
timeout 250 python3 bench/vl_step.py --variants "$T,$T@logits,padded,liger_padded" --out $OUT/call1_vl_step.json 2>&1 | tee $OUT/call1_vl_step.txt | tail -12
echo "call took $(( $(date +%s) - t0 )) s"; date
