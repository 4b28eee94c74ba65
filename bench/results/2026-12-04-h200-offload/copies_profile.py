"""Where an offloaded step's time goes: one profiled step (torch.profiler) of a 6-layer Qwen2.5-7B-shaped stack at
19,679 tokens, kept attention + mlp_in, offloaded (the first 4 layers keeping a module) against not; per stream: the
copies' bytes, busy time and GB/s, and the compute stream's busy time."""
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

import torch  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402

import train_step as ts  # noqa: E402

lengths = torch.randint(512, 4097, (8,), generator=torch.Generator().manual_seed(0)).tolist()
model = ts.build_model(ts.QWEN25_7B, 6, 4096, torch.bfloat16, torch.device("cuda"))
model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
batch = ts.Batch(lengths, 151643, torch.device("cuda"), seed=1)
step = ts.make_step(model, batch, "packed", "auto", True)
out = {}
for name in ("tfcompat_fused[auto]@attention+mlp_in+logits", "tfcompat_fused[auto]@attention+mlp_in+offload:4+logits"):
    with ts.variant(model, name, "sdpa", True):
        for _ in range(3):
            step()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            step()
            torch.cuda.synchronize()
    streams = {}
    t0, t1 = float("inf"), 0.0
    for e in prof.events():
        if e.device_type != torch.autograd.DeviceType.CUDA:
            continue
        key = (e.name.split(" ")[0][:40] if "Memcpy" in e.name else "kernels")
        s = streams.setdefault(key, {"us": 0.0, "n": 0})
        s["us"] += e.time_range.elapsed_us()
        s["n"] += 1
        t0, t1 = min(t0, e.time_range.start), max(t1, e.time_range.end)
    out[name] = {"span_ms": (t1 - t0) / 1e3, "streams": streams}
    print(name, json.dumps(out[name]), flush=True)
    model.zero_grad(set_to_none=True)
json.dump(out, open(sys.argv[1], "w"), indent=1)
