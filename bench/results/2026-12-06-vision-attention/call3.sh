# fresh machine (carry .h28/whl), no FA4: every CUDA test (call 2 stopped at its first failure, flex's softcap dk
# against a bound the test now states), the tower alone (bench/vision_tower.py), then the VL step with the tower routed under the kept-output policies
D=bench/results/2026-12-06-vision-attention
nvidia-smi -L; date
source bench/results/2026-12-05-issue28-ranges/setup.sh || exit 3  # liger-kernel (and FA4 where its runtime travelled) from the carried wheels
t0=$(date +%s)
timeout 240 python3 -m pytest tests/gpu -q -rs -p no:cacheprovider 2>&1 | tee $OUT/gpu_all.txt | grep -v Warning | tail -4
echo "tests done at $(( $(date +%s) - t0 )) s"
timeout 120 python3 bench/vision_tower.py --out $OUT/vision_tower.json 2>&1 | tee $OUT/vision_tower.txt | tail -9
T="tfcompat_fused[auto]"
timeout $(( 540 - ($(date +%s) - t0) )) python3 bench/vl_step.py --variants "$T@vision,$T@vision+logits,$T@vision+attention+offload:18+logits,$T@vision+attention:10..28+logits,liger_padded" --out $OUT/vl_step.json 2>&1 | tee $OUT/vl_step.txt | tail -12
echo "call took $(( $(date +%s) - t0 )) s"; date
