# call C (carry .h28/whl only: no FA4 runtime, the tfcompat attention is auto's next, per-sequence SDPA / cuDNN), the
# device time left being one call: long context, the fetch at gate / up in two parts against at the recompute and
# Liger + flex (memory and ratios within this call); then the offload GPU tests with what time is left
date
source bench/results/2026-12-05-issue28-ranges/setup.sh 2>&1 | tail -2 || exit 3
t0=$(date +%s)
T="tfcompat_fused[auto]"; A="$T@attention+mlp_in"; F="+fetch:mlp_in"
timeout 100 python3 bench/train_step.py --long --variants "$A:0..4+offload:3$F+loss,$A:0..4+offload:3+loss,liger_flex" --memory --out $OUT/train_step_long.json 2>&1 | tee $OUT/train_step_long.txt | grep -v "^speed-up\|^top\|^memory" | tail -6
grep "^speed-up" $OUT/train_step_long.txt | grep -E "/ liger_flex$"
grep "^memory" $OUT/train_step_long.txt | cut -c1-600
echo "long done at $(( $(date +%s) - t0 )) s"
timeout 30 python3 -m pytest tests/gpu/test_checkpoint_offload_cuda.py -q -rs -s -p no:cacheprovider -k "two_parts or holds_no_more" 2>&1 | tee $OUT/gpu_offload.txt | grep -E "peak GiB|passed|failed|Error" | tail -6
echo "call took $(( $(date +%s) - t0 )) s"; date
