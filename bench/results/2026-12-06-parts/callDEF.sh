# calls D-F, right after call C on the same warm machine (no carry: the wheels and FA4's libs were there)
# call D: call C's bench at 16,384 tokens only (its 32,768-token stock padded run was out of memory on the 80 GB H100)
source bench/results/2026-12-05-issue28-ranges/setup.sh >/dev/null 2>&1; t0=$(date +%s); timeout 420 python3 bench/qwen3_5_stack.py --tokens 16384 --reps 5 --warmup 2 --out $OUT/qwen3_5_stack_fla.json 2>&1 | tee $OUT/qwen3_5_stack_fla.txt | grep -v "Warning\|TileLang" | tail -14; echo "took $(( $(date +%s) - t0 )) s"
# call E: tests/gpu, meant with FA4, Liger and fla, but the setup was sourced in a pipeline (a subshell): its
# PYTHONPATH was lost, so this is the image's packages only (callE_gpu_tests_no_site.txt)
source bench/results/2026-12-05-issue28-ranges/setup.sh 2>&1 | tail -2; timeout 450 python3 -m pytest tests/gpu -q -rs -p no:cacheprovider -x --deselect tests/gpu/test_checkpoint_offload_cuda.py::test_the_fetch_at_gate_and_up_in_two_parts_lowers_the_peak 2>&1 | tee $OUT/gpu_tests_fa4_fla.txt | tail -8
# call F: tests/gpu with FA4, Liger-Kernel, fla and tilelang
source bench/results/2026-12-05-issue28-ranges/setup.sh > /tmp/setup.txt 2>&1; tail -2 /tmp/setup.txt; t0=$(date +%s); timeout 400 python3 -m pytest tests/gpu -q -rs -p no:cacheprovider 2>&1 | tee $OUT/gpu_tests_fa4_fla.txt | grep -v Warning | grep -v "^SKIPPED" | tail -5; echo "took $(( $(date +%s) - t0 )) s"
