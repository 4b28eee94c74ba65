# call K, fresh machine (carry .h28/whl: liger-kernel; no FA4, as section 12's MoE rows): the Qwen3-30B-A3B-shaped
# MoE step and the gpt-oss-20b-shaped step with the loss inside the head and kept attention, beside stock flex packed,
# Liger + flex (MoE) and stock padded (gpt-oss: its loss beside flex packed's)
nvidia-smi -L; date
source bench/results/2026-12-05-issue28-ranges/setup.sh || exit 3
t0=$(date +%s)
T="tfcompat_fused[auto]"
timeout 230 python3 bench/train_step.py --moe --variants "$T@logits,$T@loss,$T@attention+loss,$T@attention+offload+loss,flex_packed,liger_flex" --out $OUT/train_step_moe.json 2>&1 | tee $OUT/train_step_moe.txt | grep -v "^speed-up" | tail -8
grep "^speed-up" $OUT/train_step_moe.txt | grep -E "/ liger_flex$|/ flex_packed$"
echo "moe done at $(( $(date +%s) - t0 )) s"
timeout $(( 440 - ($(date +%s) - t0) )) python3 bench/train_step.py --family gpt_oss --variants "$T@loss,$T@attention+loss,$T@attention+offload+loss,padded,flex_packed" --out $OUT/train_step_gpt_oss.json 2>&1 | tee $OUT/train_step_gpt_oss.txt | grep -v "^speed-up" | tail -7
grep "^speed-up" $OUT/train_step_gpt_oss.txt | grep -E "/ flex_packed$"
echo "call took $(( $(date +%s) - t0 )) s"; date
