"""Host time of the public calls, where their kernels are short enough for it to show: many decode calls
(B=4, S=32768, H=16, page 64: a ~60 us kernel), without and with a precomputed schedule, beside the
extension call alone and a cProfile of the public call.

    python tools/profile_host.py [--calls N] [--rounds R] [--top K]

Host microseconds per call: N calls queued without a synchronisation (N small enough that the launch queue
never fills, so the host never waits for the GPU), the median over R rounds; the wall time per call of the
same rounds (the GPU's time, when it is the slower side).
"""
from __future__ import annotations

import argparse
import cProfile
import math
import pstats
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import mla_autograd as M  # noqa: E402
from mla_autograd._build import load_family  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--calls", type=int, default=100)
    ap.add_argument("--rounds", type=int, default=21)
    ap.add_argument("--top", type=int, default=14)
    a = ap.parse_args()
    B, S, H, page = 4, 32768, 16, 64
    buf = torch.randn(B * S // page + 1, page, 576, dtype=torch.bfloat16, device="cuda")
    ckv, kpe = buf[..., :512], buf[..., 512:]
    table = torch.randperm(B * S // page, device="cuda").view(B, -1).to(torch.int32)
    qn = torch.randn(B, 1, H, 512, dtype=torch.bfloat16, device="cuda")
    qp = torch.randn(B, 1, H, 64, dtype=torch.bfloat16, device="cuda")
    lens = torch.full((B,), S, dtype=torch.int32, device="cuda")
    scale = 1 / math.sqrt(192)
    ext = load_family("mla_decode_sm80")
    out = torch.empty(B, 1, H, 512, dtype=torch.bfloat16, device="cuda")
    lse = torch.empty(B, H, 1, dtype=torch.float32, device="cuda")
    with torch.inference_mode():
        sched = M.decode_schedule(lens, seqlen_q=1, num_heads=H)
        calls = {
            "extension decode": lambda: ext.decode(qn, qp, ckv, kpe, table, lens, out, lse, scale, True, schedule=None),
            "extension decode, allocating": lambda: ext.decode(qn, qp, ckv, kpe, table, lens, None, None, scale, True,
                                                               schedule=None),
            "public decode": lambda: M.decode(qn, qp, ckv, kpe, table, lens, softmax_scale=scale),
            "public decode, schedule": lambda: M.decode(qn, qp, ckv, kpe, table, lens, softmax_scale=scale,
                                                         schedule=sched),
        }
        for name, fn in calls.items():
            for _ in range(50):
                fn()
            host, wall = [], []
            for _ in range(a.rounds):
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                for _ in range(a.calls):
                    fn()
                host.append((time.perf_counter() - t0) / a.calls * 1e6)
                torch.cuda.synchronize()
                wall.append((time.perf_counter() - t0) / a.calls * 1e6)
            print(f"{name}: host {statistics.median(host):.1f} us per call, wall {statistics.median(wall):.1f} us "
                  f"per call", flush=True)
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(a.calls):
            calls["public decode, schedule"]()
        prof.disable()
        torch.cuda.synchronize()
    pstats.Stats(prof).sort_stats("tottime").print_stats(a.top)


if __name__ == "__main__":
    main()
