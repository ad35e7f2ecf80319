"""Benchmark mla_autograd.attention beside SDPA (cuDNN, flash, mem-efficient) and FlexAttention, and
mla_autograd.attention_varlen on packed variable-length batches beside its kernels alone.

Dense workloads (case "dense"): B=2 H=16 S=8192, (Dqk, Dv) in {(192,128), (128,128)}, causal and not, bf16,
random normal inputs. Median times; FLOPs: fwd = 2*B*H*Sq*Sk*(Dqk+Dv) (halved when causal), bwd = 2.5 x fwd.
Each round times all forwards, then all backwards; rounds alternate the order of the implementations and the
table gives the median over rounds. nvidia-smi samples the SM clock and board power meanwhile, and each
measurement records the mean of both during its window (*_sm_mhz_rounds, *_power_w_rounds): on the H200 a run
this long sits at the power cap. The backward is timed alone (autograd.grad over one saved
forward graph, retain_graph=True, as FlashAttention's benchmarks do; (fwd+bwd) - fwd would also count
host time between the two, which moved our rows by up to 6% between two runs of the same commit while
cuDNN's stayed within 1%); fwd+bwd is recorded too (fwd_bwd_ms). Every implementation's output
is checked against cuDNN's before it is timed, and the backend that served our op is recorded
(a reference-path number is labelled as such, never as a kernel).

Packed variable-length workloads (case "varlen", after the dense ones): 32768 tokens in one packed batch, H=16,
(Dqk, Dv) = (192, 128), bf16, causal and not, one cu_seqlens tensor for queries and keys; the lengths come from
varlen_lengths(kind): "longtail" (31 documents, lognormal-shaped lengths, the longest 4216 tokens), "uniform32"
(32 x 1024), "uniform1024" (1024 x 32). Implementations:
  mla_autograd         mla_autograd.attention_varlen(q, k, v, cu, cu, max_seqlen, max_seqlen, causal=...), every
                       other argument at its default (so it checks cu_seqlens' values: one 8-byte device-to-host
                       copy per call), timed as the dense rows are (backward alone through autograd)
  mla_autograd_kernel  the kernels that call launches (the families explain() names for it), through their
                       extension modules' fwd / bwd entry points with preallocated outputs: no validation, no
                       dispatch, no autograd
  fa4                  with --peers fa4: flash_attn.cute's flash_attn_varlen_func (an error is recorded if missing)
FLOPs are the sum over the sequences of the dense formula for each (causal: half of each, as for dense). The row
of the public call has api_over_kernel (its fwd_ms over the kernel row's), bwd_api_over_kernel and
fwd_bwd_api_over_kernel: what the public call costs over the kernels it launches, and api_checks_values (whether
its default checks cu_seqlens' values; MLA_AUTOGRAD_CHECK_VALUES=0 turns that off).

Row fields: case, impl, B (sequences), H, S (tokens per sequence; for varlen the packed total), dqk, dv, causal;
varlen rows also lengths_kind, max_seqlen. Times fwd_ms, bwd_ms, fwd_bwd_ms (median over rounds; each round's in
*_ms_rounds), fwd_tflops, bwd_tflops; backend_fwd / backend_bwd for our implementations; max_abs_diff_vs_first
(the output against the workload's first implementation); error where an implementation could not run.

    python bench/bench_attention.py                # the anchor workloads, then the varlen ones
    python bench/bench_attention.py --sweep        # + S = 1k..16k at 16k tokens per batch (192/128), and the
                                                   #   MLA layer's shape (B=1 H=128 S=4096, 192/128)
    python bench/bench_attention.py --quick        # S = 4096 only; varlen: "longtail" only
    python bench/bench_attention.py --varlen       # only the varlen workloads (--no-varlen: only the dense ones)
    python bench/bench_attention.py --peers fa4    # FlashAttention-4 (flash_attn.cute) as the only peer
    python bench/bench_attention.py --peers fa4,cudnn  # and cuDNN ("cudnn" names sdpa_cudnn)
    python bench/bench_attention.py --out run.json # this run alone to run.json (+ run.png), not to the store
    python bench/bench_attention.py --replot       # only redraw bench/results/attention.png (the latest run)
Adds the run to the results store bench/results/attention.json (bench/store.py: one row per workload and
implementation, keyed by gpu, torch, commit and date; rewritten after every workload, so a run cut short keeps
its rows), redraws bench/results/attention.png from it (the varlen workloads in a row of panels of their own),
and prints a table. tools/merge_results.py adds a file written with --out to the store.
"""
from __future__ import annotations

import argparse
import functools
import itertools
import math
import random
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
from mla_autograd import _validate  # noqa: E402
from mla_autograd._build import load_family  # noqa: E402
from mla_autograd._ops import _new_out  # noqa: E402


def flops_fwd(B, H, Sq, Sk, dqk, dv, causal):
    f = 2.0 * B * H * Sq * Sk * (dqk + dv)
    return f / 2 if causal else f


# ---- packed variable-length workloads ----

VARLEN_TOKENS = 32768  # tokens per packed batch, every kind
VARLEN_KINDS = ("longtail", "uniform32", "uniform1024")
VARLEN_HEADS, VARLEN_DIMS = 16, (192, 128)
LONGTAIL_DOCS, LONGTAIL_SIGMA = 31, 0.78


def varlen_lengths(kind: str, seed: int = 0) -> list[int]:
    """The sequence lengths of a packed batch of VARLEN_TOKENS tokens, as a list of ints.

    "uniform32": 32 x 1024; "uniform1024": 1024 x 32 (seed unused). "longtail": LONGTAIL_DOCS documents whose
    lengths are proportional to the lognormal(0, LONGTAIL_SIGMA) quantiles at (i + 0.5) / LONGTAIL_DOCS, scaled to
    VARLEN_TOKENS (floors, then one more token for the largest fractional parts until the total is exact), in an
    order shuffled by random.Random(seed): the same lengths for every seed (the longest 4216, the shortest 149,
    the median 793), only their order in the pack changes. Deterministic: no draw depends on global state.
    """
    if kind == "uniform32":
        return [VARLEN_TOKENS // 32] * 32
    if kind == "uniform1024":
        return [VARLEN_TOKENS // 1024] * 1024
    if kind != "longtail":
        raise ValueError(f"varlen lengths kind {kind!r} is not one of {', '.join(VARLEN_KINDS)}")
    normal = statistics.NormalDist()
    weights = [math.exp(LONGTAIL_SIGMA * normal.inv_cdf((i + 0.5) / LONGTAIL_DOCS)) for i in range(LONGTAIL_DOCS)]
    exact = [VARLEN_TOKENS * w / sum(weights) for w in weights]
    lengths = [math.floor(x) for x in exact]
    by_fraction = sorted(range(LONGTAIL_DOCS), key=lambda i: exact[i] - lengths[i], reverse=True)
    for i in by_fraction[:VARLEN_TOKENS - sum(lengths)]:
        lengths[i] += 1
    random.Random(seed).shuffle(lengths)
    return lengths


def cu_seqlens(lengths, device="cpu") -> torch.Tensor:
    """int32 (B + 1,) cumulative lengths starting at 0, as attention_varlen takes them."""
    return torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32, device=device)


def varlen_flops_fwd(lengths, H, dqk, dv, causal):
    """Forward FLOPs of a packed batch: the dense count of each sequence (Sq = Sk = its length), summed."""
    return sum(flops_fwd(1, H, n, n, dqk, dv, causal) for n in lengths)


def varlen_row(impl, kind, lengths, H, dqk, dv, causal) -> dict:
    """The identity of a varlen row: workload and implementation (B sequences, S packed tokens)."""
    return {"case": "varlen", "impl": impl, "lengths_kind": kind, "B": len(lengths), "H": H, "S": sum(lengths),
            "max_seqlen": max(lengths), "dqk": dqk, "dv": dv, "causal": causal}


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


@functools.lru_cache(maxsize=None)
def _fa4():
    """flash_attn.cute: FlashAttention-4 (CuTe DSL), with flash_attn_func and flash_attn_varlen_func."""
    import flash_attn.cute as fa4
    return fa4


def _output(result):
    """The attention output of a FlashAttention call: FlashAttention-4 returns (out, lse), earlier releases out."""
    return result[0] if isinstance(result, tuple) else result


def _fa4_dense(q, k, v, causal, scale):
    """(B, S, H, D) inputs as ours; its causal mask is bottom-right aligned, the same as top-left at Sq == Sk."""
    return _output(_fa4().flash_attn_func(q, k, v, softmax_scale=scale, causal=causal))


def _fa4_varlen(q, k, v, cu, max_seqlen, causal, scale):
    return _output(_fa4().flash_attn_varlen_func(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=max_seqlen,
                                                 max_seqlen_k=max_seqlen, softmax_scale=scale, causal=causal))


def ours(q, k, v, causal, scale):
    """mla_autograd.attention as every row of this benchmark calls it ((B, S, H, D) inputs, top-left mask)."""
    return M.attention(q, k, v, causal=causal, softmax_scale=scale, causal_align="top_left")


def ours_varlen(q, k, v, cu, max_seqlen, causal, scale):
    """mla_autograd.attention_varlen with every argument but causal at its default (softmax_scale's default is the
    1/sqrt(Dqk) the other implementations are given)."""
    return M.attention_varlen(q, k, v, cu, cu, max_seqlen, max_seqlen, causal=causal)


OURS, OURS_KERNEL = "mla_autograd", "mla_autograd_kernel"  # the public call; its kernels alone (varlen)
PEERS = ("sdpa_cudnn", "sdpa_flash", "sdpa_mem_efficient", "flex_attention", "fa4")
DEFAULT_PEERS = PEERS[:4]  # fa4 only when --peers names it
PEER_ALIASES = {"cudnn": "sdpa_cudnn"}  # --peers names
# The attention of nn.MultiHeadLatentAttention at DeepSeek-V3's dims: (B, H, S, Dqk, Dv); --sweep adds it.
LAYER_SHAPE = (1, 128, 4096, 192, 128)
BSHD_IMPLS = (OURS, "fa4")  # take (B, S, H, D) inputs; the others (B, H, S, D)
VARLEN_PEERS = {"fa4": _fa4_varlen}


def peers(names=None):
    from torch.nn.attention import SDPBackend
    all_peers = {
        "sdpa_cudnn": _sdpa(SDPBackend.CUDNN_ATTENTION),
        "sdpa_flash": _sdpa(SDPBackend.FLASH_ATTENTION),
        "sdpa_mem_efficient": _sdpa(SDPBackend.EFFICIENT_ATTENTION),
        "flex_attention": _flex,
        "fa4": _fa4_dense,
    }
    names = DEFAULT_PEERS if names is None else names
    return {k: v for k, v in all_peers.items() if k in names}


def varlen_peers(names=None):
    """The peers among `names` (default DEFAULT_PEERS) that have a packed variable-length function."""
    names = DEFAULT_PEERS if names is None else names
    return {k: v for k, v in VARLEN_PEERS.items() if k in names}


def timed_into(row: dict, what: str, f) -> float:
    """median_ms of f, recording the wall-clock window it ran in as row[what + "_window"] (for PowerSampler)."""
    t0 = time.time()
    ms = median_ms(f)
    row[f"{what}_window"] = [t0, time.time()]
    return ms


def bench_one(B, H, S, dqk, dv, causal, impls, do_fwd=True, do_bwd=True):
    dev, dt = "cuda", torch.bfloat16
    scale = dqk ** -0.5
    # ours and FA4 take (B, S, H, D); SDPA/Flex take (B, H, S, D): separate contiguous tensors for each.
    q = torch.randn(B, S, H, dqk, device=dev, dtype=dt)
    k = torch.randn(B, S, H, dqk, device=dev, dtype=dt)
    v = torch.randn(B, S, H, dv, device=dev, dtype=dt)
    do = torch.randn(B, S, H, dv, device=dev, dtype=dt)
    qt, kt, vt, dot = (t.transpose(1, 2).contiguous() for t in (q, k, v, do))
    rows = []
    ff = flops_fwd(B, H, S, S, dqk, dv, causal)
    base = None
    for name, fn in impls.items():
        ours = name == OURS
        bshd = name in BSHD_IMPLS
        args = (q, k, v) if bshd else (qt, kt, vt)
        dout = do if bshd else dot

        def fwd():
            return fn(*args, causal, scale)
        row = {"case": "dense", "impl": name, "B": B, "H": H, "S": S, "dqk": dqk, "dv": dv, "causal": causal}
        if ours:
            e = M.explain(q, k, v, causal=causal)
            row["backend_fwd"], row["backend_bwd"] = e.forward.backend, e.backward.backend
            if e.forward.backend == "reference" and B * H * S * S > 2 ** 28:
                row["error"] = "no kernel here (reference path): not timed at this size"
                rows.append(row)
                continue
        timed = functools.partial(timed_into, row)

        try:
            with torch.no_grad():
                out = fwd()
            out_bhsd = out.transpose(1, 2) if bshd else out
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


class AutogradVarlen:
    """A varlen attention function fn(q, k, v, cu, max_seqlen, causal, scale) timed as the dense rows time theirs:
    the forward under no_grad, the backward alone (autograd.grad over one saved forward graph), fwd+bwd."""

    def __init__(self, fn, q, k, v, cu, max_seqlen, causal, scale):
        self.fn, self.qkv, self.rest = fn, (q, k, v), (cu, max_seqlen, causal, scale)

    def forward(self):
        return self.fn(*self.qkv, *self.rest)

    def backward_timers(self, dout):
        leaves = [t.detach().requires_grad_() for t in self.qkv]
        o = self.fn(*leaves, *self.rest)

        def bwd():
            torch.autograd.grad(o, leaves, dout, retain_graph=True)

        def fwd_bwd():
            torch.autograd.grad(self.fn(*leaves, *self.rest), leaves, dout)
        return bwd, fwd_bwd


class VarlenKernels:
    """The kernels mla_autograd.attention_varlen launches for these tensors, called through their extension
    modules as mla_autograd._ops calls them (the families explain() names for the call, the outputs allocated as
    _ops allocates them), but once, before any timing: a timed call is only the extension's fwd or bwd (no
    validation, no cu_seqlens value check, no dispatch, no autograd, no allocation)."""

    def __init__(self, q, k, v, cu, max_seqlen, causal, scale):
        e = M.explain(q, k, v, causal=causal, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=max_seqlen)
        self.backend_fwd, self.backend_bwd = e.forward.backend, e.backward.backend
        if e.forward.family is None or e.backward.family is None:
            raise RuntimeError(f"no kernel here (forward {e.forward.backend}, backward {e.backward.backend})")
        self.fwd_ext, self.bwd_ext = load_family(e.forward.family), load_family(e.backward.family)
        self.q, self.k, self.v, self.cu = q, k, v, cu
        self.out = _new_out(q, v, e.forward.family, max_seqlen)
        self.lse = torch.empty(q.shape[1], q.shape[0], dtype=torch.float32, device=q.device)
        self.grads = tuple(torch.empty_like(t) for t in (q, k, v))
        self.scalars = (max_seqlen, max_seqlen, scale, causal, True)  # bottom_right: the public default

    def forward(self):
        self.fwd_ext.fwd(self.q, self.k, self.v, self.out, self.lse, self.cu, self.cu, *self.scalars)
        return self.out

    def backward(self, dout):
        self.bwd_ext.bwd(dout, self.q, self.k, self.v, self.out, self.lse, *self.grads, self.cu, self.cu,
                         *self.scalars, False)  # deterministic: the public default

    def backward_timers(self, dout):
        self.forward()  # the out and lse the backward reads

        def bwd():
            self.backward(dout)

        def fwd_bwd():
            self.forward()
            self.backward(dout)
        return bwd, fwd_bwd


def varlen_impls(peer_names=None) -> dict:
    """name -> the constructor of its timer for a varlen workload: the public call, its kernels alone, and the
    peers among peer_names that have a varlen function."""
    impls = {OURS: functools.partial(AutogradVarlen, ours_varlen), OURS_KERNEL: VarlenKernels}
    impls.update({n: functools.partial(AutogradVarlen, fn) for n, fn in varlen_peers(peer_names).items()})
    return impls


def bench_varlen_one(kind, H, dqk, dv, causal, impls, do_fwd=True, do_bwd=True, device="cuda",
                     dtype=torch.bfloat16):
    """The rows of one packed workload (lengths varlen_lengths(kind)), one per implementation in impls
    (varlen_impls' form), as bench_one's: fwd_ms / fwd_tflops, bwd_ms / bwd_tflops, fwd_bwd_ms, their windows."""
    dev, dt = device, dtype
    lengths = varlen_lengths(kind)
    tokens, max_seqlen = sum(lengths), max(lengths)
    scale = dqk ** -0.5
    q = torch.randn(tokens, H, dqk, device=dev, dtype=dt)
    k = torch.randn(tokens, H, dqk, device=dev, dtype=dt)
    v = torch.randn(tokens, H, dv, device=dev, dtype=dt)
    do = torch.randn(tokens, H, dv, device=dev, dtype=dt)
    cu = cu_seqlens(lengths, dev)
    ff = varlen_flops_fwd(lengths, H, dqk, dv, causal)
    rows, base = [], None
    for name, make in impls.items():
        row = varlen_row(name, kind, lengths, H, dqk, dv, causal)
        timer = bwd = fwd_bwd = None

        timed = functools.partial(timed_into, row)

        try:
            if name == OURS:
                e = M.explain(q, k, v, causal=causal, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=max_seqlen)
                row["backend_fwd"], row["backend_bwd"] = e.forward.backend, e.backward.backend
                row["api_checks_values"] = _validate.check_values_enabled(
                    q, cu, requested=_validate.VARLEN_CHECK_VALUES)
                if e.forward.backend == "reference" and H * sum(n * n for n in lengths) > 2 ** 28:
                    row["error"] = "no kernel here (reference path): not timed at this size"
                    rows.append(row)
                    continue
            timer = make(q, k, v, cu, max_seqlen, causal, scale)
            if isinstance(timer, VarlenKernels):
                row["backend_fwd"], row["backend_bwd"] = timer.backend_fwd, timer.backend_bwd
            with torch.no_grad():
                out = timer.forward().float()
            if base is None:
                base = out
            row["max_abs_diff_vs_first"] = (out - base).abs().max().item()
            del out
            if do_fwd:
                with torch.no_grad():
                    t_f = timed("fwd", timer.forward)
                row["fwd_ms"], row["fwd_tflops"] = t_f, ff / t_f / 1e9
            if do_bwd:
                bwd, fwd_bwd = timer.backward_timers(do)
                row["bwd_ms"] = timed("bwd", bwd)
                row["bwd_tflops"] = 2.5 * ff / row["bwd_ms"] / 1e9
                row["fwd_bwd_ms"] = timed("fwd_bwd", fwd_bwd)
        except Exception as exc:  # a peer without this shape, or no kernel here: record why
            row["error"] = f"{type(exc).__name__}: {(str(exc).splitlines() or [''])[0][:160]}"
        rows.append(row)
        timer = bwd = fwd_bwd = None  # this implementation's buffers and saved graph, before the next one's
        torch.cuda.empty_cache()
    return rows


def annotate_api_over_kernel(rows: list) -> None:
    """On the public call's varlen rows: api_over_kernel = its fwd_ms over the kernel row's of the same workload,
    bwd_api_over_kernel and fwd_bwd_api_over_kernel likewise (where both rows have the time)."""
    kernels = {workload_key(r): r for r in rows if r.get("case") == "varlen" and r["impl"] == OURS_KERNEL}
    for r in rows:
        if r.get("case") != "varlen" or r["impl"] != OURS or workload_key(r) not in kernels:
            continue
        kr = kernels[workload_key(r)]
        for t, name in (("fwd", "api_over_kernel"), ("bwd", "bwd_api_over_kernel"),
                        ("fwd_bwd", "fwd_bwd_api_over_kernel")):
            if f"{t}_ms" in r and f"{t}_ms" in kr:
                r[name] = r[f"{t}_ms"] / kr[f"{t}_ms"]


def workload_key(r: dict) -> tuple:
    """What identifies a row's workload, whatever the implementation (rows before the varlen case are dense)."""
    return (r.get("case", "dense"), r.get("lengths_kind"), r["B"], r["H"], r["S"], r["dqk"], r["dv"], r["causal"])


def _workload_order(r: dict) -> tuple:
    """Dense workloads by (Dqk, Dv, causal, S, B); varlen ones by lengths kind (VARLEN_KINDS' order), then causal."""
    if r.get("case") == "varlen":
        kind = r["lengths_kind"]
        return (VARLEN_KINDS.index(kind) if kind in VARLEN_KINDS else len(VARLEN_KINDS), kind, r["causal"], r["B"])
    return (r["dqk"], r["dv"], r["causal"], r["S"], r["B"])


def workload_text(r: dict) -> str:
    """One line naming a row's workload, for the tables."""
    mask = "causal" if r["causal"] else "full"
    if r.get("case") == "varlen":
        return f"{r['lengths_kind']} {mask} B{r['B']} max{r['max_seqlen']}"
    heads = "" if r["H"] == 16 else f" H{r['H']}"
    return f"{r['dqk']}/{r['dv']} {mask} B{r['B']}{heads} S{r['S']}"


def _workload_label(r: dict) -> str:
    c = " c" if r["causal"] else ""
    if r.get("case") == "varlen":
        return f"{r['lengths_kind']}{c}\nB={r['B']} max={r['max_seqlen']}"
    heads = "" if r["H"] == 16 else f" H={r['H']}"
    return f"{r['dqk']}/{r['dv']}{c}\nS={r['S']} B={r['B']}{heads}"


def plot(rows, path):
    """TF/s per implementation, one panel per time (fwd, bwd) and case: the dense workloads in the first row of
    panels, the varlen ones (if any) in a second."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib missing: no plot")
        return
    keys = [k for k in ("fwd_tflops", "bwd_tflops") if any(k in r for r in rows)]
    cases = [(c, [r for r in rows if r.get("case", "dense") == c]) for c in ("dense", "varlen")]
    cases = [(c, rs) for c, rs in cases if rs]
    if not keys or not cases:
        print("no timed rows: no plot")
        return
    widest = max(len({workload_key(r) for r in rs}) for _, rs in cases)
    fig, axes = plt.subplots(len(cases), len(keys), figsize=(max(6, 1.6 * widest * len(keys)), 5 * len(cases)),
                             squeeze=False)
    for (case, case_rows), panel_row in zip(cases, axes):
        wl = sorted({workload_key(r): r for r in case_rows}.items(), key=lambda kv: _workload_order(kv[1]))
        impls = list(dict.fromkeys(r["impl"] for r in case_rows))
        for ax, key in zip(panel_row, keys):
            width = 0.8 / max(1, len(impls))
            for i, name in enumerate(impls):
                ys = []
                for w, _ in wl:
                    r = [x for x in case_rows if x["impl"] == name and workload_key(x) == w]
                    ys.append(r[0].get(key, 0) if r else 0)
                ax.bar([j + i * width for j in range(len(wl))], ys, width, label=name)
            ax.set_xticks([j + 0.4 - width / 2 for j in range(len(wl))])
            ax.set_xticklabels([_workload_label(r) for _, r in wl], fontsize=7)
            ax.set_ylabel("TFLOP/s")
            ax.set_title(f"{key.replace('_tflops', '').upper()}, {case}")
        panel_row[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    print(f"plot: {path}")


ROW_KEY = ("case", "impl", "lengths_kind", "B", "H", "S", "dqk", "dv", "causal")


def merge_round(rows: list, by_key: dict, r: dict) -> None:
    """Fold one round's row r into its workload's row: the first round's row is kept (with its checks:
    backend, max_abs_diff_vs_first) and appended to rows; every round's fwd/bwd/fwd_bwd time goes to
    <t>_ms_rounds, <t>_ms becomes their median and <t>_tflops follows it. An error of any round is kept."""
    k = tuple(r.get(f) for f in ROW_KEY)
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
            lines.append(f"{workload_text(r):<36}{r['impl']:<22}" + "  ".join(
                f"{ms:.3f} ms @ {mhz} MHz {pw} W" for ms, mhz, pw in
                zip(r["bwd_ms_rounds"], r["bwd_sm_mhz_rounds"], r["bwd_power_w_rounds"])))
    if lines:
        print("\nbackward per round (median ms, mean SM clock and board power during it):")
        print("\n".join(lines))


def backend_text(row: dict) -> str:
    """"fwd/bwd" backends of a row, e.g. "sm90/sm90" ("" when none was recorded)."""
    return row.get("backend_fwd", "") + ("/" + row["backend_bwd"] if "backend_bwd" in row else "")


def print_tables(rows: list, meta: dict) -> None:
    """The dense rows beside cuDNN's, then the varlen rows with the public call over its kernels."""
    nan = float("nan")
    print(f"\n{meta['gpu']}  torch {meta['torch']}  cudnn {meta['cudnn']}  commit {meta['commit']}")
    dense = [r for r in rows if r.get("case", "dense") == "dense"]
    if dense:
        print(f"{'workload':<26}{'impl':<20}{'backend':<10}{'fwd TF/s':>9}{'bwd TF/s':>9}{'fwd/cudnn':>10}"
              f"{'bwd/cudnn':>10}")
    for r in dense:
        w = workload_text(r)
        if "error" in r:
            print(f"{w:<26}{r['impl']:<20}{'':<10}  {r['error'][:60]}")
            continue
        cud = [x for x in dense
               if x["impl"] == "sdpa_cudnn" and workload_key(x) == workload_key(r) and "error" not in x]
        rf = r["fwd_tflops"] / cud[0]["fwd_tflops"] if cud and "fwd_tflops" in r and "fwd_tflops" in cud[0] else nan
        rb = r.get("bwd_tflops", 0) / cud[0]["bwd_tflops"] if cud and "bwd_tflops" in cud[0] else nan
        be = backend_text(r)
        print(f"{w:<26}{r['impl']:<20}{be:<10}{r.get('fwd_tflops', nan):>9.1f}{r.get('bwd_tflops', 0):>9.1f}"
              f"{rf:>10.2f}{rb:>10.2f}")
    varlen = [r for r in rows if r.get("case") == "varlen"]
    if varlen:
        print(f"\npacked varlen, H={VARLEN_HEADS} {VARLEN_DIMS[0]}/{VARLEN_DIMS[1]}, {VARLEN_TOKENS} tokens; "
              f"api/kernel: {OURS} over {OURS_KERNEL} (time)")
        print(f"{'workload':<34}{'impl':<22}{'backend':<10}{'fwd TF/s':>9}{'bwd TF/s':>9}"
              f"{'api/k fwd':>10}{'bwd':>7}{'fwd+bwd':>8}")
    for r in varlen:
        w = workload_text(r)
        if "error" in r:
            print(f"{w:<34}{r['impl']:<22}{'':<10}  {r['error'][:60]}")
            continue
        be = backend_text(r)
        ratios = (f"{r['api_over_kernel']:>10.3f}" if "api_over_kernel" in r else f"{'':>10}") + \
            (f"{r['bwd_api_over_kernel']:>7.3f}" if "bwd_api_over_kernel" in r else f"{'':>7}") + \
            (f"{r['fwd_bwd_api_over_kernel']:>8.3f}" if "fwd_bwd_api_over_kernel" in r else "")
        print(f"{w:<34}{r['impl']:<22}{be:<10}{r.get('fwd_tflops', nan):>9.1f}{r.get('bwd_tflops', nan):>9.1f}"
              f"{ratios}".rstrip())


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="dense S = 4096 only; varlen: the longtail lengths only")
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--no-bwd", action="store_true")
    ap.add_argument("--varlen", action="store_true", help="only the packed variable-length workloads")
    ap.add_argument("--no-varlen", action="store_true", help="only the dense workloads")
    ap.add_argument("--rounds", type=int, default=3,
                    help="passes over all workloads, alternating the order of the implementations (median)")
    ap.add_argument("--no-power", action="store_true",
                    help="do not sample SM clock and board power (nvidia-smi) during each measurement")
    ap.add_argument("--out", default=None, help="write this run alone to this JSON file (and its .png), not to the store")
    ap.add_argument("--results", default=None, help="the results store's folder (default bench/results)")
    ap.add_argument("--peers", default=None,
                    help=f"comma-separated subset of {','.join(PEERS)} (default {','.join(DEFAULT_PEERS)}; "
                         f"'cudnn' names sdpa_cudnn); the "
                         f"varlen workloads time those with a varlen function ({','.join(VARLEN_PEERS)})")
    ap.add_argument("--flex-dims", default=None, help="only run FlexAttention for this Dqk (it compiles per shape)")
    ap.add_argument("--replot", nargs="?", const="", default=None, metavar="FILE",
                    help="only redraw the PNG of the latest run in a results file (default the attention store)")
    args = ap.parse_args(argv)
    if args.varlen and args.no_varlen:
        ap.error("--varlen and --no-varlen exclude each other")
    peer_names = [PEER_ALIASES.get(n, n) for n in args.peers.split(",")] if args.peers else None
    unknown = [n for n in peer_names or () if n not in PEERS]
    if unknown:
        ap.error(f"--peers: unknown {', '.join(unknown)} (known: {', '.join(PEERS)})")
    if args.replot is not None:
        src = Path(args.replot) if args.replot else store_path("attention", args.results)
        plot(latest_rows(load(src)), src.with_suffix(".png"))
        return
    if not torch.cuda.is_available():
        sys.exit("bench_attention needs a CUDA GPU")
    impls = {OURS: ours}
    impls.update(peers(peer_names))
    S = 4096 if args.quick else 8192
    shapes = [(2, 16, S, d, dv, c) for d, dv in ((192, 128), (128, 128)) for c in (False, True)]
    if args.sweep:
        shapes += [(16384 // s, 16, s, 192, 128, c) for s in (1024, 2048, 4096, 16384) for c in (False, True)]
        shapes += [(*LAYER_SHAPE, c) for c in (False, True)]
    if args.varlen:
        shapes = []
    kinds = () if args.no_varlen else ("longtail",) if args.quick else VARLEN_KINDS
    varlen_workloads = [(kind, c) for kind in kinds for c in (False, True)]
    v_impls = varlen_impls(peer_names)
    rows = []
    meta = stamp()
    meta["rounds"] = args.rounds

    def save():  # the run so far, to --out or into the store
        annotate_api_over_kernel(rows)
        return record("attention", meta, rows, out=args.out, results=args.results)
    # Two passes per round: every forward first, then every backward. Timed right after a backward's
    # 250 ms of back-to-back calls, our 128/128 forwards read 0.91-0.97x cuDNN in three runs on the H200;
    # alone (--no-bwd, same commit, warm GPU) 1.00-1.02x. The same kernels' backward also read up to 9%
    # slower here than in tools/profile_ops.py, so the rounds alternate the order of the
    # implementations, and a row's time is the median over rounds (each round's in *_ms_rounds).
    def use_for(d, rnd):
        sel = [(k, f) for k, f in impls.items()
               if not (k == "flex_attention" and args.flex_dims and d != int(args.flex_dims))]
        return dict(sel if rnd % 2 == 0 else sel[::-1])

    def varlen_for(rnd):
        sel = list(v_impls.items())
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
        for kind, c in varlen_workloads:
            for r in bench_varlen_one(kind, VARLEN_HEADS, *VARLEN_DIMS, c, varlen_for(rnd), do_bwd=False):
                merge_round(rows, by_key, r)
            path = save()
        if not args.no_bwd:
            for kind, c in varlen_workloads:
                for r in bench_varlen_one(kind, VARLEN_HEADS, *VARLEN_DIMS, c, varlen_for(rnd), do_fwd=False):
                    merge_round(rows, by_key, r)
                path = save()
    if sampler is not None:
        sampler.close()
        annotate_power(rows, sampler)
        path = save()
    plot(rows, path.with_suffix(".png"))
    print_tables(rows, meta)
    print(f"json: {path}")


if __name__ == "__main__":
    main()
