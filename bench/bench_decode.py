"""Benchmark of the mla_decode_sm80 kernel (weight-absorbed MLA decode over a paged latent cache).

Cases (bf16, one new token, random shuffled page tables):
  H=16  B=128 S=4096   page 64 (also 1 and 16)   memory-bound
  H=128 B=128 S=4096   page 64                   compute-bound
  H=16  B=4   S=32768  page 64                   split-KV
Beside each, the SDPA baseline in the same run: torch.nn.functional.scaled_dot_product_attention over
the same cache gathered into a dense (B, S, 576) tensor, heads folded into the query length (MQA, so the
cache is not expanded H times; the gather itself is not timed).
Metrics: median time (triton.testing.do_bench, else CUDA events) of the call on a stream and replayed from
a CUDA graph (as a serving loop runs it), cache GB/s = B*S*576*2 bytes / time,
TF/s with FLOPs = 2*B*Sq*H*S*(576+512). The extension's decode is timed twice per case: as it computes its own
split-KV schedule (metadata kernel + main + merge), and with a schedule precomputed once by
decode_schedule(seqlens, Sq, H) and passed as decode(..., schedule=) (main + merge: what every layer but the plan
costs in a decode step). In the same case and process the public call, mla_autograd.decode(q_nope, q_pe, ckv, kpe,
block_table, cache_seqlens, softmax_scale=, causal=) with its other arguments at their defaults, is timed the same
way (on a stream), without and with a schedule=mla_autograd.decode_schedule(...) made once: api_over_kernel and
api_sched_over_kernel are what the public call costs over the extension's entry point alone (validation, dispatch,
output allocation; by default check_values=True, one 8-byte device-to-host copy per call). Adds the run to the
results store bench/results/decode.json (an --ab run: decode-ab.json; bench/store.py: rows keyed by gpu, torch,
commit and date), redraws decode.png (decode-ab.png) from it, and prints a table.

A case with launch options (the extension's LaunchOptions, OPTION_FIELDS: --sweep, --ab) is timed through
decode_with_options / decode_schedule_with_options; a case without (AUTO) through decode / decode_schedule. The
public call takes no launch options: only AUTO cases have api_* columns (none with --no-api, nor in an --ab run,
whose rows stay a kernel-against-kernel comparison).

The run's metadata: {date, gpu, capability, torch, cuda, cudnn, commit, args, device, option_fields}; each row has
  B, S, H, Sq, page, dtype, options: the case (options: the LaunchOptions fields set, {} = automatic)
  kernel                                the main kernel (launch_info)
  kernel_us, kernel_GBps, kernel_TFps   decode() with its own schedule, on a stream
  graph_us, graph_GBps                  the same, replayed from a CUDA graph
  sched_us, sched_GBps, sched_TFps      decode(..., schedule=precomputed), on a stream
  sched_graph_us, sched_graph_GBps      the same, replayed from a CUDA graph
  plan_graph_us                         decode_schedule() alone (the metadata kernel), graph replay
  api_us, api_over_kernel               mla_autograd.decode(...) with its defaults, on a stream; api_us / kernel_us
  api_sched_us, api_sched_over_kernel   the same with schedule=decode_schedule(...) made once; api_sched_us / sched_us
  api_backend, api_checks_values        the backend the public call dispatched to (explain_decode) and whether its
                                        default checks values (MLA_AUTOGRAD_CHECK_VALUES can turn them off)
  api_max_abs_diff_vs_kernel            public call's output against the extension's (0: the same kernel)
  sdpa_us, sdpa_GBps, sdpa_TFps         the SDPA baseline (or sdpa_error); max_abs_diff_vs_sdpa (Sq = 1)
  flashmla_us, flashmla_call_us         with --flashmla, FlashMLA's SM90 dense decode on the same case (page 64):
                                        its metadata made once and reused (as sched_us), and made in every call (as
                                        kernel_us); ours_over_flashmla = flashmla_us / sched_us and
                                        ours_call_over_flashmla = flashmla_call_us / kernel_us (speed ratios, > 1:
                                        ours faster); flashmla_max_abs_diff against our output (or flashmla_error).
                                        The two are timed alternately, --peer-rounds times each, medians kept.

    python bench/bench_decode.py [--quick] [--sweep] [--no-sdpa] [--no-api]
    python bench/bench_decode.py --out FILE.json   # this run alone to FILE.json (+ .png), not to the store
    python bench/bench_decode.py --replot [FILE]   # only redraw the PNG of the latest run (default: decode store)
    python bench/bench_decode.py --quick --no-sdpa --ab groups=0 --rounds 3
        # A/B in one process: each case with the automatic launch and with these launch options, alternating
    python bench/bench_decode.py --no-sdpa --flashmla PATH/flashmla.py --case 128,4096,128 --case 64,8192,128,2
        # beside FlashMLA, in the same process; PATH/flashmla.py: a binding of its SM90 dense decode with
        # decode(q576, kcache, seqlens, block_table, scale, causal, meta=None, nsplit=None) -> (out, lse, meta, nsplit)
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import mla_autograd as M  # noqa: E402
from mla_autograd import _validate  # noqa: E402
from mla_autograd._build import load_family  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import graph_ms, median_ms, stamp  # noqa: E402
from store import latest_rows, load, record, store_path  # noqa: E402

SCALE = 1.0 / math.sqrt(192.0)
# LaunchOptions fields (csrc/sm80/mla_decode/mla_decode_sm80_api.cpp) and their types: int counts, bool switches
OPTION_FIELDS = {"stages": int, "ctas_per_sm": int, "warp_specialized": bool, "groups": bool, "pdl": bool,
                 "wgmma": bool}
AUTO: dict = {}  # no options: decode()'s automatic launch


def parse_options(text: str, what: str = "--ab") -> dict:
    """Launch options given as "field=value,..." (--ab, or the tools' arguments; `what` names them in errors) as a
    LaunchOptions keyword dict (bools as 0/1 or true/false)."""
    opts = {}
    for item in filter(None, text.split(",")):
        key, sep, val = item.partition("=")
        if not sep or key not in OPTION_FIELDS:
            raise SystemExit(f"{what}: expected field=value with field in {', '.join(OPTION_FIELDS)}, got {item!r}")
        if OPTION_FIELDS[key] is bool:
            if val.lower() not in ("0", "1", "true", "false"):
                raise SystemExit(f"{what}: {key} takes 0/1 or true/false, got {val!r}")
            opts[key] = val.lower() in ("1", "true")
        else:
            try:
                opts[key] = int(val)
            except ValueError:
                raise SystemExit(f"{what}: {key} takes an integer, got {val!r}") from None
    return opts


def options_label(options: dict) -> str:
    return ",".join(f"{k}={int(v) if isinstance(v, bool) else v}" for k, v in options.items()) or "auto"


def bench_ms(fn) -> float:
    return median_ms(fn, warmup_ms=25, rep_ms=200)


def make_case(B, S, H, Sq, page, dtype, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    pages_per = S // page
    P = B * pages_per + 1
    buf = torch.randn(P, page, 576, dtype=dtype, device="cuda", generator=g)
    perm = torch.randperm(P, device="cuda", generator=g)
    table = perm[: B * pages_per].view(B, pages_per).to(torch.int32).contiguous()
    q_nope = torch.randn(B, Sq, H, 512, dtype=dtype, device="cuda", generator=g)
    q_pe = torch.randn(B, Sq, H, 64, dtype=dtype, device="cuda", generator=g)
    seqlens = torch.full((B,), S, dtype=torch.int32, device="cuda")
    return buf, table, q_nope, q_pe, seqlens


def run_case(ext, B, S, H, page, Sq=1, dtype=torch.bfloat16, sdpa=True, options=AUTO, api=True, flashmla=None,
             peer_rounds=3):
    buf, table, q_nope, q_pe, seqlens = make_case(B, S, H, Sq, page, dtype)
    ckv, kpe = buf[..., :512], buf[..., 512:]
    out = torch.empty(B, Sq, H, 512, dtype=dtype, device="cuda")
    lse = torch.empty(B, H, Sq, dtype=torch.float32, device="cuda")
    causal = Sq > 1
    if options:
        opts = ext.LaunchOptions(**options)
        kernel = ext.launch_info(B, Sq, H, torch.cuda.current_device(), opts)["kernel"]
        call = lambda schedule=None: ext.decode_with_options(  # noqa: E731
            q_nope, q_pe, ckv, kpe, table, seqlens, out, lse, SCALE, causal, opts, schedule=schedule)
        plan = lambda: ext.decode_schedule_with_options(seqlens, Sq, H, opts)  # noqa: E731
    else:
        kernel = ext.launch_info(B, Sq, H, torch.cuda.current_device())["kernel"]
        call = lambda schedule=None: ext.decode(  # noqa: E731
            q_nope, q_pe, ckv, kpe, table, seqlens, out, lse, SCALE, causal, schedule=schedule)
        plan = lambda: ext.decode_schedule(seqlens, Sq, H)  # noqa: E731
    fn = lambda: call()  # noqa: E731
    fn()
    torch.cuda.synchronize()
    ms = bench_ms(fn)
    gms = graph_ms(fn, timer=bench_ms)
    # precomputed schedule: planned once (as once per decode step), reused by every timed call
    sched = plan()
    sched_fn = lambda: call(sched)  # noqa: E731
    sched_fn()
    torch.cuda.synchronize()
    sms_ = bench_ms(sched_fn)
    sgms = graph_ms(sched_fn, timer=bench_ms)
    pgms = graph_ms(plan, timer=bench_ms)
    bytes_ = B * S * 576 * 2
    flops = 2.0 * B * Sq * H * S * (576 + 512)
    row = {"B": B, "S": S, "H": H, "Sq": Sq, "page": page, "dtype": str(dtype).replace("torch.", ""),
           "options": dict(options), "kernel": kernel, "kernel_us": ms * 1e3, "kernel_GBps": bytes_ / ms / 1e6, "kernel_TFps": flops / ms / 1e9,
           "graph_us": gms * 1e3, "graph_GBps": bytes_ / gms / 1e6,
           "sched_us": sms_ * 1e3, "sched_GBps": bytes_ / sms_ / 1e6, "sched_TFps": flops / sms_ / 1e9,
           "sched_graph_us": sgms * 1e3, "sched_graph_GBps": bytes_ / sgms / 1e6, "plan_graph_us": pgms * 1e3}
    if api and not options:
        row.update(time_public_call(q_nope, q_pe, ckv, kpe, table, seqlens, causal, out, ms, sms_))
    if flashmla is not None and page == 64:
        row.update(time_flashmla(flashmla, buf, table, q_nope, q_pe, seqlens, causal, out, fn, sched_fn, peer_rounds))
    if sdpa:
        try:
            dense = buf[table.long()].reshape(B, S, 576)  # gathered cache (not timed)
            k = dense[:, None]                      # (B, 1, S, 576)
            v = dense[:, None, :, :512]             # (B, 1, S, 512)
            q = torch.cat([q_nope, q_pe], -1).reshape(B, 1, Sq * H, 576)
            sfn = lambda: F.scaled_dot_product_attention(q, k, v, scale=SCALE)  # noqa: E731
            ref = sfn()
            if Sq == 1:  # sanity: same result as the kernel
                row["max_abs_diff_vs_sdpa"] = (ref.reshape(B, H, 512).float() - out.reshape(B, H, 512).float()).abs().max().item()
            sms = bench_ms(sfn)
            row.update({"sdpa_us": sms * 1e3, "sdpa_GBps": bytes_ / sms / 1e6, "sdpa_TFps": flops / sms / 1e9})
            del dense, k, v, q, ref
        except Exception as e:  # noqa: BLE001
            row["sdpa_error"] = f"{type(e).__name__}: {str(e)[:200]}"
    del buf
    torch.cuda.empty_cache()
    return row


def time_flashmla(flashmla, buf, table, q_nope, q_pe, seqlens, causal, our_out, our_call, our_sched_call,
                  rounds) -> dict:
    """The flashmla_* columns of a case: FlashMLA's dense decode on the same cache, queries and lengths, timed in
    alternation with ours (rounds x: ours then FlashMLA, or the reverse), plan reused and plan in every call."""
    import statistics
    try:
        q576 = torch.cat([q_nope, q_pe], -1)
        kcache = buf.view(buf.shape[0], 64, 1, 576)
        f_out, _, meta, nsplit = flashmla.decode(q576, kcache, seqlens, table, SCALE, causal)
        f_call = lambda: flashmla.decode(q576, kcache, seqlens, table, SCALE, causal)  # noqa: E731
        f_sched = lambda: flashmla.decode(q576, kcache, seqlens, table, SCALE, causal, meta, nsplit)  # noqa: E731
        our_call()
        torch.cuda.synchronize()
        diff = (f_out.float() - our_out.float()).abs().max().item()
        t = {"ours": [], "ours_call": [], "flashmla": [], "flashmla_call": []}
        for r in range(rounds):
            order = [("ours", our_sched_call), ("ours_call", our_call), ("flashmla", f_sched), ("flashmla_call", f_call)]
            for name, f in (order if r % 2 == 0 else order[::-1]):
                t[name].append(bench_ms(f))
        med = {k: statistics.median(v) for k, v in t.items()}
        return {"flashmla_us": med["flashmla"] * 1e3, "flashmla_call_us": med["flashmla_call"] * 1e3,
                "ours_alt_sched_us": med["ours"] * 1e3, "ours_alt_call_us": med["ours_call"] * 1e3,
                "ours_over_flashmla": med["flashmla"] / med["ours"],
                "ours_call_over_flashmla": med["flashmla_call"] / med["ours_call"],
                "flashmla_max_abs_diff": diff}
    except Exception as e:  # noqa: BLE001
        return {"flashmla_error": f"{type(e).__name__}: {str(e)[:200]}"}


def load_flashmla(path: str):
    """The FlashMLA binding module at path (a .py file)."""
    import importlib.util
    spec = importlib.util.spec_from_file_location("flashmla_peer", path)
    mod = importlib.util.module_from_spec(spec)
    sys.path.insert(0, str(Path(path).resolve().parent))
    spec.loader.exec_module(mod)
    return mod


def time_public_call(q_nope, q_pe, ckv, kpe, table, seqlens, causal, kernel_out, kernel_ms, sched_ms) -> dict:
    """The api_* columns of a case: mla_autograd.decode with its default arguments, timed as the kernel columns
    are (bench_ms), without and with a schedule made once by mla_autograd.decode_schedule; kernel_out is the
    extension's output of the same case, kernel_ms / sched_ms its times (the ratios' denominators)."""
    B, Sq, H, _ = q_nope.shape
    api = lambda: M.decode(q_nope, q_pe, ckv, kpe, table, seqlens, softmax_scale=SCALE, causal=causal)  # noqa: E731
    api_out = api()
    cols = {"api_backend": M.explain_decode(q_nope, q_pe, ckv).decode.backend,
            "api_checks_values": _validate.check_values_enabled(q_nope, table, seqlens,
                                                                requested=_validate.DECODE_CHECK_VALUES),
            "api_max_abs_diff_vs_kernel": (api_out.float() - kernel_out.float()).abs().max().item()}
    torch.cuda.synchronize()
    api_ms = bench_ms(api)
    schedule = M.decode_schedule(seqlens, seqlen_q=Sq, num_heads=H)
    api_sched = lambda: M.decode(q_nope, q_pe, ckv, kpe, table, seqlens, softmax_scale=SCALE,  # noqa: E731
                                 causal=causal, schedule=schedule)
    api_sched()
    torch.cuda.synchronize()
    api_sched_ms = bench_ms(api_sched)
    cols.update({"api_us": api_ms * 1e3, "api_over_kernel": api_ms / kernel_ms,
                 "api_sched_us": api_sched_ms * 1e3, "api_sched_over_kernel": api_sched_ms / sched_ms})
    return cols


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--replot", nargs="?", const="", default=None, metavar="FILE",
                    help="only redraw the PNG of the latest run in a results file (default the decode store)")
    ap.add_argument("--quick", action="store_true", help="only the three headline cases at page 64")
    ap.add_argument("--no-sdpa", action="store_true")
    ap.add_argument("--no-api", action="store_true",
                    help="do not time the public call mla_autograd.decode beside the extension (no api_* columns)")
    ap.add_argument("--sweep", action="store_true", help="also time launch-option variants (LaunchOptions)")
    ap.add_argument("--ab", default=None, metavar="FIELD=VALUE,...",
                    help=f"launch options ({', '.join(OPTION_FIELDS)}): time every case with the automatic launch "
                         "and with these, alternating the order, --rounds times")
    ap.add_argument("--rounds", type=int, default=1, help="with --ab: rounds")
    ap.add_argument("--case", action="append", default=None, metavar="B,S,H[,Sq]",
                    help="time these cases (bf16, page 64) instead of the default list; repeatable")
    ap.add_argument("--out", default=None, help="write this run alone to this JSON file (and its .png), not to the store")
    ap.add_argument("--results", default=None, help="the results store's folder (default bench/results)")
    ap.add_argument("--flashmla", default=None, metavar="PATH",
                    help="time FlashMLA's SM90 dense decode beside ours on every page-64 case (see the docstring)")
    ap.add_argument("--peer-rounds", type=int, default=3, help="with --flashmla: alternating rounds per case")
    args = ap.parse_args(argv)
    if args.replot is not None:
        src = Path(args.replot) if args.replot else store_path("decode", args.results)
        plot(latest_rows(load(src)), src.with_suffix(".png"))
        return
    ext = load_family("mla_decode_sm80")
    flashmla = load_flashmla(args.flashmla) if args.flashmla else None
    cases = [
        dict(B=128, S=4096, H=16, page=64),
        dict(B=128, S=4096, H=128, page=64),
        dict(B=4, S=32768, H=16, page=64),
    ]
    if not args.quick:
        cases += [
            dict(B=128, S=4096, H=16, page=1),
            dict(B=128, S=4096, H=16, page=16),
            dict(B=128, S=4096, H=16, page=64, Sq=2),
            dict(B=128, S=4096, H=16, page=64, dtype=torch.float16),
            # 7 equal requests: 133 items on 132 SMs before the split rule rounded down (one CTA in a second wave)
            dict(B=7, S=32768, H=16, page=64),
        ]
    if args.sweep:
        # all-warps kernel at 2 CTAs/SM (where the warp-specialized one does not fit), the warp-specialized
        # kernel with 3 and 4 stages (automatic: the most that fit, 5 on the H200), and without programmatic
        # dependent launch
        for options in [dict(warp_specialized=False), dict(stages=3), dict(stages=4), dict(pdl=False)]:
            cases.append(dict(B=128, S=4096, H=16, page=64, options=options))
            cases.append(dict(B=4, S=32768, H=16, page=64, options=options))
        # 128 heads: the 32-token all-warps kernel (four QK warps) instead of the row-group one
        cases.append(dict(B=128, S=4096, H=128, page=64, options=dict(groups=False)))
    if args.case:
        cases = [dict(zip(("B", "S", "H", "Sq"), (int(x) for x in c.split(","))), page=64) for c in args.case]
    if args.ab:
        ab = parse_options(args.ab)
        if not ab:
            raise SystemExit("--ab: no launch options given")
        cases = [dict(c, options=o, sdpa=False, api=False, round=r) for r in range(args.rounds) for c in cases
                 for o in ((AUTO, ab) if r % 2 == 0 else (ab, AUTO))]
    meta = stamp()  # at the start: the run's date is when it began
    rows = []
    for c in cases:
        c.setdefault("options", AUTO)
        if c["options"] != AUTO:
            c["sdpa"] = c["api"] = False
        c.setdefault("sdpa", not args.no_sdpa)
        c.setdefault("api", not args.no_api)
        rnd = c.pop("round", None)
        peer = dict(flashmla=flashmla, peer_rounds=args.peer_rounds) if flashmla is not None else {}
        r = run_case(ext, **c, **peer)
        if rnd is not None:
            r["round"] = rnd
        rows.append(r)
        print(json.dumps(r), flush=True)
    dev = torch.cuda.get_device_name()
    hdr = (f"{'B':>4} {'S':>6} {'H':>4} {'Sq':>3} {'page':>4} {'dtype':>8} {'options':>22} | {'us':>8} {'GB/s':>7} {'TF/s':>6} | "
           f"{'graph us':>8} {'GB/s':>7} | {'sched us':>8} {'GB/s':>7} | {'s.graph':>8} {'GB/s':>7} {'plan us':>7} | "
           f"{'api us':>8} {'api/k':>6} {'api.s us':>8} {'api.s/s':>7} | {'sdpa us':>8} {'GB/s':>7} {'TF/s':>6}")
    print(f"\nmla_decode_sm80 on {dev}; options = LaunchOptions fields set, auto = none; api = mla_autograd.decode "
          f"with its defaults (api/k: over us, api.s/s: with a schedule, over sched us)")
    print(hdr + "\n" + "-" * len(hdr))
    for r in rows:
        nan = float("nan")
        a = (f"{r.get('api_us', nan):8.1f} {r.get('api_over_kernel', nan):6.3f} {r.get('api_sched_us', nan):8.1f} "
             f"{r.get('api_sched_over_kernel', nan):7.3f}")
        s = (f"{r.get('sdpa_us', nan):8.1f} {r.get('sdpa_GBps', nan):7.0f} {r.get('sdpa_TFps', nan):6.1f}")
        tn = options_label(r["options"])
        print(f"{r['B']:>4} {r['S']:>6} {r['H']:>4} {r['Sq']:>3} {r['page']:>4} {r['dtype']:>8} {tn:>22} | "
              f"{r['kernel_us']:8.1f} {r['kernel_GBps']:7.0f} {r['kernel_TFps']:6.1f} | {r['graph_us']:8.1f} {r['graph_GBps']:7.0f} | "
              f"{r['sched_us']:8.1f} {r['sched_GBps']:7.0f} | {r['sched_graph_us']:8.1f} {r['sched_graph_GBps']:7.0f} "
              f"{r['plan_graph_us']:7.1f} | {a} | {s}")
    if flashmla is not None:
        print(f"\nbeside FlashMLA (alternating rounds, medians): sched = plan reused, call = plan in every call")
        print(f"{'B':>4} {'S':>6} {'H':>4} {'Sq':>3} {'kernel':>22} | {'ours us':>8} {'FlashMLA':>8} {'ratio':>6} | "
              f"{'ours call':>9} {'FlashMLA':>8} {'ratio':>6} | {'max diff':>8}")
        for r in rows:
            if "flashmla_us" in r:
                print(f"{r['B']:>4} {r['S']:>6} {r['H']:>4} {r['Sq']:>3} {r['kernel']:>22} | {r['ours_alt_sched_us']:8.1f} "
                      f"{r['flashmla_us']:8.1f} {r['ours_over_flashmla']:6.3f} | {r['ours_alt_call_us']:9.1f} "
                      f"{r['flashmla_call_us']:8.1f} {r['ours_call_over_flashmla']:6.3f} | {r['flashmla_max_abs_diff']:8.2e}")
            elif "flashmla_error" in r:
                print(f"{r['B']:>4} {r['S']:>6} {r['H']:>4} {r['Sq']:>3}: {r['flashmla_error']}")
    meta.update({"device": dev, "option_fields": list(OPTION_FIELDS)})
    # A/B rows (each case twice per round, automatic and --ab options) have a store of their own
    out = record("decode-ab" if args.ab else "decode", meta, rows, out=args.out, results=args.results)
    print(f"wrote {out}")
    plot(rows, out.with_suffix(".png"))


def plot(rows, path):
    """Cache-read GB/s and TF/s of the kernel (its schedule made in the call) beside the SDPA baseline, and, for a run
    with --flashmla, ours and FlashMLA's with the plan reused (timed alternately), one bar group per case."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib missing: no plot")
        return
    cases = {}
    for r in rows:  # the first (automatic-launch) row of each case
        cases.setdefault((r["B"], r["S"], r["H"], r["Sq"], r["page"], r["dtype"]), r)
    labels = [f"B{b} S{s}\nH{h} q{q} p{p}" for b, s, h, q, p, _ in cases]
    peer = any("flashmla_us" in r for r in cases.values())

    def rate(r, us_key, key):  # GB/s or TF/s of a time column of row r
        us = r.get(us_key)
        if not us:
            return 0
        work = r["B"] * r["S"] * 576 * 2 / 1e3 if key == "GBps" else 2.0 * r["B"] * r["Sq"] * r["H"] * r["S"] * 1088 / 1e6
        return work / us

    series = ([("ours_alt_sched_us", "mla_autograd (plan reused)"), ("flashmla_us", "FlashMLA (plan reused)")] if peer
              else [("kernel_us", "mla_autograd"), ("sdpa_us", "SDPA, gathered cache")])
    fig, axes = plt.subplots(1, 2, figsize=(max(8, 1.3 * len(cases) * 2), 4.5))
    for ax, key, unit in ((axes[0], "GBps", "cache GB/s"), (axes[1], "TFps", "TFLOP/s")):
        xs = range(len(cases))
        for k, (us_key, name) in enumerate(series):
            ax.bar([x - 0.2 + 0.4 * k for x in xs], [rate(r, us_key, key) for r in cases.values()], 0.4, label=name)
        ax.set_xticks(list(xs))
        ax.set_xticklabels(labels, fontsize=7)
        ax.set_ylabel(unit)
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"plot: {path}")


if __name__ == "__main__":
    main()
