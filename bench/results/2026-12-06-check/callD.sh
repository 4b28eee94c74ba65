# call D (fresh machine; carry .h28/whl, no FA4 runtime: the MoE stack's attention is sdpa): the Qwen3-30B-A3B-shaped
# MoE step against Liger + flex, whose fused MoE kernels (liger-kernel 0.8.5's LigerFusedMoEFunction, Triton grouped
# GEMMs) autotune on their first call: Liger's variant first and alone in its process, with the call's whole time
date
source bench/results/2026-12-05-issue28-ranges/setup.sh >/dev/null 2>&1
t0=$(date +%s)
T="tfcompat_fused[auto]"
timeout 420 python3 bench/train_step.py --moe --variants "liger_flex" --out $OUT/train_step_moe_liger.json 2>&1 | tee $OUT/train_step_moe_liger.txt | grep -v "^speed-up\|^top\|Backend impl" | tail -4
echo "liger done at $(( $(date +%s) - t0 )) s"
timeout $(( 570 - ($(date +%s) - t0) )) python3 bench/train_step.py --moe --variants "$T@attention+loss,$T@logits" --out $OUT/train_step_moe.json 2>&1 | tee $OUT/train_step_moe.txt | grep -v "^speed-up\|^top" | tail -4
echo "call took $(( $(date +%s) - t0 )) s"; date
