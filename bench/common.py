"""Shared benchmarking helpers: timing, the environment stamp of a run, power sampling, the kernels of a
profiled call and their kind. Results go to the results store (store.py)."""
from __future__ import annotations

import datetime
import os
import subprocess
import sys
import threading
from pathlib import Path

import torch


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


# Kernel names, matched in lower case. Attention first: our CUTLASS-built attention kernels carry "cutlass" in
# their template arguments, which would otherwise read as a GEMM.
ATTENTION_KERNELS = ("fmha", "mla_decode", "flash", "sdpa")  # ours, PyTorch's flash/mem-efficient, cuDNN's
GEMM_KERNELS = ("gemm", "gemv", "cutlass", "cublas", "xmma", "nvjet")  # cuBLAS(Lt), CUTLASS, Hopper's nvjet


def kernel_kind(name: str) -> str:
    """'attention', 'gemm' or 'other' (elementwise, reductions, copies: the glue between them)."""
    low = name.lower()
    if any(k in low for k in ATTENTION_KERNELS):
        return "attention"
    if any(k in low for k in GEMM_KERNELS):
        return "gemm"
    return "other"


def device_kernels(prof, iters: int = 1) -> list[tuple[float, float, str]]:
    """(device us per call, launches per call, name) of every kernel, copy or memset a torch.profiler run of
    `iters` calls recorded, most time first. The profiler also lists the host-side ops that launched them and
    the annotated ranges around them with the same device time: kept out, or the time would count twice."""
    from torch.autograd import DeviceType
    rows = []
    for e in prof.key_averages():
        if getattr(e, "device_type", DeviceType.CUDA) == DeviceType.CPU or getattr(e, "is_user_annotation", False):
            continue
        if e.key.startswith(("aten::", "cuda", "mla_autograd::")) or "autograd" in e.key:
            continue
        dev_us = getattr(e, "device_time_total", None)
        if dev_us is None:
            dev_us = e.cuda_time_total
        if dev_us > 0 and e.count > 0:
            rows.append((dev_us / iters, e.count / iters, e.key))
    rows.sort(reverse=True)
    return rows


def kernel_split(kernels) -> dict:
    """Milliseconds per kernel_kind of device_kernels' rows: {'gemm_ms', 'attention_ms', 'other_ms'}."""
    out = {"gemm_ms": 0.0, "attention_ms": 0.0, "other_ms": 0.0}
    for us, _, name in kernels:
        out[f"{kernel_kind(name)}_ms"] += us / 1e3
    return out


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
    """The run's key (gpu, torch, commit, date: UTC start time) and environment, for store.record."""
    dev = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "gpu": dev,
        "capability": list(torch.cuda.get_device_capability()) if torch.cuda.is_available() else None,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version() if torch.cuda.is_available() else None,
        "commit": commit(),
        "args": " ".join(sys.argv[1:]),  # the bench's command line: which mode (--sweep, --quick, ...) ran
        # the MLA_* environment this run was under
        "env": {k: v for k, v in sorted(os.environ.items())
                if k.startswith("MLA_") and k not in ("MLA_COMMIT", "MLA_AUTOGRAD_CACHE")},
    }


class PowerSampler:
    """Board power and SM clock from nvidia-smi every period_ms in the background, so that a timed window
    [t0, t1] (time.time()) can be given the clock and power it ran at. Why: a long run on the H200 sits at
    its ~700 W power cap with the SM clock below boost, and how far below depends on what ran before.
    Without nvidia-smi it records nothing and window() returns None."""

    def __init__(self, period_ms: int = 50):
        self.samples: list[tuple[float, float, float]] = []  # (unix time, SM MHz, W)
        try:
            self._proc = subprocess.Popen(
                ["nvidia-smi", "--query-gpu=timestamp,clocks.sm,power.draw", "--format=csv,noheader,nounits",
                 "-lms", str(period_ms)], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        except (FileNotFoundError, PermissionError):
            self._proc = None
            return
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        for line in self._proc.stdout:
            sample = self.parse(line)
            if sample is not None:
                self.samples.append(sample)

    @staticmethod
    def parse(line: str):
        """'2026/11/30 16:12:24.816, 1755, 692.31' -> (unix time, 1755.0, 692.31); None if malformed. The
        time stamp is nvidia-smi's own (its output reaches a pipe in bursts), local time like time.time()."""
        parts = [p.strip() for p in line.split(",")]
        if len(parts) != 3:
            return None
        try:
            t = datetime.datetime.strptime(parts[0], "%Y/%m/%d %H:%M:%S.%f").timestamp()
            return t, float(parts[1]), float(parts[2])
        except ValueError:
            return None

    def window(self, t0: float, t1: float) -> dict | None:
        s = [x for x in self.samples if t0 <= x[0] <= t1]
        if not s:
            return None
        return {"sm_mhz": sum(x[1] for x in s) / len(s), "power_w": sum(x[2] for x in s) / len(s),
                "samples": len(s)}

    def close(self) -> None:
        if self._proc is not None:
            self._proc.terminate()
            self._proc.wait()
            self._thread.join(timeout=2)
