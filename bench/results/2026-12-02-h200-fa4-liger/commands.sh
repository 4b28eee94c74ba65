# call 2: install, GPU tests (FA4, fused, varlen flash cases), attention backends
nvidia-smi -L; date
source .h20/setup.sh || exit 3
cd .h20/code
t0=$(date +%s)
timeout 270 python3 -m pytest tests/gpu/test_fa4.py tests/gpu/test_fused_cuda.py "tests/gpu/test_varlen_cuda.py" -k "fa4 or fused or flash or select" -q -rs -p no:cacheprovider 2>&1 | tee $OUT/gpu_tests.txt | tail -40
echo "tests took $(( $(date +%s) - t0 )) s"
left=$(( 540 - ($(date +%s) - t0) ))
timeout $left python3 bench/attention_backends.py --out $OUT/attention_backends.json 2>&1 | tee $OUT/attention_backends.txt | tail -45
date
# call 3: training steps, 28 layers 512-4k, long 8k-32k, MoE
date
source .h20/setup.sh || exit 3
cd .h20/code
t0=$(date +%s)
timeout 250 python3 bench/train_step.py --variants "tfcompat[auto],tfcompat_fused[auto],tfcompat_fused[sdpa],flex_packed,liger_flex,liger_flex_tfhead,liger_tfcompat[auto]" --profile "tfcompat_fused[auto],liger_flex_tfhead" --out $OUT/train_step.json 2>&1 | tee $OUT/train_step.txt | tail -30
timeout $(( 400 - ($(date +%s) - t0) )) python3 bench/train_step.py --long --variants "tfcompat[auto],tfcompat_fused[auto],tfcompat_fused[sdpa],flex_packed,liger_flex,liger_flex_tfhead" --out $OUT/train_step_long.json 2>&1 | tee $OUT/train_step_long.txt | tail -20
timeout $(( 545 - ($(date +%s) - t0) )) python3 bench/train_step.py --moe --variants "tfcompat[auto],tfcompat_fused[auto],flex_packed,liger_flex_tfhead" --profile "tfcompat_fused[auto],flex_packed" --out $OUT/train_step_moe.json 2>&1 | tee $OUT/train_step_moe.txt | tail -25
date
date
source .h20/setup.sh
cd .h20/code
timeout 400 python3 bench/train_step.py --moe --variants "tfcompat[auto],tfcompat_fused[auto],flex_packed,liger_flex,liger_flex_tfhead" --profile "tfcompat_fused[auto],flex_packed,liger_flex_tfhead" --out $OUT/train_step_moe.json 2>&1 | tee $OUT/train_step_moe.txt | tail -30
date
