# one call (fresh machine; carry .h28/whl): liger-kernel, no FA4 (its cu13 runtime needs a second call on the same
# machine), so tfcompat's text attention is per-sequence SDPA / varlen_attn by `auto`, the routed tower's varlen_attn.
# The CUDA tests of vision_attention, checkpoint_offload and checkpoint_keep; the Qwen2.5-VL-7B-shaped step with
# images, with and without vision_attention; long context (4 layers, 70,703 tokens) with attention offloaded
D=bench/results/2026-12-06-vision-attention
nvidia-smi -L; date; free -g | head -2
source bench/results/2026-12-05-issue28-ranges/setup.sh || exit 3  # liger-kernel (and FA4 where its runtime travelled) from the carried wheels
t0=$(date +%s)
timeout 150 python3 -m pytest tests/gpu/test_vision_attention_cuda.py tests/gpu/test_checkpoint_offload_cuda.py tests/gpu/test_checkpoint_keep_cuda.py -q -rs -p no:cacheprovider 2>&1 | tee $OUT/gpu_tests.txt | grep -v Warning | tail -6
echo "tests done at $(( $(date +%s) - t0 )) s"
T="tfcompat_fused[auto]"
timeout $(( 380 - ($(date +%s) - t0) )) python3 bench/vl_step.py --variants "$T@logits,$T@vision+logits,padded,liger_padded" --out $OUT/vl_step.json 2>&1 | tee $OUT/vl_step.txt | tail -12
echo "vl done at $(( $(date +%s) - t0 )) s"
timeout $(( 560 - ($(date +%s) - t0) )) python3 bench/train_step.py --long --variants "$T,$T@attention+offload,$T@attention+mlp_in:0..2+offload,$T@logits,$T@attention+offload+logits,liger_flex" --out $OUT/train_step_long.json 2>&1 | tee $OUT/train_step_long.txt | grep -v "^speed-up" | tail -10
grep "^speed-up" $OUT/train_step_long.txt | grep -E "/ liger_flex$"
echo "call took $(( $(date +%s) - t0 )) s"; date
