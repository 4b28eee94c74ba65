# call B, right after call A (carry .h28/whl and .h28/p2): long context and 28 layers with the next layers' copies
# fetched in two parts at gate's and up's gradients, against at the recompute and Liger + flex; full checkpointing's
# MFU beside them
date
source bench/results/2026-12-05-issue28-ranges/setup.sh >/dev/null 2>&1 || exit 3
t0=$(date +%s)
T="tfcompat_fused[auto]"; A="$T@attention+mlp_in"; F="+fetch:mlp_in"
timeout 250 python3 bench/train_step.py --long --variants "$A:0..4+offload:3$F+loss,$A:0..4+offload:3+loss,$A:1..4+offload:3$F+loss,liger_flex" --memory --out $OUT/train_step_long.json 2>&1 | tee $OUT/train_step_long.txt | grep -v "^speed-up\|^top\|^memory" | tail -8
grep "^speed-up" $OUT/train_step_long.txt | grep -E "/ liger_flex$"
grep "^memory" $OUT/train_step_long.txt | cut -c1-600
echo "long done at $(( $(date +%s) - t0 )) s"
timeout $(( 575 - ($(date +%s) - t0) )) python3 bench/train_step.py --variants "$A:2..24..3/24..28+offload:24+loss,$A:2..24..3/24..28+offload:24$F+loss,$T@loss,liger_flex" --out $OUT/train_step_28.json 2>&1 | tee $OUT/train_step_28.txt | grep -v "^speed-up\|^top\|^memory" | tail -8
grep "^speed-up" $OUT/train_step_28.txt | grep -E "/ liger_flex$"
echo "call took $(( $(date +%s) - t0 )) s"; date
