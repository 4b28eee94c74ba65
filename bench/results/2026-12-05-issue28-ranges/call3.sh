# call 3 (warm after call 2, nothing carried but the tree): long context (4 layers, 70,703 tokens) at Liger's memory,
# then the MoE stack (Qwen3-30B-A3B-shaped, 4 layers) against Liger + flex
D=bench/results/2026-12-05-issue28-ranges
date
source $D/setup.sh || exit 3
t0=$(date +%s)
T="tfcompat_fused[auto]"
timeout 330 python3 bench/train_step.py --long --variants "$T,$T@logits,$T@attention+offload,$T@attention+mlp_in:0..1+offload,$T@attention+mlp_in:0..3..2+offload,$T@attention+mlp_in:0..2+offload,liger_flex" --out $OUT/call3_train_step_long.json 2>&1 | tee $OUT/call3_train_step_long.txt | grep -v "^speed-up" | tail -11
grep "^speed-up" $OUT/call3_train_step_long.txt | grep -E "/ liger_flex$"
echo "long took $(( $(date +%s) - t0 )) s"
timeout $(( 570 - ($(date +%s) - t0) )) python3 bench/train_step.py --moe --variants "$T,$T@logits,$T@attention+logits,flex_packed,liger_flex" --out $OUT/call3_train_step_moe.json 2>&1 | tee $OUT/call3_train_step_moe.txt | grep -v "^speed-up" | tail -9
grep "^speed-up" $OUT/call3_train_step_moe.txt | grep -E "/ (liger_flex|flex_packed)$"
echo "all took $(( $(date +%s) - t0 )) s"; date
