# call 3 (warm after call 2, nothing carried but the tree): a Qwen2.5-VL-7B-shaped step with images (28 + 32
# layers) against stock padded and Liger + padded; then the MoE stack (Qwen3-30B-A3B-shaped, 4 layers)
D=bench/results/2026-12-05-issue28-ranges
date
source $D/setup.sh || exit 3
t0=$(date +%s)
T="tfcompat_fused[auto]"
timeout 330 python3 bench/vl_step.py --variants "$T,$T@logits,$T@attention+offload:18+logits,padded,liger_padded" --out $OUT/call3_vl_step.json 2>&1 | tee $OUT/call3_vl_step.txt | tail -14
echo "vl took $(( $(date +%s) - t0 )) s"
timeout $(( 570 - ($(date +%s) - t0) )) python3 bench/train_step.py --moe --variants "$T,$T@logits,$T@attention+logits,flex_packed,liger_flex" --out $OUT/call3_train_step_moe.json 2>&1 | tee $OUT/call3_train_step_moe.txt | grep -v "^speed-up" | tail -9
grep "^speed-up" $OUT/call3_train_step_moe.txt | grep -E "/ (liger_flex|flex_packed)$"
echo "all took $(( $(date +%s) - t0 )) s"; date
