"""The SM90 attention kernels alone (their extension entry points: no Python dispatch, preallocated outputs),
beside SDPA cuDNN in the same process, bf16 random normal inputs.

    python bench/bench_kernels.py fwd [--shape B,H,S ...] [--dims 192 ...]   # fmha_fwd_sm90 (default 2,16,8192)
    python bench/bench_kernels.py bwd [--shape B,H,S ...] [--dims 128] [--causal-only] [--no-det]  # fmha_bwd_sm90
    ... bwd --varlen longtail [--ab compact_varlen=false]                     # a packed batch; A/B of launch options
    ... fwd --varlen longtail [--ab longest_first=false]                      # the same for the forward
    ... [--l2-group N]                                                      # either, forced launch grouping
    ... fwd [--ctas N] [--dynamic 0|1]                                      # the forward's grid and tile assignment
    ... fwd --shape 16,16,1024 --ab ctas=1073741824,dynamic=false           # an A/B of launch options, dense rows

fwd: median times by triton's do_bench (50 ms warm-up, 300 ms), ours through ext.fwd, cuDNN through SDPA;
FLOPs 2*B*H*S*S*(Dqk+Dv) (halved when causal).
bwd: ext.bwd alone (preprocess + main + dQ convert) on out/lse of the reference forward (no forward kernel
needed), median of 10 CUDA-event timed calls after 3 warm-up calls, also in deterministic mode (unless
--no-det); cuDNN's backward as (fwd+bwd) - fwd in the same process; FLOPs 2.5 x the forward's.
--l2-group N forces N (head, batch) / (kv head, batch) pairs per launch group (0: all interleaved) through the
modules' fwd_with_options / bwd_with_options (the default: fwd / bwd, the launcher's choice). Both print one line
per workload (B=...) and add the run to the results store (bench/results/fwd-kernel.json, bwd-kernel.json;
bench/store.py), each row with its l2_group ("default" or N); --out FILE writes the run alone to FILE instead.
"""
from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from mla_autograd import reference  # noqa: E402
from mla_autograd._build import load_family  # noqa: E402

from common import stamp  # noqa: E402
from store import record  # noqa: E402

DEV = "cuda"


def _rand(shape, dtype, g):
    return torch.randn(shape, device=DEV, dtype=torch.float32, generator=g).to(dtype)


def _options(l2_group, ctas=None, dynamic=None):
    """The launch options dict of fwd_with_options / bwd_with_options, or None for the plain entry."""
    opts = {k: v for k, v in (("l2_group", l2_group), ("ctas", ctas), ("dynamic", dynamic)) if v is not None}
    return opts or None


def alternate(fns: dict, rounds: int, timer) -> dict:
    """Each of fns ({side: callable}) timed by timer(fn) once per round, the sides in turn within every round
    (so that clock drift falls on all of them alike); the median time per side."""
    times = {side: [] for side in fns}
    for _ in range(rounds):
        for side, fn in fns.items():
            times[side].append(timer(fn))
    return {side: sorted(ts)[len(ts) // 2] for side, ts in times.items()}


def _do_bench(fn):
    import triton.testing as tt
    return tt.do_bench(fn, warmup=50, rep=300, return_mode="median")


def bench_fwd(ext=None, B=2, H=16, S=8192, dims=((192, 128), (128, 128), (64, 64)), l2_group=None, ctas=None,
              dynamic=None, causal_only=False, ab=None, rounds=1):
    """Median times of the kernel and SDPA cuDNN in one process; prints TF/s. Returns the rows.
    l2_group: None (fwd, the launcher's grouping) or N pairs per L2 launch group (fwd_with_options); ctas: None
    (the launcher's grid) or a grid of N CTAs (fwd_with_options; more than the tiles: one CTA per tile); dynamic:
    None (the launcher's tile assignment) or True / False (dynamic / static). ab: launch options timed beside
    that launch in `rounds` alternating rounds, medians per side (ours_ab_ms, ours_ab_tfs)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    ext = ext or load_family("fmha_fwd_sm90")
    rows = []
    for d, dv in dims:
        for causal in ((True,) if causal_only else (False, True)):
            g = torch.Generator(device=DEV).manual_seed(0)
            q = _rand((B, S, H, d), torch.bfloat16, g)
            k = _rand((B, S, H, d), torch.bfloat16, g)
            v = _rand((B, S, H, dv), torch.bfloat16, g)
            out = torch.empty(B, S, H, dv, device=DEV, dtype=torch.bfloat16)
            lse = torch.empty(B, H, S, device=DEV)
            scale = 1.0 / math.sqrt(d)
            args = (q, k, v, out, lse, None, None, None, None, scale, causal, True)
            opts = _options(l2_group, ctas, dynamic)
            sides = {"": (lambda: ext.fwd(*args)) if opts is None else (lambda: ext.fwd_with_options(*args, opts))}
            if ab:
                sides["_ab"] = lambda: ext.fwd_with_options(*args, {**(opts or {}), **ab})
            med = alternate(sides, rounds if ab else 1, _do_bench)
            t_ours = med[""]
            flops = 2 * B * H * S * S * (d + dv) * (0.5 if causal else 1.0)
            qt, kt, vt = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
            t_cudnn = float("nan")
            try:
                with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
                    f2 = lambda: torch.nn.functional.scaled_dot_product_attention(  # noqa: E731
                        qt, kt, vt, is_causal=causal, scale=scale)
                    f2()
                    t_cudnn = _do_bench(f2)
            except Exception as exc:  # noqa: BLE001
                print(f"cudnn failed for {d}/{dv}: {exc}")
            r = dict(B=B, H=H, S=S, d=d, dv=dv, causal=causal, l2_group="default" if l2_group is None else l2_group,
                     ctas="default" if ctas is None else ctas, dynamic="default" if dynamic is None else dynamic,
                     ours_ms=t_ours, ours_tfs=flops / t_ours / 1e9,
                     cudnn_ms=t_cudnn, cudnn_tfs=flops / t_cudnn / 1e9)
            if ab:
                t_ab = med["_ab"]
                r.update(ours_ab_ms=t_ab, ours_ab_tfs=flops / t_ab / 1e9, ab=ab)
            rows.append(r)
            print(f"B={B} H={H} S={S} {d}/{dv} causal={causal}: ours {r['ours_tfs']:.0f} TF/s "
                  f"({t_ours:.3f} ms), cuDNN {r['cudnn_tfs']:.0f} TF/s ({t_cudnn:.3f} ms), "
                  f"ratio {r['ours_tfs'] / r['cudnn_tfs']:.3f}"
                  + (f"; with {ab}: {r['ours_ab_tfs']:.0f} TF/s" if ab else ""), flush=True)
    return rows


def bench_fwd_varlen(ext, varlen, dims=((192, 128), (128, 128), (64, 64)), causal_only=False, ab=None, rounds=1,
                     seed=0):
    """ext.fwd on a packed batch of bench_attention.varlen_lengths(varlen, seed) sequences at H=16 (no cuDNN row),
    and with launch options `ab` (fwd_with_options) beside it in `rounds` alternating rounds, medians per side
    (ours_ms, ours_tflops; ours_ab_ms, ours_ab_tflops). Prints and returns the rows."""
    from bench_attention import cu_seqlens, varlen_flops_fwd, varlen_lengths
    lengths = varlen_lengths(varlen, seed)
    cu, T, H, ms = cu_seqlens(lengths, DEV), sum(lengths), 16, max(lengths)
    rows = []
    for d, dv in dims:
        for causal in ((True,) if causal_only else (False, True)):
            g = torch.Generator(device=DEV).manual_seed(0)
            q, k, v = _rand((T, H, d), torch.bfloat16, g), _rand((T, H, d), torch.bfloat16, g), _rand((T, H, dv), torch.bfloat16, g)
            out = torch.empty(T, H, dv, device=DEV, dtype=torch.bfloat16)
            lse = torch.empty(H, T, device=DEV)
            args = (q, k, v, out, lse, cu, cu, ms, ms, 1.0 / math.sqrt(d), causal, False)
            sides = {"": lambda: ext.fwd(*args)}
            if ab:
                sides["_ab"] = lambda: ext.fwd_with_options(*args, ab)
            med = alternate(sides, rounds if ab else 1, _do_bench)
            flops = varlen_flops_fwd(lengths, H, d, dv, causal)
            r = {"case": "varlen", "lengths": varlen, "seed": seed, "num_seqs": len(lengths), "tokens": T, "H": H,
                 "d": d, "dv": dv, "causal": causal}
            for side, t in med.items():
                r[f"ours{side}_ms"] = round(t, 4)
                r[f"ours{side}_tflops"] = round(flops / t / 1e9, 1)
            if ab:
                r["ab"] = ab
            print(f"varlen {varlen} ({len(lengths)} seqs, H={H}) d={d}/{dv} causal={causal}: {r}", flush=True)
            rows.append(r)
    return rows


def bench_bwd(causal_only=False, det=True, l2_group=None, varlen=None, ab=None, rounds=1, seed=0, shape=(2, 16, 8192),
              dims=((192, 128), (128, 128))):
    """ext.bwd beside cuDNN's backward, B, H, S = shape (default 2, 16, 8192), the head-dim pairs `dims`; prints and
    returns the rows.
    l2_group: None (bwd, the launcher's grouping) or N pairs per launch group (bwd_with_options). varlen: a
    packed batch of bench_attention.varlen_lengths(varlen, seed) sequences at H=16 instead (no cuDNN row). ab: launch
    options (bwd_with_options) timed beside the default launch in `rounds` alternating rounds, medians per side
    (ours_ab_ms, ours_ab_tflops)."""
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    ext_ = load_family("fmha_bwd_sm90")

    def timeit(fn, iters=10):
        for _ in range(3):
            fn()
        torch.cuda.synchronize()
        st, en = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        times = []
        for _ in range(iters):
            st.record()
            fn()
            en.record()
            torch.cuda.synchronize()
            times.append(st.elapsed_time(en))
        times.sort()
        return times[len(times) // 2] * 1e-3

    B, H, S = shape
    cases = tuple((dd, causal) for dd in dims for causal in (False, True))
    if causal_only:
        cases = tuple(c for c in cases if c[1])
    lengths = cu = None
    if varlen is not None:
        from bench_attention import cu_seqlens, varlen_flops_fwd, varlen_lengths
        lengths = varlen_lengths(varlen, seed)
        cu = cu_seqlens(lengths, DEV)
    rows = []
    for (d, dv_), causal in cases:
        torch.manual_seed(0)
        lead = (B, S) if lengths is None else (sum(lengths),)
        q = torch.randn(*lead, H, d, device=DEV, dtype=torch.bfloat16)
        k = torch.randn(*lead, H, d, device=DEV, dtype=torch.bfloat16)
        v = torch.randn(*lead, H, dv_, device=DEV, dtype=torch.bfloat16)
        dout = torch.randn(*lead, H, dv_, device=DEV, dtype=torch.bfloat16)
        scale = 1.0 / math.sqrt(d)
        opts = _options(l2_group)
        if lengths is None:
            flops = 2.5 * 2 * B * H * S * S * (d + dv_) * (0.5 if causal else 1.0)
            res = {"B": B, "H": H, "S": S}
            seqs = (None, None, None, None)
        else:
            flops = 2.5 * varlen_flops_fwd(lengths, H, d, dv_, causal)
            res = {"case": "varlen", "lengths": varlen, "seed": seed, "num_seqs": len(lengths), "tokens": sum(lengths),
                   "H": H}
            seqs = (cu, cu, max(lengths), max(lengths))
        res.update({"dqk": d, "dv": dv_, "causal": causal, "l2_group": "default" if opts is None else l2_group})
        if lengths is None:  # cuDNN: (fwd + bwd) - fwd
            qt, kt, vt = (t.transpose(1, 2).detach().requires_grad_(True) for t in (q, k, v))
            dot = dout.transpose(1, 2)
            try:
                with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                    def fwd():
                        return F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal, scale=scale)

                    def fwdbwd():
                        o = fwd()
                        torch.autograd.grad(o, (qt, kt, vt), dot)
                    t_f = timeit(fwd)
                    t_fb = timeit(fwdbwd)
                res["cudnn_bwd_tflops"] = flops / (t_fb - t_f) / 1e12
            except Exception as e:  # pragma: no cover
                res["cudnn_error"] = str(e)[:200]
            del qt, kt, vt
        out, lse = reference.attention_forward(q, k, v, softmax_scale=scale, causal=causal, bottom_right=False,
                                               cu_seqlens_q=seqs[0], cu_seqlens_k=seqs[1])
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        for det_ in (False, True) if det else (False,):
            args = (dout, q, k, v, out, lse, dq, dk, dv, *seqs, scale, causal, False, det_)
            tag = "_det" if det_ else ""
            sides = {"": opts}
            if ab:
                sides["_ab"] = {**(opts or {}), **ab}
            fns = {side: (lambda: ext_.bwd(*args)) if o is None else (lambda o=o: ext_.bwd_with_options(*args, o))
                   for side, o in sides.items()}
            for side, t in alternate(fns, rounds if ab else 1, timeit).items():
                res[f"ours{side}{tag}_ms"] = round(t * 1e3, 3)
                res[f"ours{side}{tag}_tflops"] = round(flops / t / 1e12, 1)
        if ab:
            res["ab"] = ab
        what = f"B={B} H={H} S={S}" if lengths is None else f"varlen {varlen} ({len(lengths)} seqs, H={H})"
        print(f"{what} d={d}/{dv_} causal={causal}: {res}", flush=True)
        rows.append(res)
        del q, k, v, dout, out, lse, dq, dk, dv
        torch.cuda.empty_cache()
    return rows


def parse_ab(text: str | None) -> dict | None:
    """--ab "key=value,...": launch options for fwd_with_options / bwd_with_options (values: ints; true/false)."""
    if not text:
        return None
    opts = {}
    for item in text.split(","):
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise SystemExit(f"--ab: expected key=value, got {item!r}")
        low = value.strip().lower()
        opts[key.strip()] = low == "true" if low in ("true", "false") else int(value)
    return opts


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("kernel", choices=("fwd", "bwd"))
    ap.add_argument("--shape", action="append", default=None, metavar="B,H,S", help="repeatable (default 2,16,8192)")
    ap.add_argument("--dims", action="append", type=int, default=None, help="only these Dqk (fwd: 192, 128, 64; bwd: 192, 128); repeatable")
    ap.add_argument("--causal-only", action="store_true", help="the causal workloads only")
    ap.add_argument("--no-det", action="store_true", help="bwd: not in deterministic mode too")
    ap.add_argument("--l2-group", type=int, default=None, metavar="N",
                    help="force N pairs per launch group (0: all interleaved); default: the launcher's choice")
    ap.add_argument("--ctas", type=int, default=None, metavar="N",
                    help="fwd: a grid of N CTAs (more than the tiles: one per tile); default: the launcher's grid")
    ap.add_argument("--dynamic", type=int, choices=(0, 1), default=None,
                    help="fwd: static (0) or dynamic (1) tile assignment; default: the launcher's")
    ap.add_argument("--varlen", default=None, metavar="KIND",
                    help="a packed batch (bench_attention's lengths: longtail, uniform32, uniform1024), H=16")
    ap.add_argument("--seed", type=int, default=0,
                    help="--varlen longtail: the order of the lengths in the pack (bench_attention.varlen_lengths)")
    ap.add_argument("--ab", default=None, metavar="KEY=VALUE,...",
                    help="time these launch options (bwd_with_options / fwd_with_options) beside the default "
                         "launch (fwd: the one the other options give), alternating rounds")
    ap.add_argument("--rounds", type=int, default=3, help="--ab: alternating rounds (default 3)")
    ap.add_argument("--out", default=None, help="write this run alone to this JSON file, not to the store")
    ap.add_argument("--results", default=None, help="the results store's folder (default bench/results)")
    a = ap.parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("bench_kernels needs a CUDA GPU (SM90)")
    meta = stamp()
    shapes = [tuple(int(x) for x in s.split(",")) for s in a.shape] if a.shape else [(2, 16, 8192)]
    if a.kernel == "fwd":
        dims = [dd for dd in ((192, 128), (128, 128), (64, 64)) if not a.dims or dd[0] in a.dims]
        ext = load_family("fmha_fwd_sm90")
        if a.varlen is not None:
            rows = bench_fwd_varlen(ext, a.varlen, dims=dims, causal_only=a.causal_only, ab=parse_ab(a.ab),
                                    rounds=a.rounds, seed=a.seed)
            print(f"wrote {record('fwd-kernel', meta, rows, out=a.out, results=a.results)}")
            return 0
        rows = [r for B, H, S in shapes
                for r in bench_fwd(ext, B=B, H=H, S=S, dims=dims, l2_group=a.l2_group, ctas=a.ctas,
                                   dynamic=None if a.dynamic is None else bool(a.dynamic), causal_only=a.causal_only,
                                   ab=parse_ab(a.ab), rounds=a.rounds)]
    else:
        dims = [dd for dd in ((192, 128), (128, 128)) if not a.dims or dd[0] in a.dims]
        shapes = shapes if a.varlen is None else shapes[:1]  # a packed batch has its own shape
        rows = [r for shape in shapes
                for r in bench_bwd(a.causal_only, not a.no_det, l2_group=a.l2_group, varlen=a.varlen,
                                   ab=parse_ab(a.ab), rounds=a.rounds, seed=a.seed, shape=shape, dims=dims)]
    print(f"wrote {record(f'{a.kernel}-kernel', meta, rows, out=a.out, results=a.results)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
