# call L, right after call K on the same machine (carry .h28/whl): the MoE step again with Liger + flex alone last
# (call K's ran out of its time budget before it); this one too: Liger's variant did not finish within 240 s
source bench/results/2026-12-05-issue28-ranges/setup.sh >/dev/null 2>&1; T="tfcompat_fused[auto]"; timeout 240 python3 bench/train_step.py --moe --variants "$T@attention+loss,$T@loss,liger_flex" --out $OUT/train_step_moe.json 2>&1 | tee $OUT/train_step_moe.txt | grep -v "^speed-up" | tail -5
