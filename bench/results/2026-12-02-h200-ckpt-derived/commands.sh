# ---- .h20/stage_d.sh
# call 1 (2026-12-02, h20b): keep FA4's first part under /tmp; liger only; GPU tests of fused + checkpoint_keep; a 28-layer sanity run of the kept-output variants (sdpa, no FA4 yet)
nvidia-smi -L; date
cp .h20/p1/cu13.part.aa /tmp/ && echo "p1 kept under /tmp"
source .h20/setup.sh || exit 3
cd .h20/code
t0=$(date +%s)
timeout 150 python3 -m pytest tests/gpu/test_fused_cuda.py tests/gpu/test_checkpoint_keep_cuda.py -q -rs -p no:cacheprovider 2>&1 | tee $OUT/gpu_tests_call1.txt | tail -15
echo "tests took $(( $(date +%s) - t0 )) s"
timeout $(( 330 - ($(date +%s) - t0) )) python3 bench/train_step.py --reps 2 --variants "tfcompat_fused[sdpa],tfcompat_fused[sdpa]@attention,tfcompat_fused[sdpa]@attention+mlp,tfcompat_fused[sdpa]@none" --out $OUT/train_step_sanity.json 2>&1 | tee $OUT/train_step_sanity.txt | tail -14
date
# ---- .h20/stage_e.sh
# call 2 (h20b): FA4 (second part) + liger; 28 layers 512-4k and long 8k-32k: kept outputs vs full recompute vs none, peers
date
source .h20/setup.sh || exit 3
cd .h20/code
t0=$(date +%s)
timeout 320 python3 bench/train_step.py --variants "tfcompat_fused[auto],tfcompat_fused[auto]@attention,tfcompat_fused[auto]@attention+mlp,tfcompat_fused[auto]@none,flex_packed,liger_flex,liger_flex_tfhead,liger_flex_tfhead@attention+mlp,liger_flex_tfhead@none" --profile "tfcompat_fused[auto]@attention+mlp" --out $OUT/train_step.json 2>&1 | tee $OUT/train_step.txt | grep -v "^speed-up" | tail -24
grep "^speed-up" $OUT/train_step.txt | grep -E "liger_flex|flex_packed" | grep -v "@none /\|@attention /" | head -20
timeout $(( 570 - ($(date +%s) - t0) )) python3 bench/train_step.py --long --variants "tfcompat_fused[auto],tfcompat_fused[auto]@attention,tfcompat_fused[auto]@attention+mlp,tfcompat_fused[auto]@none,flex_packed,liger_flex,liger_flex_tfhead,liger_flex_tfhead@attention+mlp,liger_flex_tfhead@none" --out $OUT/train_step_long.json 2>&1 | tee $OUT/train_step_long.txt | grep -v "^speed-up" | tail -16
date
# ---- .h20/stage_f.sh
# call 3 (h20b): issue 18's derived stacks (gpt-oss-20b- and Qwen3-30B-A3B-shaped, 4 layers, real width), odd and round token counts; GPU tests with FA4
date
source .h20/setup.sh || exit 3
cd .h20/code
t0=$(date +%s)
V="tfcompat[auto],tfcompat_fused[auto],tfcompat_fused[auto]@attention+mlp,padded,flex_packed"
for fam in gpt_oss qwen3_moe; do
  timeout 110 python3 bench/train_step.py --family $fam --variants "$V" --out $OUT/train_step_${fam}.json 2>&1 | tee $OUT/train_step_${fam}.txt | grep -E "^model|^batch|^ +[a-z_]+.*[0-9]|failed" | head -12
  timeout 90 python3 bench/train_step.py --family $fam --lengths 2048,2048,2048,2048,2048,2048,2048,2048 --variants "$V" --out $OUT/train_step_${fam}_round.json 2>&1 | tee $OUT/train_step_${fam}_round.txt | grep -E "^batch|^ +[a-z_]+.*[0-9]|failed" | head -10
done
echo "benches took $(( $(date +%s) - t0 )) s"
timeout $(( 560 - ($(date +%s) - t0) )) python3 -m pytest tests/gpu/test_attention_features_cuda.py tests/gpu/test_fa4.py tests/gpu/test_checkpoint_keep_cuda.py tests/gpu/test_varlen_cuda.py -q -rs -p no:cacheprovider 2>&1 | tee $OUT/gpu_tests_fa4.txt | tail -25
date
# ---- .h20/stage_g.sh
# call 4 (h20b, fresh machine): keep FA4's first part; GPU tests of the attention features (flex sinks / softcap+window fixes) and varlen, without FA4
nvidia-smi -L; date
cp .h20/p1/cu13.part.aa /tmp/ && echo "p1 kept under /tmp"
source .h20/setup.sh || exit 3
cd .h20/code
timeout 110 python3 -m pytest tests/gpu/test_attention_features_cuda.py tests/gpu/test_varlen_cuda.py -q -rs -p no:cacheprovider 2>&1 | tee $OUT/gpu_tests_call4.txt | tail -25
date
# ---- .h20/stage_h.sh
# call 5 (h20b): FA4; per-token accuracy of the derived stacks; round-length tfcompat vs flex rows; FA4 GPU tests
date
source .h20/setup.sh || exit 3
cd .h20/code
t0=$(date +%s)
for fam in gpt_oss qwen3_moe; do
  timeout 50 python3 bench/stack_accuracy.py --family $fam --out $OUT/stack_accuracy_${fam}.json 2>&1 | tee $OUT/stack_accuracy_${fam}.txt | tail -6
done
for fam in gpt_oss qwen3_moe; do
  timeout 60 python3 bench/train_step.py --family $fam --reps 2 --lengths 2048,2048,2048,2048,2048,2048,2048,2048 --variants "tfcompat[auto],flex_packed" --out $OUT/train_step_${fam}_round_flex.json 2>&1 | tee $OUT/train_step_${fam}_round_flex.txt | grep -E "ms/step|failed"
done
echo "benches took $(( $(date +%s) - t0 )) s"
timeout $(( 215 - ($(date +%s) - t0) )) python3 -m pytest tests/gpu/test_checkpoint_keep_cuda.py tests/gpu/test_fa4.py -q -rs -p no:cacheprovider 2>&1 | tee $OUT/gpu_tests_call5.txt | tail -15
date
