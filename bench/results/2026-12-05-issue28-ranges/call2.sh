# call 2 (warm after call 1; carry .h28/p2): FA4 complete. 28 layers, 8 sequences of 512-4,096 (19,679 tokens):
# full checkpointing, attention kept in every layer with the first N offloaded, the MLP's input projections kept in
# ranges of layers (offloaded), Liger + flex; then long context (4 layers, 70,703 tokens) at Liger's memory
D=bench/results/2026-12-05-issue28-ranges
date
source $D/setup.sh || exit 3
t0=$(date +%s)
T="tfcompat_fused[auto]"
timeout 290 python3 bench/train_step.py --variants "$T@logits,$T@attention+offload:18+logits,$T@attention+mlp_in:2+offload:26+logits,$T@attention+mlp_in:1..17..2+offload:18+logits,$T@attention+mlp_in:0..24..3+offload:24+logits,liger_flex" --out $OUT/call2_train_step.json 2>&1 | tee $OUT/call2_train_step.txt | grep -v "^speed-up" | tail -10
grep "^speed-up" $OUT/call2_train_step.txt | grep -E "/ liger_flex$"
echo "28 layers took $(( $(date +%s) - t0 )) s"; free -g | head -2
timeout $(( 500 - ($(date +%s) - t0) )) python3 bench/train_step.py --long --variants "$T,$T@attention+offload,$T@attention+mlp_in:0..1+offload,$T@attention+mlp_in:0..2+offload,liger_flex" --out $OUT/call2_train_step_long.json 2>&1 | tee $OUT/call2_train_step_long.txt | grep -v "^speed-up" | tail -9
grep "^speed-up" $OUT/call2_train_step_long.txt | grep -E "/ liger_flex$"
echo "all took $(( $(date +%s) - t0 )) s"; date
