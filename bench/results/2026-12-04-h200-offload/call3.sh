# call 3 (fresh machine, no FA4 or liger): the CUDA tests of checkpoint_offload (rewritten after call 1b: each
# offloaded tensor checked bit for bit at its unpack; gradients within test_checkpoint_keep_cuda's bf16 bound) and of
# checkpoint_keep
nvidia-smi -L; date
cd .h28/code
PYTHONPATH=$PWD PYTHONUNBUFFERED=1 timeout 150 python3 -m pytest tests/gpu/test_checkpoint_offload_cuda.py tests/gpu/test_checkpoint_keep_cuda.py -q -rs -s -p no:cacheprovider 2>&1 | tee $OUT/call3_gpu_tests.txt | grep -v Warning | tail -12
date
