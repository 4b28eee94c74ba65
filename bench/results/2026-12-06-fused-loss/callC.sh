# call C, fresh machine (carry .h28/whl and .h28/p1): FA4's MLIR module unpacked; the routed tower alone without FA4
# (bench/vision_tower.py: torch's varlen_attn), while the next call brings FA4's runtime
D=bench/results/2026-12-06-fused-loss
nvidia-smi -L; date
source bench/results/2026-12-05-issue28-ranges/setup.sh || exit 3
t0=$(date +%s)
timeout 150 python3 bench/vision_tower.py --reps 3 --out $OUT/vision_tower.json 2>&1 | tee $OUT/vision_tower.txt | tail -9
echo "call took $(( $(date +%s) - t0 )) s"; date
