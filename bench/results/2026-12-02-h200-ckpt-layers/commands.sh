# the four calls of h20d (2026-12-02), run from /work/main (the device ships its tree) with carry .h20/code (this branch's tfcompat, tests, bench + the stage scripts) .h20/whl .h20/setup.sh and .h20/p1 (call A) / .h20/p2 (call B); .h20/setup.sh = setup_fa4_liger.sh
# ---- call A: bash .h20/code/stages/a.sh
# call A (h20d, fresh machine): keep FA4's first part under /tmp; Liger only: CUDA tests of checkpoint_keep (new per-layer policy, mlp_in) and fused
nvidia-smi -L; date
cp .h20/p1/cu13.part.aa /tmp/ && echo "p1 kept under /tmp"
source .h20/setup.sh || exit 3
cd .h20/code
timeout 200 python3 -m pytest tests/gpu/test_checkpoint_keep_cuda.py tests/gpu/test_fused_cuda.py -q -rs -p no:cacheprovider 2>&1 | tee $OUT/gpu_tests_a.txt | tail -8
date
# ---- call B: bash .h20/code/stages/b.sh
# call B (h20d, warm after A): FA4 (second part) + liger; 28 layers 512-4k: the memory/speed curve of checkpoint_keep's per-layer policies against Liger + flex
date
source .h20/setup.sh || exit 3
cd .h20/code
t0=$(date +%s)
T="tfcompat_fused[auto]"
timeout 440 python3 bench/train_step.py --variants "$T@logits,$T@attention:10+logits,$T@attention:20+logits,$T@attention+logits,$T@attention+mlp_in:4+logits,$T@attention+mlp:3+logits,$T@attention+mlp_in:8+logits,$T@attention+mlp_in:14+logits,$T@attention+mlp:9+logits,$T@attention+mlp_in+logits,$T@attention+mlp+logits,liger_flex,liger_flex@attention,liger_flex@attention+mlp_in:8,liger_flex@attention+mlp:9" --out $OUT/train_step.json 2>&1 | tee $OUT/train_step.txt | grep -v "^speed-up" | tail -22
cp $OUT/train_step.json /tmp/b_train_step.json
echo "bench took $(( $(date +%s) - t0 )) s"
timeout $(( 565 - ($(date +%s) - t0) )) python3 -m pytest tests/gpu/test_checkpoint_keep_cuda.py -q -rs -p no:cacheprovider 2>&1 | tee $OUT/gpu_tests_b.txt | tail -4
date
# ---- call C: bash .h20/code/stages/c.sh
# call C (h20d, warm after B): FA4; attention backends (11 shapes, fwd and fwd+bwd, auto's pick per pass); a second measurement (5 reps) of the key step rows picked from call B
date
source .h20/setup.sh || exit 3
cd .h20/code
t0=$(date +%s)
timeout 370 python3 bench/attention_backends.py --out $OUT/attention_backends.json 2>&1 | grep -v "^wrote" | tee $OUT/attention_backends.txt | tail -26
echo "backends took $(( $(date +%s) - t0 )) s"
V=$(python3 stages/pick.py /tmp/b_train_step.json)
echo "repeat: $V"
timeout $(( 570 - ($(date +%s) - t0) )) python3 bench/train_step.py --reps 5 --variants "$V" --out $OUT/train_step_repeat.json 2>&1 | tee $OUT/train_step_repeat.txt | grep -v "^speed-up" | tail -10
date
# stages/pick.py (call C's choice of rows to repeat):
# """The step variants call C repeats: from call B's JSON, tfcompat's fastest within 48 and 64 GiB, the fixed rows, and
# Liger + flex under the same kept outputs where call B measured it."""
# import json
# import sys
# 
# T = "tfcompat_fused[auto]"
# fixed = [f"{T}@logits", f"{T}@attention+logits"]
# try:
#     res = json.load(open(sys.argv[1]))["results"]
# except Exception:
#     res = {}
# chosen = list(fixed)
# for budget in (48, 64):
#     ok = [(r["ms"], n) for n, r in res.items() if n.startswith(T) and "ms" in r
#           and (r.get("peak_memory_bytes") or 1e99) <= budget * 2**30]
#     if ok:
#         name = min(ok)[1]
#         if name not in chosen:
#             chosen.append(name)
# if len(chosen) == 2:
#     chosen += [f"{T}@attention+mlp_in:4+logits", f"{T}@attention+mlp_in:14+logits"]
# peers = ["liger_flex"]
# for name in chosen:
#     mode = "+".join(k for k in name.partition("@")[2].split("+") if k != "logits")
#     peer = f"liger_flex@{mode}"
#     if "ms" in res.get(peer, {}) and peer not in peers:
#         peers.append(peer)
# print(",".join(chosen + peers))
# ---- call D (warm after C): the low-memory points
source .h20/setup.sh >/dev/null || exit 3; cd .h20/code; T="tfcompat_fused[auto]"; timeout 300 python3 bench/train_step.py --variants "$T@attention:10+logits,$T@attention:12+logits,$T@attention:14+logits,$T@attention:16+logits,$T@attention:10+mlp_in:1+logits,$T@attention:10+mlp_in:2+logits,$T@attention:6+mlp_in:2+logits,$T@mlp_in:3+logits,liger_flex" --out $OUT/train_step_low.json 2>&1 | tee $OUT/train_step_low.txt | grep -v "^speed-up" | tail -13; date
# ---- (a start refused: "no device machine could be started right now", 90 s of device time)
# ---- call E (fresh machine): keep FA4's first part
nvidia-smi -L; cp .h20/p1/cu13.part.aa /tmp/ && echo "p1 kept under /tmp"; date
# ---- call F (warm after E; carry .h20/code .h20/whl .h20/setup.sh .h20/p2): FA4; long context with the per-layer policies
source .h20/setup.sh || exit 3; cd .h20/code; T="tfcompat_fused[auto]"; timeout 420 python3 bench/train_step.py --long --variants "$T@logits,$T@attention+logits,$T@attention+mlp_in:2+logits,$T@attention+mlp_in+logits,$T@attention+mlp+logits,liger_flex,liger_flex@attention+mlp_in,liger_flex@attention+mlp" --out $OUT/train_step_long.json 2>&1 | tee $OUT/train_step_long.txt | grep -v "^speed-up" | tail -12; date
