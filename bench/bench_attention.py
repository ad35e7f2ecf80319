"""Benchmark mla_autograd.attention beside SDPA (cuDNN, flash, mem-efficient) and FlexAttention.

Workloads: B=2 H=16 S=8192, (Dqk, Dv) in {(192,128), (128,128)},
causal and not, bf16, random normal inputs. Median times; FLOPs: fwd = 2*B*H*Sq*Sk*(Dqk+Dv)
(halved when causal), bwd = 2.5 x fwd. Each round times all forwards, then all backwards; rounds
alternate the order of the implementations and the table gives the median over rounds. nvidia-smi samples
the SM clock and board power meanwhile, and each measurement records the mean of both during its window
(*_sm_mhz_rounds, *_power_w_rounds): on the H200 a run this long sits at the power cap. The backward is timed alone (autograd.grad over one saved
forward graph, retain_graph=True, as FlashAttention's benchmarks do; until 2026-11-30 it was
(fwd+bwd) - fwd, which also counted host time between the two: our rows moved by up to 6% between
two runs of the same commit while cuDNN's stayed within 1%); fwd+bwd is recorded too (fwd_bwd_ms). Every implementation's output
is checked against cuDNN's before it is timed, and the backend that served our op is recorded
(a reference-path number is labelled as such, never as a kernel).

    python bench/bench_attention.py                # the anchor workloads
    python bench/bench_attention.py --sweep        # + S = 1k..16k at 16k tokens per batch (192/128)
    python bench/bench_attention.py --quick        # S = 4096 only
    python bench/bench_attention.py --out run.json # this run alone to run.json (+ run.png), not to the store
    python bench/bench_attention.py --replot       # only redraw bench/results/attention.png (the latest run)
Adds the run to the results store bench/results/attention.json (bench/store.py: one row per workload and
implementation, keyed by gpu, torch, commit and date; rewritten after every workload, so a run cut short keeps
its rows), redraws bench/results/attention.png from it, and prints a table. tools/merge_results.py adds a file
written with --out to the store.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import PowerSampler, median_ms, stamp  # noqa: E402
from store import latest_rows, load, record, store_path  # noqa: E402

import mla_autograd as M  # noqa: E402


def flops_fwd(B, H, Sq, Sk, dqk, dv, causal):
    f = 2.0 * B * H * Sq * Sk * (dqk + dv)
    return f / 2 if causal else f


def _sdpa(backend):
    from torch.nn.attention import sdpa_kernel

    def run(q, k, v, causal, scale):
        with sdpa_kernel(backend):
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale)
    return run


_flex_cache = {}


def _flex(q, k, v, causal, scale):
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    key = (q.shape, causal)
    if key not in _flex_cache:
        fn = torch.compile(flex_attention, dynamic=False)
        bm = None
        if causal:
            bm = create_block_mask(lambda b, h, qi, ki: qi >= ki, None, None, q.shape[2], k.shape[2],
                                   device=q.device)
        _flex_cache[key] = (fn, bm)
    fn, bm = _flex_cache[key]
    return fn(q, k, v, block_mask=bm, scale=scale)


def ours(q, k, v, causal, scale):
    """mla_autograd.attention as every row of this benchmark calls it ((B, S, H, D) inputs, top-left mask)."""
    return M.attention(q, k, v, causal=causal, softmax_scale=scale, causal_align="top_left")


def peers(names=None):
    from torch.nn.attention import SDPBackend
    all_peers = {
        "sdpa_cudnn": _sdpa(SDPBackend.CUDNN_ATTENTION),
        "sdpa_flash": _sdpa(SDPBackend.FLASH_ATTENTION),
        "sdpa_mem_efficient": _sdpa(SDPBackend.EFFICIENT_ATTENTION),
        "flex_attention": _flex,
    }
    return {k: v for k, v in all_peers.items() if names is None or k in names}


def bench_one(B, H, S, dqk, dv, causal, impls, do_fwd=True, do_bwd=True):
    dev, dt = "cuda", torch.bfloat16
    scale = dqk ** -0.5
    # ours takes (B, S, H, D); SDPA/Flex take (B, H, S, D): separate contiguous tensors for each.
    q = torch.randn(B, S, H, dqk, device=dev, dtype=dt)
    k = torch.randn(B, S, H, dqk, device=dev, dtype=dt)
    v = torch.randn(B, S, H, dv, device=dev, dtype=dt)
    do = torch.randn(B, S, H, dv, device=dev, dtype=dt)
    qt, kt, vt, dot = (t.transpose(1, 2).contiguous() for t in (q, k, v, do))
    rows = []
    ff = flops_fwd(B, H, S, S, dqk, dv, causal)
    base = None
    for name, fn in impls.items():
        ours = name == "mla_autograd"
        args = (q, k, v) if ours else (qt, kt, vt)
        dout = do if ours else dot

        def fwd():
            return fn(*args, causal, scale)
        row = {"impl": name, "B": B, "H": H, "S": S, "dqk": dqk, "dv": dv, "causal": causal}
        if ours:
            e = M.explain(q, k, v, causal=causal)
            row["backend_fwd"], row["backend_bwd"] = e.forward.backend, e.backward.backend
            if e.forward.backend == "reference" and B * H * S * S > 2 ** 28:
                row["error"] = "no kernel here (reference path): not timed at this size"
                rows.append(row)
                continue
        def timed(name, f):  # median_ms, and the wall-clock window it ran in (for PowerSampler)
            t0 = time.time()
            ms = median_ms(f)
            row[f"{name}_window"] = [t0, time.time()]
            return ms

        try:
            with torch.no_grad():
                out = fwd()
            out_bhsd = out.transpose(1, 2) if ours else out
            if base is None:
                base = out_bhsd.float()
            row["max_abs_diff_vs_first"] = (out_bhsd.float() - base).abs().max().item()
            if do_fwd:
                with torch.no_grad():
                    t_f = timed("fwd", fwd)
                row["fwd_ms"], row["fwd_tflops"] = t_f, ff / t_f / 1e9
            if do_bwd:
                leaves = [a.detach().requires_grad_() for a in args]
                o = fn(*leaves, causal, scale)

                def bwd():  # the backward alone, from one saved forward graph (as FlashAttention's benchmarks)
                    torch.autograd.grad(o, leaves, dout, retain_graph=True)
                row["bwd_ms"] = timed("bwd", bwd)
                row["bwd_tflops"] = 2.5 * ff / row["bwd_ms"] / 1e9
                del o

                def fwd_bwd():
                    torch.autograd.grad(fn(*leaves, causal, scale), leaves, dout)
                row["fwd_bwd_ms"] = timed("fwd_bwd", fwd_bwd)
        except Exception as exc:  # unsupported shape for a peer: record why
            row["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}"
        rows.append(row)
        torch.cuda.empty_cache()
    return rows


def plot(rows, path):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib missing: no plot")
        return
    wl = sorted({(r["dqk"], r["dv"], r["causal"], r["S"], r["B"]) for r in rows})
    impls = list(dict.fromkeys(r["impl"] for r in rows))
    keys = [k for k in ("fwd_tflops", "bwd_tflops") if any(k in r for r in rows)]
    fig, axes = plt.subplots(1, len(keys), figsize=(max(6, 1.6 * len(wl) * len(keys)), 5), squeeze=False)
    axes = axes[0]
    for ax, key in zip(axes, keys):
        width = 0.8 / max(1, len(impls))
        for i, name in enumerate(impls):
            ys = []
            for w in wl:
                r = [x for x in rows if x["impl"] == name and (x["dqk"], x["dv"], x["causal"], x["S"], x["B"]) == w]
                ys.append(r[0].get(key, 0) if r else 0)
            ax.bar([j + i * width for j in range(len(wl))], ys, width, label=name)
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(wl))])
        ax.set_xticklabels([f"{d}/{v}{' c' if c else ''}\nS={s} B={b}" for d, v, c, s, b in wl], fontsize=7)
        ax.set_ylabel("TFLOP/s")
        ax.set_title(key.replace("_tflops", "").upper())
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"plot: {path}")


ROW_KEY = ("impl", "B", "H", "S", "dqk", "dv", "causal")


def merge_round(rows: list, by_key: dict, r: dict) -> None:
    """Fold one round's row r into its workload's row: the first round's row is kept (with its checks:
    backend, max_abs_diff_vs_first) and appended to rows; every round's fwd/bwd/fwd_bwd time goes to
    <t>_ms_rounds, <t>_ms becomes their median and <t>_tflops follows it. An error of any round is kept."""
    k = tuple(r[f] for f in ROW_KEY)
    first = by_key.get(k)
    if first is None:
        first = by_key[k] = r
        rows.append(r)
    for t in ("fwd", "bwd", "fwd_bwd"):
        if f"{t}_ms" not in r:
            continue
        runs = first.setdefault(f"{t}_ms_rounds", [])
        runs.append(r[f"{t}_ms"])
        if f"{t}_window" in r:
            first.setdefault(f"{t}_windows", []).append(r.pop(f"{t}_window"))
        gflop = r[f"{t}_tflops"] * r[f"{t}_ms"] if f"{t}_tflops" in r else None
        first[f"{t}_ms"] = statistics.median(runs)
        if gflop is not None:
            first[f"{t}_tflops"] = gflop / first[f"{t}_ms"]
    if "error" in r:
        first["error"] = r["error"]


def annotate_power(rows: list, sampler) -> None:
    """<t>_sm_mhz_rounds / <t>_power_w_rounds: the mean SM clock and board power nvidia-smi saw during each
    round's measurement (None where it took no sample), and a table of the backward's rounds."""
    lines = []
    for r in rows:
        for t in ("fwd", "bwd", "fwd_bwd"):
            stats = [sampler.window(*w) for w in r.get(f"{t}_windows", [])]
            if stats:
                r[f"{t}_sm_mhz_rounds"] = [s and round(s["sm_mhz"]) for s in stats]
                r[f"{t}_power_w_rounds"] = [s and round(s["power_w"], 1) for s in stats]
        if "bwd_ms_rounds" in r and "bwd_sm_mhz_rounds" in r:
            w = f"{r['dqk']}/{r['dv']} {'causal' if r['causal'] else 'full'}"
            lines.append(f"{w:<16}{r['impl']:<16}" + "  ".join(
                f"{ms:.3f} ms @ {mhz} MHz {pw} W" for ms, mhz, pw in
                zip(r["bwd_ms_rounds"], r["bwd_sm_mhz_rounds"], r["bwd_power_w_rounds"])))
    if lines:
        print("\nbackward per round (median ms, mean SM clock and board power during it):")
        print("\n".join(lines))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--no-bwd", action="store_true")
    ap.add_argument("--rounds", type=int, default=3,
                    help="passes over all workloads, alternating the order of the implementations (median)")
    ap.add_argument("--no-power", action="store_true",
                    help="do not sample SM clock and board power (nvidia-smi) during each measurement")
    ap.add_argument("--out", default=None, help="write this run alone to this JSON file (and its .png), not to the store")
    ap.add_argument("--results", default=None, help="the results store's folder (default bench/results)")
    ap.add_argument("--peers", default=None,
                    help="comma-separated subset of sdpa_cudnn,sdpa_flash,sdpa_mem_efficient,flex_attention")
    ap.add_argument("--flex-dims", default=None, help="only run FlexAttention for this Dqk (it compiles per shape)")
    ap.add_argument("--replot", nargs="?", const="", default=None, metavar="FILE",
                    help="only redraw the PNG of the latest run in a results file (default the attention store)")
    args = ap.parse_args()
    if args.replot is not None:
        src = Path(args.replot) if args.replot else store_path("attention", args.results)
        plot(latest_rows(load(src)), src.with_suffix(".png"))
        return
    if not torch.cuda.is_available():
        sys.exit("bench_attention needs a CUDA GPU")
    impls = {"mla_autograd": ours}
    impls.update(peers(args.peers.split(",") if args.peers else None))
    S = 4096 if args.quick else 8192
    shapes = [(2, 16, S, d, dv, c) for d, dv in ((192, 128), (128, 128)) for c in (False, True)]
    if args.sweep:
        shapes += [(16384 // s, 16, s, 192, 128, c) for s in (1024, 2048, 4096, 16384) for c in (False, True)]
    rows = []
    meta = stamp()
    meta["rounds"] = args.rounds

    def save():  # the run so far, to --out or into the store
        return record("attention", meta, rows, out=args.out, results=args.results)
    # Two passes per round: every forward first, then every backward. Timed right after a backward's
    # 250 ms of back-to-back calls, our 128/128 forwards read 0.91-0.97x cuDNN in three runs on the H200;
    # alone (--no-bwd, same commit, warm GPU) 1.00-1.02x. The same kernels' backward also read up to 9%
    # slower here than in tools/profile_ops.py (2026-11-30), so the rounds alternate the order of the
    # implementations, and a row's time is the median over rounds (each round's in *_ms_rounds).
    def use_for(d, rnd):
        sel = [(k, f) for k, f in impls.items()
               if not (k == "flex_attention" and args.flex_dims and d != int(args.flex_dims))]
        return dict(sel if rnd % 2 == 0 else sel[::-1])
    by_key = {}
    sampler = None if args.no_power else PowerSampler()

    for rnd in range(args.rounds):
        for B, H, s, d, dv, c in shapes:
            for r in bench_one(B, H, s, d, dv, c, use_for(d, rnd), do_bwd=False):
                merge_round(rows, by_key, r)
            path = save()  # after every workload: a cut-short run keeps its rows
        if not args.no_bwd:
            for B, H, s, d, dv, c in shapes:
                for r in bench_one(B, H, s, d, dv, c, use_for(d, rnd), do_fwd=False):
                    merge_round(rows, by_key, r)
                path = save()
    if sampler is not None:
        sampler.close()
        annotate_power(rows, sampler)
        path = save()
    plot(rows, path.with_suffix(".png"))
    print(f"\n{meta['gpu']}  torch {meta['torch']}  cudnn {meta['cudnn']}  commit {meta['commit']}")
    hdr = f"{'workload':<26}{'impl':<20}{'backend':<10}{'fwd TF/s':>9}{'bwd TF/s':>9}{'fwd/cudnn':>10}{'bwd/cudnn':>10}"
    print(hdr)
    for r in rows:
        w = f"{r['dqk']}/{r['dv']} {'causal' if r['causal'] else 'full'} B{r['B']} S{r['S']}"
        if "error" in r:
            print(f"{w:<26}{r['impl']:<20}{'':<10}  {r['error'][:60]}")
            continue
        cud = [x for x in rows if x["impl"] == "sdpa_cudnn" and (x["dqk"], x["dv"], x["causal"], x["S"]) ==
               (r["dqk"], r["dv"], r["causal"], r["S"]) and "error" not in x]
        rf = r["fwd_tflops"] / cud[0]["fwd_tflops"] if cud else float("nan")
        rb = r.get("bwd_tflops", 0) / cud[0]["bwd_tflops"] if cud and "bwd_tflops" in cud[0] else float("nan")
        be = r.get("backend_fwd", "") + ("/" + r["backend_bwd"] if "backend_bwd" in r else "")
        print(f"{w:<26}{r['impl']:<20}{be:<10}{r['fwd_tflops']:>9.1f}{r.get('bwd_tflops', 0):>9.1f}{rf:>10.2f}{rb:>10.2f}")
    print(f"json: {path}")


if __name__ == "__main__":
    main()
