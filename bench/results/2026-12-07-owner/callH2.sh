# call H2, right after call G on the same warm machine (carry .h28/wB and .h28/p2: FA4's wheels and runtime): the
# long-context step with FA4 as in section 24, fetch_owner_stream.patch applied, against Liger + flex in one run
nvidia-smi --query-gpu=name --format=csv,noheader; date
source bench/results/2026-12-05-issue28-ranges/setup.sh > /tmp/setup.txt 2>&1 || { cat /tmp/setup.txt; exit 3; }
tail -2 /tmp/setup.txt; t0=$(date +%s)
git apply bench/results/2026-12-06-parts/fetch_owner_stream.patch || exit 4
T="tfcompat_fused[auto]"; A="$T@attention+mlp_in"; F="+fetch:mlp_in"
timeout 300 python3 bench/train_step.py --long --variants "$A:0..4+offload:3$F+loss,$A:0..4+offload:3+loss,liger_flex" --memory --out $OUT/long_fa4_patched.json 2>&1 | tee $OUT/long_fa4_patched.txt | grep -E "ms/step|^memory" | cut -c1-900
grep "^speed-up" $OUT/long_fa4_patched.txt | grep -E "/ liger_flex$"
git apply -R bench/results/2026-12-06-parts/fetch_owner_stream.patch
echo "call took $(( $(date +%s) - t0 )) s"; date
