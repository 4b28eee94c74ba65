# call E, right after call D on the same warm machine (carry .h28/whl): the MoE step profiled, stock grouped_mm
# experts (tfcompat) against Liger + flex (its fused MoE kernels)
source bench/results/2026-12-05-issue28-ranges/setup.sh >/dev/null 2>&1; T="tfcompat_fused[auto]"; timeout 400 python3 bench/train_step.py --moe --variants "$T@attention+loss,liger_flex" --profile all --out $OUT/train_step_moe_profile.json 2>&1 | tee $OUT/train_step_moe_profile.txt | grep -v "Backend impl\|^speed-up" | tail -22
