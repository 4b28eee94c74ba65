# the six calls of h20c (2026-12-02), run from /work/main with carry .h20/code .h20/whl .h20/setup.sh and .h20/p1 (calls 2, 4) or .h20/p2 (calls 3, 5); .h20/setup.sh as in ../2026-12-02-h200-ckpt-derived/setup_fa4_liger.sh
# call A (h20c): heads on CUDA: compiled Triton head tests incl. keep_logits; heads bench (tile / keep / Liger mean vs none) + profile at 70,703
nvidia-smi -L; date
source .h20/setup.sh || exit 3
cd .h20/code
t0=$(date +%s)
timeout 200 python3 -m pytest tests/test_heads_triton.py tests/gpu/test_heads_keep_cuda.py -q -rs -p no:cacheprovider 2>&1 | tee $OUT/gpu_tests_heads.txt | tail -8
echo "tests took $(( $(date +%s) - t0 )) s"
timeout $(( 420 - ($(date +%s) - t0) )) python3 bench/heads.py --tokens 8191 19679 32768 70703 --variants triton triton-t8k triton-t32k triton-keep liger liger-mean --profile-tokens 70703 --profile-variants triton triton-keep liger-mean liger --out $OUT/heads.json 2>&1 | tee $OUT/heads.txt | tail -62
date
# call B1 (h20c, fresh machine): keep FA4's first part under /tmp; heads bench, odd and round T, keep_logits vs recompute vs Liger (none / mean)
nvidia-smi -L; date
cp .h20/p1/cu13.part.aa /tmp/ && echo "p1 kept under /tmp"
source .h20/setup.sh || exit 3
cd .h20/code
t0=$(date +%s)
timeout 330 python3 bench/heads.py --tokens 1024 8191 8192 19679 20480 32768 65536 70703 --variants logits torch torch-keep triton triton-keep liger liger-mean --profile-tokens 19679 --profile-variants triton triton-keep liger-mean --out $OUT/heads.json 2>&1 | grep -v "^wrote" | tee $OUT/heads.txt | tail -75
echo "bench took $(( $(date +%s) - t0 )) s"; date
# call B2 (h20c, warm after B1): FA4 (second part) + liger; train steps with the kept-logits head, 28 layers 512-4k and long 8k-32k, against Liger + flex (its own head) under the same checkpointing
date
source .h20/setup.sh || exit 3
cd .h20/code
t0=$(date +%s)
T="tfcompat_fused[auto]"
timeout 320 python3 bench/train_step.py --variants "$T,$T@logits,$T@attention,$T@attention+logits,$T@attention+mlp+logits,liger_flex,liger_flex_tfhead@logits,liger_flex@attention,liger_flex@attention+mlp" --profile "$T@attention+logits,liger_flex" --out $OUT/train_step.json 2>&1 | tee $OUT/train_step.txt | grep -v "^speed-up" | tail -26
grep "^speed-up" $OUT/train_step.txt | grep -E "/ liger_flex" | head -24
timeout $(( 575 - ($(date +%s) - t0) )) python3 bench/train_step.py --long --variants "$T,$T@logits,$T@attention+logits,$T@attention+mlp,$T@attention+mlp+logits,liger_flex,liger_flex_tfhead@logits,liger_flex@attention,liger_flex@attention+mlp" --profile "$T@attention+mlp+logits,liger_flex" --out $OUT/train_step_long.json 2>&1 | tee $OUT/train_step_long.txt | grep -v "^speed-up" | tail -26
grep "^speed-up" $OUT/train_step_long.txt | grep -E "/ liger_flex" | head -24
date
# call D (h20c, fresh machine): keep FA4's first part; CUDA tests of the head with the final code (compiled Triton, keep_logits, model_logprobs)
nvidia-smi -L; date
cp .h20/p1/cu13.part.aa /tmp/ && echo "p1 kept under /tmp"
source .h20/setup.sh || exit 3
cd .h20/code
timeout 150 python3 -m pytest tests/test_heads_triton.py tests/test_model_logprobs.py tests/gpu/test_heads_keep_cuda.py -q -rs -p no:cacheprovider 2>&1 | tee $OUT/gpu_tests_heads.txt | tail -8
date
# call E (h20c, warm after D): FA4; a second measurement of the key rows, 5 reps: 28 layers, long, and the Qwen3-VL-MoE stack with the kept-logits head
date
source .h20/setup.sh || exit 3
cd .h20/code
t0=$(date +%s)
T="tfcompat_fused[auto]"
timeout 190 python3 bench/train_step.py --reps 5 --variants "$T@logits,$T@attention+logits,$T@attention+mlp+logits,liger_flex,liger_flex@attention+mlp" --out $OUT/train_step_repeat.json 2>&1 | tee $OUT/train_step_repeat.txt | grep -v "^speed-up" | tail -9
grep "^speed-up" $OUT/train_step_repeat.txt | grep -E "/ liger_flex" | head -12
timeout $(( 370 - ($(date +%s) - t0) )) python3 bench/train_step.py --long --reps 5 --variants "$T@logits,$T@attention+logits,$T@attention+mlp+logits,liger_flex,liger_flex@attention+mlp" --out $OUT/train_step_long_repeat.json 2>&1 | tee $OUT/train_step_long_repeat.txt | grep -v "^speed-up" | tail -9
grep "^speed-up" $OUT/train_step_long_repeat.txt | grep -E "/ liger_flex" | head -12
timeout $(( 540 - ($(date +%s) - t0) )) python3 bench/train_step.py --moe --variants "$T,$T@logits,flex_packed,liger_flex" --profile "$T@logits" --out $OUT/train_step_moe.json 2>&1 | tee $OUT/train_step_moe.txt | grep -v "^speed-up" | tail -12
grep "^speed-up" $OUT/train_step_moe.txt | head -8
date
# call F (h20c, fresh machine, no FA4): the stats kernel with per-lane sums (one reduction per block): CUDA tests, heads at 19,679 and 70,703 with kernel profile
nvidia-smi -L; date
source .h20/setup.sh || exit 3
cd .h20/code
timeout 100 python3 -m pytest tests/test_heads_triton.py tests/test_model_logprobs.py tests/gpu/test_heads_keep_cuda.py -q -rs -p no:cacheprovider 2>&1 | tee $OUT/gpu_tests_heads.txt | tail -4
timeout 110 python3 bench/heads.py --tokens 19679 70703 --variants triton triton-keep liger-mean --profile-tokens 70703 --profile-variants triton triton-keep --out $OUT/heads.json 2>&1 | grep -v "^wrote" | tee $OUT/heads.txt | tail -16
date
