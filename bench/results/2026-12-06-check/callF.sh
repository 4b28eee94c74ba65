# call F (fresh machine; carry .h28/whl, no FA4 runtime: the MoE stack's attention is sdpa): the new fused "experts"
# kernel (Liger's LigerFusedMoEFunction through fused="auto") on CUDA against the fp32 model, then the
# Qwen3-30B-A3B-shaped MoE step against Liger + flex in one process (Liger's MoE kernels autotune once, in the first
# variant's warm-up, for both)
date
source bench/results/2026-12-05-issue28-ranges/setup.sh >/dev/null 2>&1
t0=$(date +%s)
timeout 150 python3 -m pytest tests/gpu/test_fused_cuda.py -q -rs -p no:cacheprovider 2>&1 | tee $OUT/gpu_fused.txt | grep -v Warning | tail -3
echo "tests done at $(( $(date +%s) - t0 )) s"
T="tfcompat_fused[auto]"
timeout $(( 440 - ($(date +%s) - t0) )) python3 bench/train_step.py --moe --variants "$T@attention+loss,liger_flex" --profile "$T@attention+loss" --out $OUT/train_step_moe.json 2>&1 | tee $OUT/train_step_moe.txt | grep -v "^speed-up\|^top\|Backend impl" | tail -12
echo "call took $(( $(date +%s) - t0 )) s"; date
