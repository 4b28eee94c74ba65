# call A, fresh machine (carry .h28/whl and .h28/p1: liger-kernel, FA4's MLIR module; flash-attn stays hidden without
# its runtime): every CUDA test (tests/gpu), the heads' tests compiled on CUDA (fused_loss included), the heads side
# by side (tfcompat's triton head recomputing / keeping logits / the fused loss, Liger's FLCE per token and mean)
D=bench/results/2026-12-06-fused-loss
nvidia-smi -L; date; free -g | head -2
source bench/results/2026-12-05-issue28-ranges/setup.sh || exit 3
t0=$(date +%s)
timeout 360 python3 -m pytest tests/gpu -q -rs -p no:cacheprovider 2>&1 | tee $OUT/gpu_all.txt | grep -v Warning | tail -14
echo "tests/gpu done at $(( $(date +%s) - t0 )) s"
timeout 90 python3 -m pytest tests/test_heads_triton.py tests/test_fused_loss.py -q -rs -p no:cacheprovider 2>&1 | tee $OUT/heads_cuda.txt | tail -4
echo "heads tests done at $(( $(date +%s) - t0 )) s"
timeout $(( 560 - ($(date +%s) - t0) )) python3 bench/heads.py --tokens 8191 20205 70703 --variants triton triton-keep triton-loss liger liger-mean --out $OUT/heads.json 2>&1 | tee $OUT/heads.txt | tail -24
echo "call took $(( $(date +%s) - t0 )) s"; date
