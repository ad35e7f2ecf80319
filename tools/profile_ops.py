#!/usr/bin/env python
"""Where the time of one call goes: per-kernel GPU times (torch.profiler) beside the call's wall time.

A benchmark says how long a call takes; this says which kernels make up that time and how much is
left between them (launch gaps, host work). One workload per flag, all on the current CUDA device:

    python tools/profile_ops.py --attention 128 causal   # fwd+bwd through mla_autograd.attention, B=2 H=16 S=8192
    python tools/profile_ops.py --bwd 192 causal         # the backward alone, three timers, ours beside cuDNN
    python tools/profile_ops.py --harness 192 causal     # bench_attention's backward row beside this file's timing
    python tools/profile_ops.py --decode 4 32768 16      # decode(): B, S, H (page 64, bf16)
    python tools/profile_ops.py --launch-overhead        # host time per launch of the layer's small kernels
    python tools/profile_ops.py --mla-bwd-ab             # mla_attention_packed's backward in place vs concatenated
    python tools/profile_ops.py --layer [--compile]      # nn layer train step, ours and transformers' sdpa,
                                                         # with the GPU's idle gaps and what the host did

For each it prints the call's median time (CUDA events, synchronized per call; for decode also replayed
from a CUDA graph), the time per call queued back to back beside the summed kernel time of one call, and
the top kernels by total time.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import mla_autograd as M  # noqa: E402
from common import device_kernels, events_ms, graph_ms, kernel_split, median_ms  # noqa: E402


def queued_ms(fn, iters=10) -> float:
    """Mean time per call with the calls queued back to back (no sync between them)."""
    fn()
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(iters):
        fn()
    b.record()
    torch.cuda.synchronize()
    return a.elapsed_time(b) / iters


def kernel_table(label: str, fn, iters=5, top=12) -> None:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    wall = queued_ms(fn, iters)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            fn()
        torch.cuda.synchronize()
    kernels = device_kernels(prof, iters)
    total = sum(r[0] for r in kernels)
    split = kernel_split(kernels)
    print(f"\n[{label}] per call: {wall:.3f} ms queued back to back, of which kernels {total / 1e3:.3f} ms "
          f"(GEMM {split['gemm_ms']:.3f}, attention {split['attention_ms']:.3f}, other {split['other_ms']:.3f})")
    for us, cnt, name in kernels[:top]:
        print(f"  {us / 1e3:9.3f} ms  x{cnt:<5.1f} {name[:110]}")


def attention_inputs(dims: int, B: int = 2, H: int = 16, S: int = 8192):
    """q, k, v (leaves requiring grad) and dO, bf16 (B, S, H, D) on the GPU, for DIMS in 192/128/64."""
    dqk, dv = {192: (192, 128), 128: (128, 128), 64: (64, 64)}[dims]
    q = torch.randn(B, S, H, dqk, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(B, S, H, dqk, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn(B, S, H, dv, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    do = torch.randn(B, S, H, dv, device="cuda", dtype=torch.bfloat16)
    return q, k, v, do


def run_attention(dims: int, causal: bool) -> None:
    q, k, v, do = attention_inputs(dims)
    dqk, dv = q.shape[-1], v.shape[-1]

    def fwd():
        with torch.no_grad():
            M.attention(q, k, v, causal=causal)

    def fwd_bwd():
        o = M.attention(q, k, v, causal=causal)
        torch.autograd.grad(o, (q, k, v), do)

    tf, tfb = events_ms(fwd), events_ms(fwd_bwd)
    print(f"attention {dqk}/{dv} causal={causal}: fwd {tf:.3f} ms, fwd+bwd {tfb:.3f} ms (bwd by difference "
          f"{tfb - tf:.3f} ms)")
    kernel_table("attention fwd+bwd", fwd_bwd)


def sustained(fn, seconds: float) -> dict:
    """fn() queued back to back for `seconds` while nvidia-smi samples board power and SM clock every
    100 ms (common.PowerSampler): ms per call, mean W and MHz after the first second (the power cap acts
    within it), J per call. A long training run sees this state, not the boost clock of a short timer."""
    import time
    from common import PowerSampler
    sampler = PowerSampler(period_ms=100)
    torch.cuda.synchronize()
    t0 = time.time()
    calls, t_mark, calls_mark = 0, None, 0
    while True:
        for _ in range(5):
            fn()
        calls += 5
        torch.cuda.synchronize()
        t = time.time()
        if t_mark is None and t - t0 >= 1.0:
            t_mark, calls_mark = t, calls
        if t - t0 >= seconds:
            break
    sampler.close()
    steady = sampler.window(t_mark, t) or sampler.window(t0, t) or {"power_w": float("nan"), "sm_mhz": float("nan")}
    ms = (t - t_mark) / (calls - calls_mark) * 1e3
    return {"ms": ms, "W": steady["power_w"], "MHz": steady["sm_mhz"], "J": steady["power_w"] * ms / 1e3}


def cudnn_backward(q, k, v, do, causal: bool, scale: float):
    """SDPA cuDNN's backward alone, from one saved forward graph on (B, H, S, D) copies of q, k, v and dO
    (the (B, S, H, D) tensors ours takes), with bench_attention's cuDNN peer as the forward."""
    import bench_attention as BA
    qt, kt, vt = (t.detach().transpose(1, 2).contiguous().requires_grad_() for t in (q, k, v))
    dot = do.transpose(1, 2).contiguous()
    ot = BA.peers(["sdpa_cudnn"])["sdpa_cudnn"](qt, kt, vt, causal, scale)
    return lambda: torch.autograd.grad(ot, (qt, kt, vt), dot, retain_graph=True)


def reference_out_lse(q, k, v, causal: bool, scale: float):
    """out (in q's dtype) and lse of mla_autograd.reference's forward, top-left causal: what a backward needs,
    without building a forward kernel. Empties the allocator's cache after (the reference materializes S)."""
    from mla_autograd import reference
    with torch.no_grad():
        o, lse = reference.attention_forward(q, k, v, softmax_scale=scale, causal=causal, bottom_right=False)
    torch.cuda.empty_cache()
    return o.to(q.dtype), lse


def entry_backward(ext, q, k, v, do, o, lse, causal: bool, scale: float):
    """The kernel family's own backward entry as a callable: no Python dispatch, preallocated dq/dk/dv,
    dense (no varlen), top-left causal, not deterministic."""
    q, k, v, o = (t.detach() for t in (q, k, v, o))
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    return lambda: ext.bwd(do, q, k, v, o, lse, dq, dk, dv, None, None, None, None, scale, causal, False, False)


def run_bwd(dims: int, causal: bool, kernel_only: bool = False, sustain: float = 0.0) -> None:
    """The backward alone (one saved forward graph), for mla_autograd.attention, the kernel family's own
    entry point (no Python, preallocated outputs) and SDPA cuDNN, each under three timers: triton's
    do_bench (the L2 flushed before every call: bench_attention's timer), calls queued back to back
    (no flush), and one call at a time (synchronized). A gap between the API and the kernel entry that
    only one timer shows is the timer's; one that all show is ours. kernel_only: the kernel entry and cuDNN
    only, with out/lse from the reference forward (needs no forward kernel: quick A/B builds of the backward)."""
    from mla_autograd._build import load_family
    q, k, v, do = attention_inputs(dims)
    B, S, H, dqk = q.shape
    dv = v.shape[-1]
    scale = dqk ** -0.5
    flops = 2.5 * 2 * B * H * S * S * (dqk + dv) * (0.5 if causal else 1.0)
    if kernel_only:
        o, lse = reference_out_lse(q, k, v, causal, scale)
    else:
        o, lse = M.attention(q, k, v, causal=causal, causal_align="top_left", softmax_scale=scale, return_lse=True)
    fam = M.explain(q, k, v, causal=causal).backward.family
    ext = load_family(fam)
    fns = {} if kernel_only else {
        "api": lambda: torch.autograd.grad(o, (q, k, v), do, retain_graph=True),
    }
    fns.update({
        "kernel entry": entry_backward(ext, q, k, v, do, o, lse, causal, scale),
        "sdpa_cudnn": cudnn_backward(q, k, v, do, causal, scale),
    })
    if not kernel_only:  # the same entry on the reference forward's out/lse: isolates the saved tensors
        fns["entry, ref o/lse"] = entry_backward(ext, q, k, v, do, *reference_out_lse(q, k, v, causal, scale),
                                                 causal, scale)
    print(f"\nbackward alone {dqk}/{dv} causal={causal} B={B} H={H} S={S} (ms; TF/s at 2.5x fwd FLOPs)")
    for name, fn in fns.items():
        t = {"do_bench": median_ms(fn), "queued": queued_ms(fn, 20), "synced": events_ms(fn, iters=20)}
        print(f"  {name:<14}" + "".join(f"{k_} {v_:.3f} ({flops / v_ / 1e9:.0f})  " for k_, v_ in t.items()))
    for name in ("kernel entry" if kernel_only else "api", "sdpa_cudnn"):
        kernel_table(f"bwd {name}", fns[name])
    if sustain > 0:
        print(f"sustained {sustain:.0f} s per run, alternating (ms per call, board W, SM MHz, J per call):")
        for rnd in range(2):
            for name in ("kernel entry", "sdpa_cudnn") if rnd == 0 else ("sdpa_cudnn", "kernel entry"):
                r = sustained(fns[name], sustain)
                print(f"  {name:<14} {r['ms']:.3f} ms ({flops / r['ms'] / 1e9:.0f} TF/s)  {r['W']:.0f} W  "
                      f"{r['MHz']:.0f} MHz  {r['J']:.3f} J")


def run_harness(dims: int, causal: bool, reps: int = 3) -> None:
    """bench_attention's backward row beside this file's timing of the same call, interleaved in one
    process: bench_attention read our 192/128 causal backward 4-6% slower than profile_ops at the same
    SM clock while cuDNN read the same in both. Each rep times, with do_bench: (a) this
    file's setup (one set of inputs, ours then cuDNN), (b) the same after torch.cuda.empty_cache(),
    (c) bench_attention.bench_one (fresh inputs, a no-grad forward first, empty_cache between impls),
    alternating the order of the implementations."""
    import bench_attention as BA
    dqk, dv = {192: (192, 128), 128: (128, 128), 64: (64, 64)}[dims]
    scale = dqk ** -0.5
    impls = {"mla_autograd": BA.ours, **BA.peers(["sdpa_cudnn"])}

    def ours_and_cudnn(clear: bool):
        q, k, v, do = attention_inputs(dims)
        o = BA.ours(q, k, v, causal, scale)
        cudnn = cudnn_backward(q, k, v, do, causal, scale)
        if clear:
            torch.cuda.empty_cache()
        return (median_ms(lambda: torch.autograd.grad(o, (q, k, v), do, retain_graph=True)), median_ms(cudnn))

    print(f"\nharness check {dqk}/{dv} causal={causal}: backward ms (do_bench), ours / cuDNN")
    for r in range(reps):
        a = ours_and_cudnn(False)
        b = ours_and_cudnn(True)
        order = list(impls.items()) if r % 2 == 0 else list(impls.items())[::-1]
        rows = {x["impl"]: x.get("bwd_ms", float("nan"))
                for x in BA.bench_one(2, 16, 8192, dqk, dv, causal, dict(order), do_fwd=False)}
        print(f"  rep {r}: profile {a[0]:.3f} / {a[1]:.3f}   after empty_cache {b[0]:.3f} / {b[1]:.3f}   "
              f"bench_one ({order[0][0]} first) {rows['mla_autograd']:.3f} / {rows['sdpa_cudnn']:.3f}")


def trace_events(prof) -> list[dict]:
    """The events of a finished torch.profiler run, as its Chrome trace lists them (written to a temporary file)."""
    import json
    import os
    import tempfile
    path = os.path.join(tempfile.mkdtemp(), "trace.json")
    prof.export_chrome_trace(path)
    with open(path) as f:
        return json.load(f)["traceEvents"]


def flushed_timeline(label: str, fn, iters: int = 20, flush_mb: int = 256) -> None:
    """The kernels of one call as bench_decode's timer sees it (triton do_bench: the L2 flushed by zeroing a
    256 MB buffer before every call): per kernel, the median start after the flush kernel ended and the
    median duration, and the median span from the flush's end to the call's last kernel end."""
    import statistics
    flush = torch.empty(flush_mb << 20, dtype=torch.int8, device="cuda")
    for _ in range(3):
        flush.zero_()
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            flush.zero_()
            fn()
        torch.cuda.synchronize()
    events = [e for e in trace_events(prof) if e.get("cat") == "kernel"]
    events.sort(key=lambda e: e["ts"])
    calls, cur = [], None
    for e in events:
        if "elementwise" in e["name"] or "fill" in e["name"].lower():  # the flush (zero_) starts a call
            cur = {"t0": e["ts"] + e["dur"], "kernels": []}
            calls.append(cur)
        elif cur is not None:
            cur["kernels"].append(e)
    calls = [c for c in calls if c["kernels"]]
    if not calls:
        print(f"[{label}] flushed timeline: no kernels found")
        return
    spans = [max(k["ts"] + k["dur"] for k in c["kernels"]) - c["t0"] for c in calls]
    print(f"[{label}] after an L2 flush ({len(calls)} calls): median span flush end -> last kernel end "
          f"{statistics.median(spans):.1f} us")
    n = min(len(c["kernels"]) for c in calls)
    for i in range(n):
        starts = [c["kernels"][i]["ts"] - c["t0"] for c in calls]
        durs = [c["kernels"][i]["dur"] for c in calls]
        print(f"  start {statistics.median(starts):7.1f} us  dur {statistics.median(durs):7.1f} us  "
              f"{calls[0]['kernels'][i]['name'][:100]}")


def gap_timeline(label: str, fn, min_gap_us: float = 8.0, top: int = 25, full: bool = False) -> None:
    """Where the GPU sits idle during one call: the gaps between its consecutive kernels (copies, memsets)
    longer than min_gap_us, each with the kernel after it, the host ops open when that kernel was launched
    (innermost last) and how long after the previous kernel's end the launch came (positive: the host was
    late, the gap is host time; negative: the kernel waited on something else). Host syncs in the call
    (cudaStreamSynchronize, cudaDeviceSynchronize, blocking memcpy) are listed with their host duration.
    full: every kernel in order, with its start, the gap before it and its launch time (host clock), all in
    us from the first kernel's start."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    events = [e for e in trace_events(prof) if e.get("ph") == "X"]
    device = sorted((e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")),
                    key=lambda e: e["ts"])
    # launches by the runtime (cudaLaunchKernel) or the driver (cuLaunchKernel: cuBLAS, Triton)
    launches = {e["args"].get("correlation"): e for e in events
                if e.get("cat") in ("cuda_runtime", "cuda_driver") and "args" in e}
    ops = sorted((e for e in events if e.get("cat") in ("cpu_op", "user_annotation", "python_function")),
                 key=lambda o: o["ts"])
    syncs = [e for e in events if e.get("cat") == "cuda_runtime"
             and any(s in e["name"] for s in ("Synchronize", "cudaMemcpy(", "cudaMemcpy "))]
    if not device:
        print(f"[{label}] gap timeline: no kernels recorded")
        return
    t0 = device[0]["ts"]
    busy = sum(e["dur"] for e in device)
    span = device[-1]["ts"] + device[-1]["dur"] - t0
    rows = []
    prev_end = None
    for e in device:
        gap = 0.0 if prev_end is None else e["ts"] - prev_end
        launch = launches.get(e.get("args", {}).get("correlation"))
        stack, late, at = [], None, None
        if launch is not None:
            t = launch["ts"]
            at = t - t0
            stack = [o["name"] for o in ops if o["ts"] <= t <= o["ts"] + o["dur"]]
            # host and device events share the trace's time base (kineto aligns the clocks)
            if prev_end is not None:
                late = t + launch["dur"] - prev_end
        rows.append((e["ts"] - t0, gap, e["dur"], at, late, e["name"], stack))
        prev_end = e["ts"] + e["dur"]
    gaps = [r for r in rows if r[1] >= min_gap_us]
    idle = sum(r[1] for r in gaps)
    print(f"\n[{label}] one call: first kernel start -> last kernel end {span / 1e3:.3f} ms, kernels "
          f"{busy / 1e3:.3f} ms, {len(gaps)} gaps over {min_gap_us:g} us totalling {idle / 1e3:.3f} ms")
    for e in syncs:
        print(f"  host sync {e['name']} {e['dur']:.1f} us")

    def where(stack):
        return " > ".join(s[:40] for s in stack[-3:]) if stack else "?"

    for start, gap, dur, at, late, name, stack in sorted(gaps, key=lambda r: -r[1])[:top]:
        late_s = f"{late:+7.1f}" if late is not None else "      ?"
        print(f"  gap {gap:7.1f} us  launch vs prev end {late_s} us  before {name[:50]:50s}  [{where(stack)}]")
    if full:
        print(f"  {'start':>8s} {'gap':>7s} {'dur':>7s} {'launch':>8s}  kernel  [host ops at launch]")
        for start, gap, dur, at, late, name, stack in rows:
            at_s = f"{at:8.1f}" if at is not None else "       ?"
            print(f"  {start:8.1f} {gap:7.1f} {dur:7.1f} {at_s}  {name[:44]:44s} [{where(stack)}]")


def host_profile(label: str, fn, top: int = 30) -> None:
    """Host time of one call (perf_counter, no sync inside: what the host spends issuing it) beside its GPU
    time, and a cProfile of the call by cumulative time."""
    import cProfile
    import pstats
    import time
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    host = []
    for _ in range(5):
        t = time.perf_counter()
        fn()
        host.append((time.perf_counter() - t) * 1e3)
        torch.cuda.synchronize()
    host.sort()
    print(f"\n[{label}] host time to issue one call: median {host[2]:.3f} ms (min {host[0]:.3f})")
    pr = cProfile.Profile()
    pr.enable()
    fn()
    pr.disable()
    torch.cuda.synchronize()
    pstats.Stats(pr).sort_stats("cumulative").print_stats(top)


def launch_overhead(calls: int = 200, top: int = 18) -> None:
    """Host microseconds per call of the MLA layer's small launches, each queued `calls` times without a sync (the
    launch queue never fills at these sizes, so the host never waits): an aten op and a cuBLAS GEMM for scale, the
    Triton rotary and RMSNorm kernels through the layer's entry points, and a cProfile of the Triton calls by
    internal time (us per call), which says where their host time goes."""
    import cProfile
    import pstats
    import time
    from mla_autograd.nn import MultiHeadLatentAttention
    from mla_autograd.nn.rope import apply_rotary
    dev, dt = torch.device("cuda"), torch.bfloat16
    x = torch.randn(64, 1536, device=dev, dtype=dt)
    w = torch.randn(64, 1536, device=dev, dtype=dt)
    q = torch.randn(1, 16, 128, 192, device=dev, dtype=dt)
    ang = torch.rand(16, 32, device=dev)
    cos, sin = ang.cos(), ang.sin()
    layer = MultiHeadLatentAttention(7168, 128, q_lora_rank=1536, device=dev, dtype=dt)
    norm = layer.q_a_layernorm
    cases = {
        "aten mul": lambda: x.mul(2.0),
        "cuBLAS linear (64 x 1536 x 64)": lambda: torch.nn.functional.linear(x, w),
        "rotary (Triton), apply_rotary keep=128": lambda: apply_rotary(q, cos[:, None], sin[:, None], interleaved=True,
                                                                      keep=128),
        "RMSNorm forward (Triton), no grad": lambda: norm(x),
    }
    print(f"\nhost us per call ({calls} calls queued, no sync):")
    with torch.no_grad():
        for name, fn in cases.items():
            for _ in range(5):
                fn()
            torch.cuda.synchronize()
            best = float("inf")
            for _ in range(3):
                t = time.perf_counter()
                for _ in range(calls):
                    fn()
                best = min(best, (time.perf_counter() - t) / calls * 1e6)
                torch.cuda.synchronize()
            print(f"  {best:8.1f} us  {name}")
    # the layer's own forward, piece by piece: host time of each part of one call with grad on (what the
    # training step's forward issues), queued behind nothing
    h = torch.randn(1, 4096, 7168, device=dev, dtype=dt, requires_grad=True)
    pieces = ("_queries", "_latents", "rotary q", "rotary k_pe", "_attend", "o_proj")
    spent = {p: [] for p in pieces}

    def timed(obj, attr, key):
        fn = getattr(obj, attr)

        def wrapper(*a, **k):
            t = time.perf_counter()
            r = fn(*a, **k)
            spent[key].append((time.perf_counter() - t) * 1e6)
            return r
        setattr(obj, attr, wrapper)

    timed(layer, "_queries", "_queries")
    timed(layer, "_latents", "_latents")
    timed(layer.rotary, "rotate_heads", "rotary q")
    timed(layer.rotary, "rotate", "rotary k_pe")
    timed(layer, "_attend", "_attend")
    timed(layer.o_proj, "forward", "o_proj")
    total = []
    for _ in range(8):
        torch.cuda.synchronize()
        t = time.perf_counter()
        y = layer(h)
        total.append((time.perf_counter() - t) * 1e6)
        torch.cuda.synchronize()
        del y
    print(f"\nlayer forward with grad (B=1, S=4096), host us per call: total {sorted(total)[4]:.0f}; " +
          ", ".join(f"{p} {sorted(v)[len(v) // 2]:.0f}" for p, v in spent.items()))
    with torch.no_grad():
        for name in ("rotary (Triton), apply_rotary keep=128", "RMSNorm forward (Triton), no grad"):
            pr = cProfile.Profile()
            pr.enable()
            for _ in range(calls):
                cases[name]()
            pr.disable()
            torch.cuda.synchronize()
            print(f"\n[{name}] cProfile, {calls} calls, by internal time (seconds over all calls):")
            pstats.Stats(pr).sort_stats("tottime").print_stats(top)


def mla_bwd_ab(rounds: int = 3) -> None:
    """mla_attention_packed forward + backward at the MLA layer's shape (B=1, S=4096, 128 heads, causal, bf16; the
    roped query [q_nope | q_pe] and the key/value projection [k_nope | v] whole, k_pe the rope slice of the latent
    row, as the layer passes them) with its backward reading the parts in place (the mla_bwd sm90 row) and with
    that row passed over (the saved parts concatenated for attn_bwd), alternating rounds in one process: per-call
    medians and each one's kernels."""
    from mla_autograd import _ops
    from mla_autograd._dispatch import Decision
    dev, dt = torch.device("cuda"), torch.bfloat16
    B, S, H = 1, 4096, 128
    torch.manual_seed(0)
    q = torch.randn(B, S, H, 192, device=dev, dtype=dt, requires_grad=True)
    kv = torch.randn(B, S, H, 256, device=dev, dtype=dt, requires_grad=True)
    latent = torch.randn(B, S, 576, device=dev, dtype=dt, requires_grad=True)
    dout = torch.randn(B, S, H, 128, device=dev, dtype=dt)
    native_select = _ops.select

    def concat_select(call):
        if call.op == "mla_bwd":
            return Decision("mla_bwd", "concat", None, (("sm90", "passed over for the A/B"),))
        return native_select(call)

    def step():
        for t in (q, kv, latent):
            t.grad = None
        M.mla_attention_packed(q, kv, latent[..., 512:].unsqueeze(2), causal=True).backward(dout)

    times = {"native": [], "concat": []}
    try:
        for _ in range(rounds):
            for name, sel in (("native", native_select), ("concat", concat_select)):
                _ops.select = sel
                times[name].append(events_ms(step, iters=20))
        print("\nmla_attention_packed fwd+bwd at the layer's shape, ms per call (rounds): " +
              "; ".join(f"{k} {min(v):.3f}-{max(v):.3f} (median {sorted(v)[len(v) // 2]:.3f})" for k, v in times.items()))
        for name, sel in (("native", native_select), ("concat", concat_select)):
            _ops.select = sel
            kernel_table(f"mla_attention_packed fwd+bwd, backward {name}", step, iters=3, top=10)
    finally:
        _ops.select = native_select


def run_decode(B: int, S: int, H: int) -> None:
    from mla_autograd._build import load_family
    ext = load_family("mla_decode_sm80")
    page, dt = 64, torch.bfloat16
    P = B * (S // page) + 1
    buf = torch.randn(P, page, 576, dtype=dt, device="cuda")
    table = torch.randperm(P, device="cuda")[: B * (S // page)].view(B, -1).to(torch.int32).contiguous()
    qn = torch.randn(B, 1, H, 512, dtype=dt, device="cuda")
    qp = torch.randn(B, 1, H, 64, dtype=dt, device="cuda")
    lens = torch.full((B,), S, dtype=torch.int32, device="cuda")
    out = torch.empty(B, 1, H, 512, dtype=dt, device="cuda")
    lse = torch.empty(B, H, 1, dtype=torch.float32, device="cuda")
    fn = lambda: ext.decode(qn, qp, buf[..., :512], buf[..., 512:], table, lens, out, lse, 192 ** -0.5, False)  # noqa: E731
    gb = B * S * 576 * 2 / 1e9
    te, tg = events_ms(fn, iters=50), graph_ms(fn, timer=lambda f: events_ms(f, iters=50))
    print(f"decode B={B} S={S} H={H}: stream {te * 1e3:.1f} us ({gb / te * 1e3:.0f} GB/s), CUDA graph "
          f"{tg * 1e3:.1f} us ({gb / tg * 1e3:.0f} GB/s)")
    kernel_table("decode", fn, iters=20)
    flushed_timeline(f"decode B={B} S={S} H={H}", fn)
    sched = ext.decode_schedule(lens, 1, H)
    fs = lambda: ext.decode(qn, qp, buf[..., :512], buf[..., 512:], table, lens, out, lse, 192 ** -0.5, False,  # noqa: E731
                            schedule=sched)
    flushed_timeline(f"decode B={B} S={S} H={H}, precomputed schedule", fs)


def run_layer(compiled: bool = False) -> None:
    """compiled: the layer calls of both sides under torch.compile (bench_layer.compile_call, as its --compile
    rows run them), each compiled in its warmup calls."""
    import bench_layer as BL
    a = argparse.Namespace(hidden=7168, heads=128, q_lora_rank=1536, kv_lora_rank=512,
                                                  nope=128, rope=64, v=128, batch=1, seqlen=4096)
    dev, dt = torch.device("cuda"), torch.bfloat16
    torch.manual_seed(0)
    ours = BL.make_ours(a, dev, dt)
    x = torch.randn(1, 4096, a.hidden, device=dev, dtype=dt, requires_grad=True)
    dy = torch.randn_like(x)

    def step(layer, call):
        layer.zero_grad(set_to_none=True)
        x.grad = None
        call(layer, x).backward(dy)

    wrap = BL.compile_call if compiled else (lambda c: c)
    tag = " (compiled)" if compiled else ""
    ours_call = wrap(lambda m, h: m(h))
    f = lambda: step(ours, ours_call)  # noqa: E731
    print(f"layer train step, ours{tag}: {events_ms(f, iters=10):.3f} ms")
    kernel_table("layer ours", f, iters=3, top=25)
    gap_timeline("layer ours", f, full=True)
    with torch.no_grad():
        host_profile("layer ours, forward (no grad)", lambda: ours(x))
    host_profile("layer ours, train step", f)
    if BL.transformers is None:
        return
    state = {k_: v_.detach().clone() for k_, v_ in ours.state_dict().items()}
    ours = None
    cfg = BL.hf_config(a, "sdpa")
    hf = BL.DeepseekV3Attention(cfg, layer_idx=0).to(dev, dt)
    hf.load_state_dict(state, strict=True)
    rot = BL.DeepseekV3RotaryEmbedding(cfg).to(dev)
    pos = torch.arange(4096, device=dev)[None]
    hf_call = wrap(lambda m, h: m(h, rot(h, pos), None)[0])
    g = lambda: step(hf, hf_call)  # noqa: E731
    print(f"layer train step, transformers sdpa{tag}: {events_ms(g, iters=10):.3f} ms")
    kernel_table("layer transformers sdpa", g, iters=3, top=25)
    gap_timeline("layer transformers sdpa", g)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--attention", nargs=2, metavar=("DIMS", "MASK"), action="append", default=[],
                    help="DIMS in 192/128/64, MASK causal|full")
    ap.add_argument("--bwd", nargs=2, metavar=("DIMS", "MASK"), action="append", default=[],
                    help="the backward alone: DIMS in 192/128/64, MASK causal|full")
    ap.add_argument("--kernel-only", action="store_true", help="--bwd: kernel entry and cuDNN only (no forward kernel)")
    ap.add_argument("--sustain", type=float, default=0.0, metavar="SECONDS",
                    help="--bwd: also run each backward back to back this long, twice, alternating, with board "
                         "power and SM clock (nvidia-smi): under the H200's power cap speed follows energy per call")
    ap.add_argument("--harness", nargs=2, metavar=("DIMS", "MASK"), action="append", default=[],
                    help="bench_attention's backward row beside this file's timing of it, in one process")
    ap.add_argument("--decode", nargs=3, type=int, metavar=("B", "S", "H"), action="append", default=[])
    ap.add_argument("--layer", action="store_true")
    ap.add_argument("--compile", action="store_true", help="--layer: both sides' layer calls under torch.compile")
    ap.add_argument("--mla-bwd-ab", action="store_true",
                    help="mla_attention_packed fwd+bwd at the layer's shape, backward in place vs concatenated, alternating")
    ap.add_argument("--launch-overhead", action="store_true",
                    help="host time per launch of the layer's small kernels (Triton rotary / RMSNorm, aten, cuBLAS)")
    args = ap.parse_args(argv)
    for dims, mask in args.attention:
        run_attention(int(dims), mask == "causal")
    for dims, mask in args.bwd:
        run_bwd(int(dims), mask == "causal", args.kernel_only, args.sustain)
    for dims, mask in args.harness:
        run_harness(int(dims), mask == "causal")
    for B, S, H in args.decode:
        run_decode(B, S, H)
    if args.layer:
        run_layer(compiled=args.compile)
    if args.launch_overhead:
        launch_overhead()
    if args.mla_bwd_ab:
        mla_bwd_ab()


if __name__ == "__main__":
    main()
