"""The host link of the device machine: pinned copies of 1 GiB device -> host, host -> device, and both at once on two
streams (GB/s); and whether this torch takes PYTORCH_ALLOC_CONF=pinned_max_round_threshold_mb (written to argv[1])."""
import json
import subprocess
import sys

import torch

n = 1 << 30
dev = torch.empty(n, dtype=torch.uint8, device="cuda")
dev2 = torch.empty(n, dtype=torch.uint8, device="cuda")
host = torch.empty(n, dtype=torch.uint8, pin_memory=True)
host2 = torch.empty(n, dtype=torch.uint8, pin_memory=True)
s1, s2 = torch.cuda.Stream(), torch.cuda.Stream()


def timed(fn, reps=5):
    fn()
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(reps):
        fn()
    b.record()
    torch.cuda.synchronize()
    return a.elapsed_time(b) / reps / 1e3


def both():
    with torch.cuda.stream(s1):
        host.copy_(dev, non_blocking=True)
    with torch.cuda.stream(s2):
        dev2.copy_(host2, non_blocking=True)
    torch.cuda.current_stream().wait_stream(s1)
    torch.cuda.current_stream().wait_stream(s2)


out = {"d2h_GBps": n / timed(lambda: host.copy_(dev, non_blocking=True)) / 1e9,
       "h2d_GBps": n / timed(lambda: dev.copy_(host, non_blocking=True)) / 1e9,
       "both_GBps_each": n / timed(both) / 1e9}
probe = ("import torch; torch.empty(1, device='cuda'); "
         "x = torch.empty(100 << 20, dtype=torch.uint8, pin_memory=True); print('ok')")
r = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                   env={**__import__("os").environ, "PYTORCH_ALLOC_CONF": "pinned_max_round_threshold_mb:64"})
out["pinned_max_round_threshold_mb"] = r.returncode == 0 and "ok" in r.stdout
out["probe_stderr"] = r.stderr[-300:]
print(json.dumps(out))
json.dump(out, open(sys.argv[1], "w"))
