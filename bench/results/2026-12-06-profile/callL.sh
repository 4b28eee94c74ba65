# call L, right after call K (carry .h28/whl and .h28/p2): offload copies in 64 MiB pieces, tried and reverted
# (the heads' input check then waited 26.7 ms instead of 11-15: the copy engine runs the pieces queued before it)
date
source bench/results/2026-12-05-issue28-ranges/setup.sh || exit 3
t0=$(date +%s)
timeout 60 python3 -m pytest tests/gpu/test_checkpoint_offload_cuda.py -q -p no:cacheprovider 2>&1 | tail -1
T="tfcompat_fused[auto]"
A="$T@attention+mlp_in"
timeout 200 python3 bench/train_step.py --variants "$A:2..24..3/24..28+offload:24+loss,$A:3..24..3/24..28+offload:24+loss,liger_flex" --profile "$A:2..24..3/24..28+offload:24+loss" --out $OUT/train_step.json 2>&1 | tee $OUT/train_step.txt | grep -v "^speed-up\|^top" | tail -9
grep "^speed-up" $OUT/train_step.txt | grep -E "/ liger_flex$"
echo "call took $(( $(date +%s) - t0 )) s"; date
