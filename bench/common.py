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
        for _ in range(5):
            fn()
        torch.cuda.synchronize()
        times = []
        for _ in range(30):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            torch.cuda.synchronize()
            times.append(a.elapsed_time(b))
        times.sort()
        return times[len(times) // 2]


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
