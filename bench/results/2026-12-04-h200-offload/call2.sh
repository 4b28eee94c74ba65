# call 2 (warm after call 1): FA4 (cu13 part 2) + liger; 28 layers, 8 sequences of 512-4,096 (19,679 tokens): full
# checkpointing, kept outputs, kept outputs offloaded (all / the first N layers keeping a module), Liger + flex
date
source .h28/setup.sh || exit 3
cd .h28/code
grep -q '"pinned_max_round_threshold_mb": true' /tmp/h28_link.json && export PYTORCH_ALLOC_CONF=pinned_max_round_threshold_mb:64
echo "PYTORCH_ALLOC_CONF=${PYTORCH_ALLOC_CONF:-}"
t0=$(date +%s)
T="tfcompat_fused[auto]"
timeout 545 python3 bench/train_step.py --variants "$T@logits,$T@attention+mlp_in:4+logits,$T@attention+mlp_in:4+offload+logits,$T@attention+mlp_in:4+offload:20+logits,$T@attention+mlp_in:14+offload:14+logits,$T@attention+mlp_in+offload:20+logits,$T@attention+mlp_in+offload+logits,$T@attention+mlp+offload:20+logits,liger_flex,liger_flex@attention+mlp_in:4" --out $OUT/call2_train_step.json 2>&1 | tee $OUT/call2_train_step.txt | grep -v "^speed-up" | tail -16
grep "^speed-up" $OUT/call2_train_step.txt | grep -E "/ liger_flex$"
echo "bench took $(( $(date +%s) - t0 )) s"; date; free -g | head -2
