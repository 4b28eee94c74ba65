# call H3, right after call H2 (carry .h28/wC: tilelang and its z3): tests/gpu with FA4, Liger-Kernel, fla and
# tilelang, fetch_owner_stream.patch applied (its two-part peak test no longer xfail)
nvidia-smi --query-gpu=name --format=csv,noheader; date
source bench/results/2026-12-05-issue28-ranges/setup.sh > /tmp/setup.txt 2>&1 || { cat /tmp/setup.txt; exit 3; }
tail -2 /tmp/setup.txt; t0=$(date +%s)
git apply bench/results/2026-12-06-parts/fetch_owner_stream.patch || exit 4
timeout 520 python3 -m pytest tests/gpu -q -rs -p no:cacheprovider 2>&1 | tee $OUT/gpu_tests.txt | grep -v Warning | grep -v "^SKIPPED" | tail -8
grep "^SKIPPED" $OUT/gpu_tests.txt | cut -c1-160 | sort | uniq -c | sort -rn | head -12
git apply -R bench/results/2026-12-06-parts/fetch_owner_stream.patch
echo "call took $(( $(date +%s) - t0 )) s"; date
