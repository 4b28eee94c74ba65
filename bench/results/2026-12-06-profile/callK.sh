# call K (fresh machine; carry .h28/whl and .h28/p1): FA4's MLIR module only
date; source bench/results/2026-12-05-issue28-ranges/setup.sh >/dev/null 2>&1; ls /tmp/fa4site | wc -l; date
