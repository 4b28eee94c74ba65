# sourced by calls E-H: `run BLOCK ARGS...` runs bench/train_step.py with tfcompat.hf.swiglu_down.BLOCK_ELEMENTS set
# to BLOCK (the default was 2**28 in calls C-F; 2**29 from call G's result on)
run() {
  local block=$1; shift
  python3 -c "
import sys, runpy
import tfcompat.hf.swiglu_down as S
S.BLOCK_ELEMENTS = $block
sys.argv = ['bench/train_step.py'] + sys.argv[1:]
runpy.run_path('bench/train_step.py', run_name='__main__')
" "$@"
}
