# call C, right after call B (carry .h28/wC: tilelang; fla-core, flash-linear-attention and z3-solver came with call
# B): the Qwen3.5-shaped stack with flash-linear-attention on GPU, tilelang serving fla's gated chunk backward on
# Hopper (fla 0.6 refuses Triton's there below 3.7.1, fla issue #640)
date
source bench/results/2026-12-05-issue28-ranges/setup.sh >/dev/null 2>&1 || exit 3
t0=$(date +%s)
python3 -c "
import importlib.metadata as m
print({n: m.version(n) for n in ('fla-core', 'flash-linear-attention', 'tilelang', 'z3-solver', 'triton')})
from tfcompat.core.linear_attention import available_conv_backends, available_rule_backends
from tfcompat.core import _linear_kernels as K
import torch
x = torch.zeros(1, device='cuda', dtype=torch.bfloat16)
print('rule', available_rule_backends(x), 'conv', available_conv_backends(x),
      'refusal', K.fla_rule_refusal())
" 2>&1 | grep -v Warning | tail -4
timeout $(( 560 - ($(date +%s) - t0) )) python3 bench/qwen3_5_stack.py --out $OUT/qwen3_5_stack_fla.json 2>&1 | tee $OUT/qwen3_5_stack_fla.txt | grep -v Warning | tail -14
echo "call took $(( $(date +%s) - t0 )) s"; date
