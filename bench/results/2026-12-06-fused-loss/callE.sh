# call E, fresh machine (carry .h28/whl and .h28/p1): FA4's MLIR module; nothing else (the runtime comes next)
nvidia-smi -L; date
source bench/results/2026-12-05-issue28-ranges/setup.sh || exit 3
