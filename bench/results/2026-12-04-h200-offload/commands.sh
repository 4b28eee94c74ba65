# the calls of h-offload (issue 28, 2026-12-04), run from /work/main's checkout (the device ships that tree) with carry
# .h28/code (this branch's tfcompat, tests, bench), .h28/whl, .h28/setup.sh (= setup_fa4_liger.sh) and .h28/p1 (call 1) or
# .h28/p2 (call 2); calls 1b and 2 back to back on one warm machine (FA4's cu13 part 1 kept under /tmp by 1b)
#
# ---- call 1, first try (fresh machine): 'bash .h28/code/bench/results/2026-12-04-h200-offload/call1.sh' as below;
#      failed in setup (FA4's python wheels unzipped without its cu13 libs: flash_attn.cute raised RuntimeError); no output
# ---- call 1, second try (warm): 'mkdir -p /tmp/allwhl && mv .h28/whl/*.whl /tmp/allwhl/ && cp /tmp/allwhl/liger*.whl .h28/whl/
#      && rm -rf /tmp/fa4site && bash .../call1.sh' -> call1_* (no FA4; the first GPU test version failed: see RESULTS.md 14)
# call 1 (fresh machine): keep the cu13 part 1 under /tmp; liger only (no FA4 yet): the host link, the CUDA tests of
# checkpoint_offload and checkpoint_keep, a 6-layer sanity step of the offload variants
nvidia-smi -L; date; free -g | head -2
cp .h28/p1/cu13.part.aa /tmp/ && echo "p1 kept under /tmp"
source .h28/setup.sh || exit 3
cd .h28/code
D=bench/results/2026-12-04-h200-offload
timeout 60 python3 $D/link.py /tmp/h28_link.json | tee $OUT/call1_link.json
grep -q '"pinned_max_round_threshold_mb": true' /tmp/h28_link.json && export PYTORCH_ALLOC_CONF=pinned_max_round_threshold_mb:64
echo "PYTORCH_ALLOC_CONF=${PYTORCH_ALLOC_CONF:-}"
timeout 150 python3 -m pytest tests/gpu/test_checkpoint_offload_cuda.py tests/gpu/test_checkpoint_keep_cuda.py -q -rs -s -p no:cacheprovider 2>&1 | tee $OUT/call1_gpu_tests.txt | tail -12
T="tfcompat_fused[auto]"
timeout 100 python3 bench/train_step.py --layers 6 --variants "$T@logits,$T@attention+mlp_in+logits,$T@attention+mlp_in+offload+logits,$T@attention+mlp_in+offload:4+logits" --out $OUT/call1_train_step_sanity.json 2>&1 | tee $OUT/call1_train_step_sanity.txt | grep -v "^speed-up" | tail -8
date; free -g | head -2
# ---- call 1b (fresh machine; machine given back after call 1 to look at its result): bash .h28/code/bench/results/2026-12-04-h200-offload/call1.sh -> call1b_*
# call 1 (fresh machine; the first try, on 2026-12-04 20:50, had FA4's python wheels without its cu13 libs and
# failed in setup, then ran this without FA4 with an older test tolerance: see call1_*): keep the cu13 part 1 under
# /tmp; liger only (no FA4 yet): the host link, the CUDA tests of checkpoint_offload, a profile of the copies
mkdir -p /tmp/allwhl && mv .h28/whl/*.whl /tmp/allwhl/ && cp /tmp/allwhl/liger*.whl .h28/whl/  # no FA4 without cu13
nvidia-smi -L; date; free -g | head -2
cp .h28/p1/cu13.part.aa /tmp/ && echo "p1 kept under /tmp"
source .h28/setup.sh || exit 3
cd .h28/code
D=bench/results/2026-12-04-h200-offload
timeout 60 python3 $D/link.py /tmp/h28_link.json > $OUT/call1b_link.json
timeout 100 python3 -m pytest tests/gpu/test_checkpoint_offload_cuda.py -q -rs -s -p no:cacheprovider 2>&1 | tee $OUT/call1b_gpu_tests.txt | tail -4
timeout 120 python3 $D/copies_profile.py $OUT/call1b_copies_profile.json 2>&1 | grep -v Warning | tail -4
date; free -g | head -2
# ---- call 2 (warm after 1b): bash .h28/code/bench/results/2026-12-04-h200-offload/call2.sh -> call2_*
# call 2 (warm after call 1): FA4 (cu13 part 2) + liger; 28 layers, 8 sequences of 512-4,096 (19,679 tokens): full
# checkpointing, kept outputs, kept outputs offloaded (all / the first N layers keeping a module), Liger + flex; then
# the two variants with the most pinned host memory (own process: a host out-of-memory loses only them); then --long
date
source .h28/setup.sh || exit 3
cd .h28/code
t0=$(date +%s)
T="tfcompat_fused[auto]"
timeout 400 python3 bench/train_step.py --variants "$T@logits,$T@attention+mlp_in:4+logits,$T@attention+offload+logits,$T@attention+mlp_in:4+offload+logits,$T@attention+mlp_in:4+offload:24+logits,$T@attention+mlp_in:8+offload:20+logits,$T@attention+mlp_in+offload:20+logits,liger_flex,liger_flex@attention+mlp_in:4" --out $OUT/call2_train_step.json 2>&1 | tee $OUT/call2_train_step.txt | grep -v "^speed-up" | tail -13
grep "^speed-up" $OUT/call2_train_step.txt | grep -E "/ liger_flex$"
echo "bench took $(( $(date +%s) - t0 )) s"; free -g | head -2
timeout $(( 490 - ($(date +%s) - t0) )) python3 bench/train_step.py --variants "$T@attention+mlp_in+offload+logits,$T@attention+mlp+offload:12+logits" --out $OUT/call2_train_step_more.json 2>&1 | tee $OUT/call2_train_step_more.txt | grep -v "^speed-up" | tail -4
echo "more took $(( $(date +%s) - t0 )) s"; free -g | head -2
timeout $(( 575 - ($(date +%s) - t0) )) python3 bench/train_step.py --long --variants "$T@logits,$T@attention+mlp_in+logits,$T@attention+mlp_in+offload:2+logits,$T@attention+mlp_in+offload+logits,liger_flex" --out $OUT/call2_train_step_long.json 2>&1 | tee $OUT/call2_train_step_long.txt | grep -v "^speed-up" | tail -7
grep "^speed-up" $OUT/call2_train_step_long.txt | grep -E "/ liger_flex$"
date
# ---- call 3 (fresh machine, carry .h28/code only): bash .h28/code/bench/results/2026-12-04-h200-offload/call3.sh -> call3_*
# call 3 (fresh machine, no FA4 or liger): the CUDA tests of checkpoint_offload (rewritten after call 1b: each
# offloaded tensor checked bit for bit at its unpack; gradients within test_checkpoint_keep_cuda's bf16 bound) and of
# checkpoint_keep
nvidia-smi -L; date
cd .h28/code
PYTHONPATH=$PWD PYTHONUNBUFFERED=1 timeout 150 python3 -m pytest tests/gpu/test_checkpoint_offload_cuda.py tests/gpu/test_checkpoint_keep_cuda.py -q -rs -s -p no:cacheprovider 2>&1 | tee $OUT/call3_gpu_tests.txt | grep -v Warning | tail -12
date
