# call H1 (carry .h28/whl and .h28/p1: Liger-Kernel, no FA4 runtime): fetch_owner_stream.patch (the fetched blocks
# without record_stream) against main on one machine: the offload and keep CUDA tests with the patch (the two-part peak test no longer
# xfail) and the long-context step's memory by phase with and without it (the same variant twice, the patch the
# only change; tfcompat's attention without FA4), then tests/gpu with the patch in the time left
nvidia-smi --query-gpu=name --format=csv,noheader; date
source bench/results/2026-12-05-issue28-ranges/setup.sh > /tmp/setup.txt 2>&1 || { cat /tmp/setup.txt; exit 3; }
tail -1 /tmp/setup.txt; t0=$(date +%s)
git apply bench/results/2026-12-06-parts/fetch_owner_stream.patch || exit 4
timeout 60 python3 -m pytest tests/gpu/test_checkpoint_offload_cuda.py tests/gpu/test_checkpoint_keep_cuda.py -q -rs -s -p no:cacheprovider 2>&1 | tee $OUT/gpu_offload_patched.txt | grep -E "peak GiB|passed|failed|Error" | tail -8
T="tfcompat_fused[auto]"; V="$T@attention+mlp_in:0..4+offload:3+fetch:mlp_in+loss"
timeout 170 python3 bench/train_step.py --long --variants "$V" --memory --out $OUT/long_patched.json 2>&1 | tee $OUT/long_patched.txt | grep -E "^memory|ms/step" | cut -c1-700
git apply -R bench/results/2026-12-06-parts/fetch_owner_stream.patch || exit 5
timeout 170 python3 bench/train_step.py --long --variants "$V" --memory --out $OUT/long_main.json 2>&1 | tee $OUT/long_main.txt | grep -E "^memory|ms/step" | cut -c1-700
git apply bench/results/2026-12-06-parts/fetch_owner_stream.patch || exit 6
timeout $(( 570 - ($(date +%s) - t0) )) python3 -m pytest tests/gpu -q -rs -p no:cacheprovider 2>&1 | tee $OUT/gpu_tests_patched.txt | grep -v Warning | grep -v "^SKIPPED" | tail -4
git apply -R bench/results/2026-12-06-parts/fetch_owner_stream.patch
echo "call took $(( $(date +%s) - t0 )) s"; date
