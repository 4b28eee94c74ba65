# the one call (fresh machine; carry .h28/whl): liger-kernel, no FA4 (its cu13 runtime did not travel: the device
# time of this session went to failed starts), so tfcompat's attention is torch's varlen_attn. The CUDA tests of
# checkpoint_offload (the lookahead fetch, a range policy) and checkpoint_keep; 28 layers, 8 sequences of 512-4,096
# (19,679 tokens): full checkpointing, attention kept with the first N layers offloaded, the MLP's input projections
# kept in ranges of layers, Liger + flex; the Qwen2.5-VL-7B-shaped step with images
D=bench/results/2026-12-05-issue28-ranges
nvidia-smi -L; date; free -g | head -2
source $D/setup.sh || exit 3
t0=$(date +%s)
timeout 90 python3 -m pytest tests/gpu/test_checkpoint_offload_cuda.py tests/gpu/test_checkpoint_keep_cuda.py -q -rs -s -p no:cacheprovider 2>&1 | tee $OUT/gpu_tests.txt | grep -v Warning | tail -5
T="tfcompat_fused[auto]"
timeout $(( 300 - ($(date +%s) - t0) )) python3 bench/train_step.py --variants "$T@logits,$T@attention+offload:18+logits,$T@attention+mlp_in:2+offload:26+logits,$T@attention+mlp_in:1..17..2+offload:18+logits,liger_flex" --out $OUT/train_step.json 2>&1 | tee $OUT/train_step.txt | grep -v "^speed-up" | tail -10
grep "^speed-up" $OUT/train_step.txt | grep -E "/ liger_flex$"
echo "28 layers done at $(( $(date +%s) - t0 )) s"
timeout $(( 400 - ($(date +%s) - t0) )) python3 bench/vl_step.py --variants "$T,$T@logits,padded,liger_padded" --out $OUT/vl_step.json 2>&1 | tee $OUT/vl_step.txt | tail -11
echo "call took $(( $(date +%s) - t0 )) s"; date
