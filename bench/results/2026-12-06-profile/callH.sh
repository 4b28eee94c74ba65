# call H, right after call G on the same warm machine (carry .h28/whl and .h28/p2): "mlp_in" every third offloaded
# layer from other starts and ends, the compute stream's gaps located (forward / backward, copies in flight)
date
source bench/results/2026-12-05-issue28-ranges/setup.sh || exit 3
t0=$(date +%s)
T="tfcompat_fused[auto]"
A="$T@attention+mlp_in"
timeout 560 python3 bench/train_step.py --variants "$A:2..24..3/24..28+offload:24+loss,$A:3..24..3/24..28+offload:24+loss,$A:2..23..3/24..28+offload:24+loss,$A:1..24..3/24..28+offload:24+loss,$A:2..24..3/25..28+offload:25+loss,liger_flex" --profile "$A:2..24..3/24..28+offload:24+loss,$A:2..23..3/24..28+offload:24+loss,$A:2..24..3/25..28+offload:25+loss" --out $OUT/train_step.json 2>&1 | tee $OUT/train_step.txt | grep -v "^speed-up\|^top" | tail -22
grep "^speed-up" $OUT/train_step.txt | grep -E "/ liger_flex$"
echo "call took $(( $(date +%s) - t0 )) s"; date
