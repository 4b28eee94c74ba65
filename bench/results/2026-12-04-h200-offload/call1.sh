# call 1 (fresh machine; the first try, on 2026-12-04 20:50, had FA4's python wheels without its cu13 libs and
# failed in setup, then ran this without FA4 with an older test tolerance: see call1_*): keep the cu13 part 1 under
# /tmp; liger only (no FA4 yet): the host link, the CUDA tests of checkpoint_offload, a profile of the copies
mkdir -p /tmp/allwhl && mv .h28/whl/*.whl /tmp/allwhl/ && cp /tmp/allwhl/liger*.whl .h28/whl/  # no FA4 without cu13
nvidia-smi -L; date; free -g | head -2
cp .h28/p1/cu13.part.aa /tmp/ && echo "p1 kept under /tmp"
source .h28/setup.sh || exit 3
cd .h28/code
D=bench/results/2026-12-04-h200-offload
timeout 60 python3 $D/link.py /tmp/h28_link.json > $OUT/call1b_link.json
timeout 100 python3 -m pytest tests/gpu/test_checkpoint_offload_cuda.py -q -rs -s -p no:cacheprovider 2>&1 | tee $OUT/call1b_gpu_tests.txt | tail -4
timeout 120 python3 $D/copies_profile.py $OUT/call1b_copies_profile.json 2>&1 | grep -v Warning | tail -4
date; free -g | head -2
