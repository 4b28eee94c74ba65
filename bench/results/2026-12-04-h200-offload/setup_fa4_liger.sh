# sourced on the device from the repo root (/work/main's checkout there): FA4 + liger-kernel from carried wheels into
# /tmp/fa4site (once per machine). The cu13 libs (92 MB wheel) travel as one xz tar (63.5 MB) split in two parts:
# .h28/p1 in call 1 (kept under /tmp), .h28/p2 in call 2 on the same warm machine.
H=$PWD/.h28
SITE=/tmp/fa4site
if [ ! -f $SITE/.done ]; then
  python3 -c "
import glob, zipfile
for w in sorted(glob.glob('$H/whl/*.whl')):
    zipfile.ZipFile(w).extractall('$SITE')
print('unzipped', len(glob.glob('$H/whl/*.whl')), 'wheels')
"
  if [ -f /tmp/cu13.part.aa ] && [ -f $H/p2/cu13.part.ab ]; then
    cat /tmp/cu13.part.aa $H/p2/cu13.part.ab > /tmp/cu13.tar.xz && (cd /tmp && sha256sum -c $H/p2/cu13.sha256) \
      && tar xJf /tmp/cu13.tar.xz -C $SITE && touch $SITE/.done || echo "cu13 join failed: no FA4"
  else
    echo "WARNING: no cu13 parts here: liger-kernel only, no FA4"
  fi
fi
export PYTHONPATH=$H/code:$SITE:$SITE/nvidia_cutlass_dsl/dsl_packages
export FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED=1 FLASH_ATTENTION_CUTE_DSL_CACHE_DIR=/tmp/fa4cache PYTHONUNBUFFERED=1
python3 -c "
import importlib.metadata as m, torch, transformers, triton
import liger_kernel.ops
try:
    import flash_attn.cute
except Exception as e:
    print('NO FA4:', type(e).__name__, e)
print('torch', torch.__version__, 'transformers', transformers.__version__, 'triton', triton.__version__, 'liger', m.version('liger-kernel'))
from tfcompat.core import attention as A
print('tfcompat', A.__file__, 'flash ->', A._flash_varlen(torch.device('cuda')))
"
