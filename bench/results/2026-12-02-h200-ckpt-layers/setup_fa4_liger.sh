# sourced on the device from the repo root: FA4 + liger-kernel from carried wheels into /tmp/fa4site (once per machine)
H=$PWD/.h20
SITE=/tmp/fa4site
CU13=nvidia_cutlass_dsl_libs_cu13-4.8.1-cp312-cp312-manylinux_2_28_x86_64.whl
if [ ! -f $SITE/.done ] && [ ! -f /tmp/cu13.part.aa -o ! -f $H/p2/cu13.part.ab ]; then
  echo "WARNING: no cu13 parts here: liger-kernel only, no FA4"
  python3 -c "
import glob, zipfile
for w in glob.glob('$H/whl/liger*.whl') + glob.glob('$H/whl/einops*.whl'):
    zipfile.ZipFile(w).extractall('$SITE')
"
elif [ ! -f $SITE/.done ]; then
  cat /tmp/cu13.part.aa $H/p2/cu13.part.ab > /tmp/$CU13 && (cd /tmp && sha256sum -c $H/p2/cu13.sha256) || { echo "cu13 join failed"; return 3; }
  python3 -c "
import glob, zipfile
for w in sorted(glob.glob('$H/whl/*.whl')) + ['/tmp/$CU13']:
    zipfile.ZipFile(w).extractall('$SITE')
print('unzipped', len(glob.glob('$H/whl/*.whl')) + 1, 'wheels')
" && touch $SITE/.done
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
for d in ('flash-attn-4', 'nvidia-cutlass-dsl', 'quack-kernels'):
    try:
        print(d, m.version(d))
    except m.PackageNotFoundError:
        print(d, 'missing')
from tfcompat.core import attention as A
print('tfcompat', A.__file__, 'flash ->', A._flash_varlen(torch.device('cuda')))
"
