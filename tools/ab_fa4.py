#!/usr/bin/env python
"""One process of a kernel A/B beside FlashAttention-4: this tree's SM90 forward (kernel entry) and backward
(public API, autograd over one saved forward) timed with FA4's on the same inputs, row by row, with checksums
of every output so that two builds can be checked for the same bits. tools/ab_kernel.sh runs it in
alternating processes (FA4=1); --compare prints the rows of several runs side by side.

    PYTHONPATH=. python tools/ab_fa4.py LABEL OUT.json [--fwd] [--bwd]      # neither flag: both
    python tools/ab_fa4.py --compare A1.json B1.json A2.json B2.json      # or C1.json ...: each beside A

mla_autograd is imported from the Python path, not from this file's tree, so that a baseline tree on
PYTHONPATH runs the same script (ab_kernel.sh does this).
Needs FlashAttention-4 importable as ``flash_attn.cute`` and the fmha_fwd_sm90 / fmha_bwd_sm90 families of the
tree on the Python path. The forward rows end with bench_attention's packed "longtail" batch (31 documents, 32k
tokens, H=16; B is then the number of documents, S the packed total). TF/s as in bench/: forward
2*B*H*S*S*(Dqk+Dv) (per document for the packed batch), halved under a causal mask; backward 2.5x that. Each row
takes the better of two timings of each side (triton.testing.do_bench medians), alternated within the process.
The backward's checksums can differ in the last digits between runs of one build: its dQ partial sums are added in
arrival order (deterministic=False).
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
from pathlib import Path

import torch

#: (Dqk, Dv, B, H, S) of the forward rows: bench_attention's dense sweep (16k tokens) and the layer's shape
FWD_ROWS = [(d, dv, B, H, S) for d, dv in ((192, 128), (128, 128))
            for B, H, S in ((16, 16, 1024), (8, 16, 2048), (2, 16, 8192), (1, 128, 4096)) if not (d == 128 and H == 128)]
#: the backward rows: 128/128 long and short, 192/128 short, long and at the layer's shape
BWD_ROWS = [(128, 128, 2, 16, 8192), (128, 128, 16, 16, 1024), (192, 128, 16, 16, 1024), (192, 128, 1, 128, 4096),
            (192, 128, 2, 16, 8192), (192, 128, 8, 16, 2048)]


def _inputs(d, dv, B, H, S, grad=False):
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k = (torch.randn(B, S, H, d, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(2))
    v = torch.randn(B, S, H, dv, device="cuda", dtype=torch.bfloat16, generator=g)
    do = torch.randn(B, S, H, dv, device="cuda", dtype=torch.bfloat16, generator=g)
    return [t.requires_grad_(grad) for t in (q, k, v)] + [do]


def _time_pair(ours, peer):
    import triton.testing as tt
    t = [tt.do_bench(f, warmup=20, rep=150, return_mode="median") for f in (ours, peer, ours, peer)]
    return min(t[0], t[2]), min(t[1], t[3])


def run_fwd(label: str) -> list[dict]:
    from flash_attn.cute import flash_attn_func
    from mla_autograd._build import load_family
    ext = load_family("fmha_fwd_sm90")
    rows = []
    for d, dv, B, H, S in FWD_ROWS:
        for causal in (False, True):
            q, k, v, _ = _inputs(d, dv, B, H, S)
            out = torch.empty(B, S, H, dv, device="cuda", dtype=torch.bfloat16)
            lse = torch.empty(B, H, S, device="cuda")
            scale = 1.0 / math.sqrt(d)
            ours = lambda: ext.fwd(q, k, v, out, lse, None, None, None, None, scale, causal, True)  # noqa: E731
            peer = lambda: flash_attn_func(q, k, v, causal=causal, softmax_scale=scale)  # noqa: E731
            flops = 2 * B * H * S * S * (d + dv) * (0.5 if causal else 1.0)
            rows.append(_fwd_row(dict(label=label, pass_="fwd", d=d, dv=dv, B=B, H=H, S=S, causal=causal),
                                 ours, peer, flops, out, lse))
    return rows + run_fwd_varlen(label, ext)


def _fwd_row(row: dict, ours, peer, flops: float, out: torch.Tensor, lse: torch.Tensor) -> dict:
    """row (label, pass_ and the shape fields) completed with both sides' TF/s, timed alternately after one warm
    call each, and the checksums of the out and lse that ours writes; printed."""
    ours(), peer()
    torch.cuda.synchronize()
    to, tp = _time_pair(ours, peer)
    row.update(ours_tfs=flops / to / 1e9, fa4_tfs=flops / tp / 1e9, sums=[float(out.float().sum()), float(lse.sum())])
    _print(row)
    return row


#: (Dqk, Dv) of the packed forward rows
VARLEN_DIMS = ((192, 128), (128, 128))


def run_fwd_varlen(label: str, ext) -> list[dict]:
    """The kernel entry on bench_attention's longtail batch (this file's tree's bench/), beside FA4's varlen call."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("bench_attention", Path(__file__).resolve().parents[1] / "bench" /
                                                  "bench_attention.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    lens = bench.varlen_lengths("longtail")
    cu = bench.cu_seqlens(lens, device="cuda")
    total, longest, H = int(cu[-1]), max(lens), 16
    rows = []
    for d, dv in VARLEN_DIMS:
        for causal in (False, True):
            q, k, v, _ = _inputs(d, dv, 1, H, total)
            q, k, v = q[0], k[0], v[0]
            out = torch.empty(total, H, dv, device="cuda", dtype=torch.bfloat16)
            lse = torch.empty(H, total, device="cuda")
            scale = 1.0 / math.sqrt(d)
            ours = lambda: ext.fwd(q, k, v, out, lse, cu, cu, longest, longest, scale, causal, True)  # noqa: E731
            peer = lambda: bench._fa4_varlen(q, k, v, cu, longest, causal, scale)  # noqa: E731
            flops = bench.varlen_flops_fwd(lens, H, d, dv, causal)
            rows.append(_fwd_row(dict(label=label, pass_="fwd_varlen", d=d, dv=dv, B=len(lens), H=H, S=total,
                                      causal=causal), ours, peer, flops, out, lse))
    return rows


def run_bwd(label: str) -> list[dict]:
    from flash_attn.cute import flash_attn_func
    import mla_autograd as M
    rows = []
    for d, dv, B, H, S in BWD_ROWS:
        for causal in (False, True):
            q, k, v, do = _inputs(d, dv, B, H, S, grad=True)
            scale = 1.0 / math.sqrt(d)
            o_ours = M.attention(q, k, v, causal=causal, softmax_scale=scale)
            o_peer = flash_attn_func(q, k, v, causal=causal, softmax_scale=scale)
            o_peer = o_peer[0] if isinstance(o_peer, tuple) else o_peer
            ours = lambda: torch.autograd.grad(o_ours, (q, k, v), do, retain_graph=True)  # noqa: E731
            peer = lambda: torch.autograd.grad(o_peer, (q, k, v), do, retain_graph=True)  # noqa: E731
            grads = ours()
            peer()
            torch.cuda.synchronize()
            to, tp = _time_pair(ours, peer)
            flops = 2.5 * 2 * B * H * S * S * (d + dv) * (0.5 if causal else 1.0)
            rows.append(dict(label=label, pass_="bwd", d=d, dv=dv, B=B, H=H, S=S, causal=causal,
                             ours_tfs=flops / to / 1e9, fa4_tfs=flops / tp / 1e9,
                             sums=[float(g.float().abs().sum()) for g in grads]))
            _print(rows[-1])
            del q, k, v, do, o_ours, o_peer, grads
    return rows


def _key(r: dict) -> tuple:
    return (r["pass_"], r["d"], r["dv"], r["B"], r["H"], r["S"], r["causal"])


def _print(r: dict) -> None:
    sums = " ".join(f"{s:.6e}" for s in r["sums"])
    print(f"{r['label']} {r['pass_']} {r['d']}/{r['dv']} B={r['B']} H={r['H']} S={r['S']} causal={int(r['causal'])}: "
          f"ours {r['ours_tfs']:.0f} FA4 {r['fa4_tfs']:.0f} ratio {r['ours_tfs'] / r['fa4_tfs']:.3f} sums {sums}",
          flush=True)


def compare(paths: list[str]) -> None:
    """Per row: ours' TF/s in each run by variant (the label's first letter: A the baseline, B, C, ...), the mean
    change of each variant from A, the mean ratio to FA4 of each, and whether every run gave the same checksums."""
    by_row: dict[tuple, dict[str, list[dict]]] = {}
    for p in paths:
        for r in json.loads(Path(p).read_text()):
            by_row.setdefault(_key(r), {}).setdefault(r["label"][0], []).append(r)
    mean = lambda rs, f: statistics.mean(f(r) for r in rs)  # noqa: E731
    for key, sides in by_row.items():
        variants = sorted(sides)
        cells = [f"{v} " + ",".join(f"{r['ours_tfs']:.0f}" for r in sides[v]) for v in variants]
        line = f"{key[0]} {key[1]}/{key[2]} B={key[3]} H={key[4]} S={key[5]} causal={int(key[6])}: " + "  ".join(cells)
        if "A" in sides:
            base = mean(sides["A"], lambda r: r["ours_tfs"])
            line += "".join(f"  {v}/A {mean(sides[v], lambda r: r['ours_tfs']) / base - 1:+.3f}"
                            for v in variants if v != "A")
        line += "  vs FA4 " + " ".join(f"{v} {mean(sides[v], lambda r: r['ours_tfs'] / r['fa4_tfs']):.3f}"
                                       for v in variants)
        same = len({tuple(r["sums"]) for rs in sides.values() for r in rs}) == 1
        print(line + ("  same sums" if same else "  sums differ"))


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("label", nargs="?")
    ap.add_argument("out", nargs="?")
    ap.add_argument("--fwd", action="store_true")
    ap.add_argument("--bwd", action="store_true")
    ap.add_argument("--compare", nargs="+", metavar="JSON")
    a = ap.parse_args(argv)
    if a.compare:
        compare(a.compare)
        return
    if not (a.label and a.out):
        ap.error("LABEL and OUT.json are required (or --compare)")
    both = not (a.fwd or a.bwd)
    rows = (run_fwd(a.label) if a.fwd or both else []) + (run_bwd(a.label) if a.bwd or both else [])
    Path(a.out).write_text(json.dumps(rows))


if __name__ == "__main__":
    main()
