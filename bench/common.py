"""Shared benchmarking helpers: timing, environment stamp, result files."""
from __future__ import annotations

import datetime
import json
import os
import subprocess
from pathlib import Path

import torch

RESULTS = Path(__file__).resolve().parent / "results"


def median_ms(fn, warmup_ms: float = 50, rep_ms: float = 250) -> float:
    """Median wall time of fn() on the current stream, in ms (triton.testing.do_bench when present)."""
    try:
        from triton.testing import do_bench
        return float(do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median"))
    except ImportError:  # CUDA events fallback
        return events_ms(fn)


def events_ms(fn, iters: int = 30, warmup: int = 5) -> float:
    """Median of CUDA-event times of fn(), one call at a time (synchronized: host launch costs included)."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b))
    times.sort()
    return times[len(times) // 2]


def graph_ms(fn, timer=median_ms) -> float:
    """timer() of fn replayed from a CUDA graph (captured after one warm-up call on a side stream): the
    call's GPU time without host work, as a serving loop that captures its decode step sees it."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return timer(g.replay)


def commit() -> str:
    env = os.environ.get("MLA_COMMIT")
    if env:
        return env
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True,
                             cwd=Path(__file__).resolve().parent)
        return out.stdout.strip()
    except Exception:
        return "unknown"


def stamp() -> dict:
    dev = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "gpu": dev,
        "capability": list(torch.cuda.get_device_capability()) if torch.cuda.is_available() else None,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version() if torch.cuda.is_available() else None,
        "commit": commit(),
    }


def write(name: str, payload: dict, out_dir: Path | None = None) -> Path:
    out_dir = Path(out_dir or RESULTS)
    out_dir.mkdir(parents=True, exist_ok=True)
    day = payload.get("date", "")[:10]
    gpu = payload.get("gpu", "gpu").replace(" ", "-")
    path = out_dir / f"{name}-{day}-{gpu}-{payload.get('commit', 'x')}.json"
    path.write_text(json.dumps(payload, indent=1))
    return path
