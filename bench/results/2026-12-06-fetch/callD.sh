# call D, right after call C (carry .h28/whl and .h28/p2): long context, the next layers' copies fetched at gate / up's
# gradient (checkpoint_fetch="mlp_in") with "mlp_in" in 2, 3 and 4 layers, against at the recompute and Liger + flex
date
source bench/results/2026-12-05-issue28-ranges/setup.sh >/dev/null 2>&1 || exit 3
t0=$(date +%s)
T="tfcompat_fused[auto]"; A="$T@attention+mlp_in"; F="+fetch:mlp_in"
timeout 300 python3 bench/train_step.py --long --variants "$A:2..4+offload:3+loss,$A:2..4+offload:3$F+loss,$A:1..4+offload:3$F+loss,$A:0..4+offload:3$F+loss,$A:0..4+offload:3+fetch:attention+loss,liger_flex" --memory --out $OUT/train_step_long.json 2>&1 | tee $OUT/train_step_long.txt | grep -v "^speed-up\|^top\|^memory" | tail -10
grep "^speed-up" $OUT/train_step_long.txt | grep -E "/ liger_flex$"
grep "^memory" $OUT/train_step_long.txt | cut -c1-600
echo "call took $(( $(date +%s) - t0 )) s"; date
