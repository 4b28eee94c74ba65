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
