# call F, right after call E on the same warm machine (carry .h28/whl and .h28/p2: FA4's runtime): "mlp_in" every
# third offloaded layer from several starts, the last 4 layers' on the GPU; two profiled (compute-stream idle)
date
source bench/results/2026-12-05-issue28-ranges/setup.sh || exit 3
t0=$(date +%s)
T="tfcompat_fused[auto]"
A="$T@attention+mlp_in"
timeout 560 python3 bench/train_step.py --variants "$A:8..24..3/24..28+offload:24+loss,$A:5..24..3/24..28+offload:24+loss,$A:2..24..3/24..28+offload:24+loss,$A:6..24..3/24..28+offload:24+loss,$A:8..24..3/22..28+offload:24+loss,liger_flex" --profile "$A:5..24..3/24..28+offload:24+loss,$A:2..24..3/24..28+offload:24+loss,$A:8..24..3/22..28+offload:24+loss" --out $OUT/train_step.json 2>&1 | tee $OUT/train_step.txt | grep -v "^speed-up\|^top" | tail -18
grep "^speed-up" $OUT/train_step.txt | grep -E "/ liger_flex$"
echo "call took $(( $(date +%s) - t0 )) s"; date
