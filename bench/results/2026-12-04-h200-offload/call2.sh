# call 2 (warm after call 1): FA4 (cu13 part 2) + liger; 28 layers, 8 sequences of 512-4,096 (19,679 tokens): full
# checkpointing, kept outputs, kept outputs offloaded (all / the first N layers keeping a module), Liger + flex; then
# the two variants with the most pinned host memory (own process: a host out-of-memory loses only them); then --long
date
source .h28/setup.sh || exit 3
cd .h28/code
t0=$(date +%s)
T="tfcompat_fused[auto]"
timeout 400 python3 bench/train_step.py --variants "$T@logits,$T@attention+mlp_in:4+logits,$T@attention+offload+logits,$T@attention+mlp_in:4+offload+logits,$T@attention+mlp_in:4+offload:24+logits,$T@attention+mlp_in:8+offload:20+logits,$T@attention+mlp_in+offload:20+logits,liger_flex,liger_flex@attention+mlp_in:4" --out $OUT/call2_train_step.json 2>&1 | tee $OUT/call2_train_step.txt | grep -v "^speed-up" | tail -13
grep "^speed-up" $OUT/call2_train_step.txt | grep -E "/ liger_flex$"
echo "bench took $(( $(date +%s) - t0 )) s"; free -g | head -2
timeout $(( 490 - ($(date +%s) - t0) )) python3 bench/train_step.py --variants "$T@attention+mlp_in+offload+logits,$T@attention+mlp+offload:12+logits" --out $OUT/call2_train_step_more.json 2>&1 | tee $OUT/call2_train_step_more.txt | grep -v "^speed-up" | tail -4
echo "more took $(( $(date +%s) - t0 )) s"; free -g | head -2
timeout $(( 575 - ($(date +%s) - t0) )) python3 bench/train_step.py --long --variants "$T@logits,$T@attention+mlp_in+logits,$T@attention+mlp_in+offload:2+logits,$T@attention+mlp_in+offload+logits,liger_flex" --out $OUT/call2_train_step_long.json 2>&1 | tee $OUT/call2_train_step_long.txt | grep -v "^speed-up" | tail -7
grep "^speed-up" $OUT/call2_train_step_long.txt | grep -E "/ liger_flex$"
date
