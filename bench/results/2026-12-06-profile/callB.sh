# call B, right after call A on the same warm machine (carry .h28/whl and .h28/p2: FA4's runtime): where the step's
# time goes now, per kernel and per stream (compute-stream idle time), for the best policy at Liger's memory, full
# checkpointing and Liger + flex; 28 layers and long context
date
source bench/results/2026-12-05-issue28-ranges/setup.sh || exit 3
t0=$(date +%s)
T="tfcompat_fused[auto]"
timeout 300 python3 bench/train_step.py --variants "$T@loss,$T@attention+mlp_in:7+offload:24+loss,liger_flex" --profile --out $OUT/train_step.json 2>&1 | tee $OUT/train_step.txt | grep -v "^speed-up" | tail -14
echo "28 layers done at $(( $(date +%s) - t0 )) s"
timeout $(( 560 - ($(date +%s) - t0) )) python3 bench/train_step.py --long --variants "$T@attention+mlp_in:1+offload:3+loss,$T@attention+mlp_in:1+offload:2+loss,liger_flex" --profile --out $OUT/train_step_long.json 2>&1 | tee $OUT/train_step_long.txt | grep -v "^speed-up" | tail -14
echo "call took $(( $(date +%s) - t0 )) s"; date
