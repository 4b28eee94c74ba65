# sourced on the device from the repo root: FA4 + liger-kernel from carried wheels (.h28/w*/) into /tmp/fa4site (each
# wheel once per machine, so they may come over two calls). FA4's cu13 libs (the 92 MB nvidia-cutlass-dsl-libs-cu13 wheel's two .so files, stubs dropped) travel as
# two xz tars: .h28/p1/ir.tar.xz (the MLIR module, 50 MB) in call 1, .h28/p2/rt.tar.xz (the runtime) in call 2 on
# the same warm machine. Without the runtime, liger-kernel alone.
SITE=/tmp/fa4site
python3 -c "
import glob, os, zipfile
ws = [w for w in sorted(glob.glob('.h28/w*/*.whl')) if not os.path.exists('$SITE/.' + os.path.basename(w))]
for w in ws:
    zipfile.ZipFile(w).extractall('$SITE')
    open('$SITE/.' + os.path.basename(w), 'w').close()
print('unzipped', len(ws), 'wheels')
"
[ -f .h28/p1/ir.tar.xz ] && [ ! -f $SITE/.ir ] && tar xJf .h28/p1/ir.tar.xz -C $SITE && touch $SITE/.ir
[ -f .h28/p2/rt.tar.xz ] && [ ! -f $SITE/.rt ] && tar xJf .h28/p2/rt.tar.xz -C $SITE && touch $SITE/.rt
# flash_attn.cute raises RuntimeError at import without the runtime: hidden until it is there
if [ -f $SITE/.rt ]; then
  [ -d $SITE/flash_attn_hidden ] && mv $SITE/flash_attn_hidden $SITE/flash_attn
else
  [ -d $SITE/flash_attn ] && mv $SITE/flash_attn $SITE/flash_attn_hidden
fi
export PYTHONPATH=$PWD:$SITE:$SITE/nvidia_cutlass_dsl/dsl_packages
export FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED=1 FLASH_ATTENTION_CUTE_DSL_CACHE_DIR=/tmp/fa4cache PYTHONUNBUFFERED=1
python3 -c "
import importlib.metadata as m, torch, transformers, triton
import liger_kernel.ops
try:
    import flash_attn.cute
except Exception as e:
    print('NO FA4:', type(e).__name__, str(e)[:200])
print('torch', torch.__version__, 'transformers', transformers.__version__, 'triton', triton.__version__, 'liger',
      m.version('liger-kernel'), torch.cuda.get_device_name())
from tfcompat.core import attention as A
print('tfcompat', A.__file__, 'flash ->', A._flash_varlen(torch.device('cuda')))
"
