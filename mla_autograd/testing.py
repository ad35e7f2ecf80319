"""Helpers for testing attention kernels: the naive baseline, the tolerance rule, paged caches.

The tolerance rule is FlashAttention's: a kernel's error against a high-precision reference may be
at most ``factor`` times the error of plain PyTorch computing the same thing in the same low
precision, plus a tiny epsilon. It adapts to the shape and the data, and NaN never passes.
"""
from __future__ import annotations

import dataclasses
import math

import torch

__all__ = ["naive_attention", "assert_error_within", "assert_bitwise", "init_layer_weights", "random_paged_cache", "dense_mask", "BadVarlenCase",
           "BAD_VARLEN_ROWS", "BAD_VARLEN_CASES", "varlen_expected", "bad_decode_case", "compiled_backward_graphs",
           "graph_cats"]


def dense_mask(sq: int, sk: int, *, causal: bool, bottom_right: bool, device=None) -> torch.Tensor:
    """(sq, sk) bool: True where query i sees key j, built with torch.tril."""
    ones = torch.ones(sq, sk, dtype=torch.bool, device=device)
    if not causal:
        return ones
    return torch.tril(ones, diagonal=(sk - sq) if bottom_right else 0)


def _naive_one(q, k, v, scale, causal, bottom_right):
    # q (B, Sq, Hq, D), k/v (B, Sk, Hkv, D): expand kv heads, softmax(QK^T)V in the inputs' dtype.
    g = q.shape[2] // k.shape[2]
    k = k.repeat_interleave(g, dim=2)
    v = v.repeat_interleave(g, dim=2)
    s = torch.einsum("bihd,bjhd->bhij", q, k) * scale
    vis = dense_mask(q.shape[1], k.shape[1], causal=causal, bottom_right=bottom_right, device=q.device)
    s = s.masked_fill(~vis, float("-inf"))
    p = torch.softmax(s, dim=-1)
    p = torch.nan_to_num(p, nan=0.0)  # rows that see no key: output 0
    return torch.einsum("bhij,bjhd->bihd", p.to(v.dtype), v)


def naive_attention(q, k, v, *, softmax_scale=None, causal=False, bottom_right=True,
                    cu_seqlens_q=None, cu_seqlens_k=None):
    """Plain PyTorch attention in the inputs' own dtype, differentiable by ordinary autograd.

    Dense (B, S, H, D) or varlen (T, H, D) with cu_seqlens. Materialises the full score matrix:
    use it for tests and baselines, not for long sequences.
    """
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(q.shape[-1])
    if cu_seqlens_q is None:
        return _naive_one(q, k, v, scale, causal, bottom_right)
    cq, ck = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    outs = [_naive_one(q[None, cq[i]:cq[i + 1]], k[None, ck[i]:ck[i + 1]], v[None, ck[i]:ck[i + 1]],
                       scale, causal, bottom_right)[0] for i in range(len(cq) - 1)]
    if not outs:
        return q.new_zeros(0, q.shape[1], v.shape[-1])
    return torch.cat(outs, dim=0)


def assert_error_within(actual, reference, baseline, *, factor: float = 2.0, eps: float = 1e-5,
                        name: str = "output") -> None:
    """max|actual - ref| <= factor * max|baseline - ref| + eps; NaN/Inf mismatches fail."""
    ref = reference.double()
    a = actual.double()
    if a.shape != ref.shape:
        raise AssertionError(f"{name}: shape {tuple(a.shape)} != reference {tuple(ref.shape)}")
    finite = torch.isfinite(ref)
    if not torch.equal(torch.isfinite(a), finite) or not torch.equal(a[~finite], ref[~finite]):
        raise AssertionError(f"{name}: non-finite values differ from the reference "
                             f"({int((~torch.isfinite(a)).sum())} non-finite vs {int((~finite).sum())})")
    if a.numel() == 0:
        return
    err = (a[finite] - ref[finite]).abs().max().item() if finite.any() else 0.0
    base = (baseline.double()[finite] - ref[finite]).abs().max().item() if finite.any() else 0.0
    if not err <= factor * base + eps:
        raise AssertionError(f"{name}: max error {err:.3e} > {factor} x baseline error {base:.3e} + {eps:g}")


_SAME_WIDTH_INT = {torch.bfloat16: torch.int16, torch.float16: torch.int16, torch.float32: torch.int32,
                   torch.float64: torch.int64}


def assert_bitwise(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    """actual and expected have the same dtype, shape and bits (NaN payloads and signed zeros included); the
    message counts the elements that differ and the largest difference."""
    assert actual.dtype == expected.dtype and actual.shape == expected.shape, \
        f"{what}: {actual.dtype} {tuple(actual.shape)} vs {expected.dtype} {tuple(expected.shape)}"
    as_int = _SAME_WIDTH_INT[actual.dtype]
    a, e = actual.contiguous().view(as_int), expected.contiguous().view(as_int)
    bad = int((a != e).sum())
    worst = (actual.double() - expected.double()).abs().max().item() if bad else 0.0
    assert bad == 0, f"{what}: {bad} of {a.numel()} elements differ in their bits (max |diff| {worst:g})"


def init_layer_weights(layer: torch.nn.Module) -> None:
    """Random weights for an MLA layer under test, drawn from the global generator in parameter order: the norms'
    weights near 1 (1 + 0.1 N(0, 1)), every other parameter N(0, 1 / fan_in) (its last dim), so activations keep
    unit scale through the projections."""
    with torch.no_grad():
        for name, p in layer.named_parameters():
            if "layernorm" in name:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            else:
                p.normal_(0.0, 1.0 / math.sqrt(p.shape[-1]))


def random_paged_cache(cache_seqlens, *, page_size: int, dim_ckv: int = 512, dim_kpe: int = 64,
                       dtype=torch.bfloat16, device=None, fused: bool = True, extra_pages: int = 3,
                       generator: torch.Generator | None = None):
    """A paged latent cache for the given lengths, with shuffled pages and NaN in every unused slot.

    Returns (ckv_cache (P, page_size, dim_ckv), kpe_cache (P, page_size, dim_kpe), block_table int32
    (B, max_pages)). With fused=True both caches are views of one (P, page_size, dim_ckv + dim_kpe)
    buffer, as serving engines store them. Unused pages, the unused tail of each last page and the
    unused block-table entries (which point at a NaN page) are poisoned, so a kernel that reads past
    a request's length produces NaN. device: where the caches and the table are made (default: that of
    cache_seqlens when it is a tensor, else the CPU; never the default device). The random draws come
    from `generator` (a CPU generator) whatever the device.
    """
    lens = [int(x) for x in cache_seqlens]
    pages_per = [max(1, -(-L // page_size)) for L in lens]
    max_pages = max(pages_per) if pages_per else 1
    total = sum(pages_per) + extra_pages
    width = dim_ckv + dim_kpe
    if device is None:
        device = cache_seqlens.device if isinstance(cache_seqlens, torch.Tensor) else torch.device("cpu")
    buf = torch.full((total, page_size, width), float("nan"), dtype=dtype, device=device)
    # random draws and the table are made on the CPU (whatever the default device), then moved
    perm = torch.randperm(total, generator=generator, device="cpu").tolist()
    nan_page = perm[-1]
    table = torch.full((len(lens), max_pages), nan_page, dtype=torch.int32, device="cpu")
    nxt = 0
    for b, L in enumerate(lens):
        for p in range(pages_per[b]):
            pg = perm[nxt]
            nxt += 1
            table[b, p] = pg
            used = min(page_size, L - p * page_size)
            if used > 0:
                buf[pg, :used] = torch.randn(used, width, generator=generator, device="cpu").to(dtype=dtype,
                                                                                                device=buf.device)
    if fused:
        ckv, kpe = buf[..., :dim_ckv], buf[..., dim_ckv:]
    else:
        ckv, kpe = buf[..., :dim_ckv].contiguous(), buf[..., dim_ckv:].contiguous()
    return ckv, kpe, table.to(device)


# ---- inputs that break the value rules: what every path must compute for them (memory-safe, documented) ----

INT32_MIN, INT32_MAX = -2 ** 31, 2 ** 31 - 1


@dataclasses.dataclass(frozen=True)
class BadVarlenCase:
    """cu_seqlens / max_seqlen values that break attention_varlen's rules, over packed tensors of
    ``BAD_VARLEN_ROWS`` = (Tq, Tk) rows, with the row ranges [start, end) every path must take for them
    (mla_autograd.attention_varlen: clamped into the tensor, a decreasing pair empty, cut at max_seqlen),
    written out by hand. ``overlapping``: the ranges overlap, so results there race (run it for memory
    safety only; a sequence with keys and no queries also writes its keys' zero gradients)."""

    name: str
    cu_q: tuple[int, ...]
    cu_k: tuple[int, ...]
    max_q: int
    max_k: int
    ranges_q: tuple[tuple[int, int], ...]
    ranges_k: tuple[tuple[int, int], ...]
    overlapping: bool = False


BAD_VARLEN_ROWS = (40, 48)

BAD_VARLEN_CASES = (
    BadVarlenCase("negative start", (-5, 10, 25, 40), (-5, 12, 30, 48), 20, 20,
                  ((0, 10), (10, 25), (25, 40)), ((0, 12), (12, 30), (30, 48))),
    BadVarlenCase("past the end", (0, 10, 25, 99), (0, 12, 30, 1000), 20, 20,
                  ((0, 10), (10, 25), (25, 40)), ((0, 12), (12, 30), (30, 48))),
    BadVarlenCase("decreasing", (0, 20, 10, 10), (0, 30, 20, 20), 20, 30,
                  ((0, 20), (20, 20), (10, 10)), ((0, 30), (30, 30), (20, 20))),
    BadVarlenCase("longer than max_seqlen", (0, 10, 25, 40), (0, 12, 30, 48), 8, 9,
                  ((0, 8), (10, 18), (25, 33)), ((0, 9), (12, 21), (30, 39))),
    BadVarlenCase("int32 extremes", (INT32_MIN, 10, INT32_MAX, INT32_MAX), (INT32_MIN, 20, INT32_MAX, INT32_MAX),
                  20, 48, ((0, 10), (10, 30), (40, 40)), ((0, 20), (20, 48), (48, 48))),
    BadVarlenCase("max_seqlen past int32", (0, 10, 25, 40), (0, 12, 30, 48), 2 ** 31 + 8, 2 ** 32 + 9,
                  ((0, 10), (10, 25), (25, 40)), ((0, 12), (12, 30), (30, 48))),
    BadVarlenCase("overlapping", (0, 30, 5, 40), (0, 40, 8, 48), 40, 48,
                  ((0, 30), (30, 30), (5, 40)), ((0, 40), (40, 40), (8, 48)), overlapping=True),
)


def varlen_expected(q, k, v, dout, ranges_q, ranges_k, *, softmax_scale, causal, bottom_right):
    """(out, lse, dq, dk, dv) of packed attention over explicit row ranges (one sequence per pair of ranges),
    by the reference path on each sequence alone, in float64; rows no range covers: out and lse NaN (not
    specified), gradients 0. q (Tq, Hq, D), k (Tk, Hkv, D), v (Tk, Hkv, Dv), dout (Tq, Hq, Dv)."""
    from . import reference

    qd, kd, vd, dod = (t.detach().double() for t in (q, k, v, dout))
    out = qd.new_full((q.shape[0], q.shape[1], v.shape[-1]), float("nan"))
    lse = qd.new_full((q.shape[1], q.shape[0]), float("nan"))
    dq, dk, dv = torch.zeros_like(qd), torch.zeros_like(kd), torch.zeros_like(vd)
    kw = dict(softmax_scale=softmax_scale, causal=causal, bottom_right=bottom_right)
    for (qs, qe), (ks, ke) in zip(ranges_q, ranges_k):
        if qe <= qs:
            continue
        qq, kk, vv, dd = qd[None, qs:qe], kd[None, ks:ke], vd[None, ks:ke], dod[None, qs:qe]
        o, l = reference.attention_forward(qq, kk, vv, **kw)
        g = reference.attention_backward(dd, qq, kk, vv, o, l, **kw)
        out[qs:qe], lse[:, qs:qe] = o[0], l[0]
        dq[qs:qe] += g[0][0]
        dk[ks:ke] += g[1][0]
        dv[ks:ke] += g[2][0]
    return out, lse, dq, dk, dv


def bad_decode_case(*, seqlen_q: int = 1, num_heads: int = 16, page_size: int = 16, dim_ckv: int = 512,
                    dim_kpe: int = 64, dtype=torch.bfloat16, device=None, generator=None):
    """A decode problem whose cache_seqlens and block_table break the rules, and the valid problem every path
    must compute for it (mla_autograd.decode), built independently: lengths clamped by hand, bad page ids
    pointed at an extra page of zeros. Returns (bad, valid): two dicts of decode's tensor arguments
    (q_nope, q_pe, ckv_cache, kpe_cache, block_table, cache_seqlens), the same queries in both.

    Requests: a negative length (idle), one past the table's capacity (4 pages), 0 (idle), INT32_MAX, one
    with in-use entries -1 and num_pages + 5 (and an unused one of INT32_MIN), and one of seqlen_q - 1
    tokens (with causal masking its first new token sees nothing)."""
    capacity_pages = 4
    cap = capacity_pages * page_size
    valid_lens = [0, cap, 0, cap, 2 * page_size + 3, max(seqlen_q - 1, 0)]
    ckv, kpe, table = random_paged_cache(torch.tensor([max(x, 1) for x in valid_lens]), page_size=page_size,
                                         dim_ckv=dim_ckv, dim_kpe=dim_kpe, dtype=dtype, device="cpu",
                                         extra_pages=2, generator=generator)
    num_pages = ckv.shape[0]
    assert table.shape[1] == capacity_pages  # the longest requests fill the table: its capacity is cap
    B = len(valid_lens)
    bad_lens = torch.tensor([-7, cap + 50, 0, INT32_MAX, valid_lens[4], valid_lens[5]], dtype=torch.int32)
    bad_table = table.clone()
    bad_table[4, 0], bad_table[4, 1], bad_table[4, 3] = -1, num_pages + 5, INT32_MIN
    # the valid twin: one more page, of zeros, where the bad ids point
    buf = torch.cat([torch.cat([ckv, kpe], -1), torch.zeros(1, page_size, dim_ckv + dim_kpe, dtype=dtype)], 0)
    fixed_table = table.clone()
    fixed_table[4, 0] = fixed_table[4, 1] = num_pages
    q_nope = torch.randn(B, seqlen_q, num_heads, dim_ckv, generator=generator).to(dtype)
    q_pe = torch.randn(B, seqlen_q, num_heads, dim_kpe, generator=generator).to(dtype)
    dev = device if device is not None else "cpu"
    bad = dict(q_nope=q_nope, q_pe=q_pe, ckv_cache=ckv, kpe_cache=kpe, block_table=bad_table, cache_seqlens=bad_lens)
    valid = dict(q_nope=q_nope, q_pe=q_pe, ckv_cache=buf[..., :dim_ckv], kpe_cache=buf[..., dim_ckv:],
                 block_table=fixed_table, cache_seqlens=torch.tensor(valid_lens, dtype=torch.int32))
    return ({n: t.to(dev) for n, t in bad.items()}, {n: t.to(dev) for n, t in valid.items()})


def compiled_backward_graphs(loss_fn, *inputs) -> list:
    """The backward graphs (torch.fx.GraphModule, ATen ops after AOT autograd) that torch.compile makes of
    ``loss_fn(*inputs)``, a scalar, compiled whole (fullgraph) and run once forward and backward. What a compiled
    training step would run, without Inductor: for tests that look for copies the backward should not make."""
    from functorch.compile import make_boxed_func
    from torch._functorch.aot_autograd import aot_module_simplified

    graphs = []

    def keep_backward(gm, _):
        graphs.append(gm)
        return make_boxed_func(gm.forward)

    def backend(gm, example_inputs):
        return aot_module_simplified(gm, example_inputs, fw_compiler=lambda g, _: make_boxed_func(g.forward),
                                     bw_compiler=keep_backward)

    torch._dynamo.reset()
    torch.compile(loss_fn, backend=backend, fullgraph=True)(*inputs).backward()
    return graphs


def graph_cats(graphs) -> list[tuple[int, ...]]:
    """The output shapes of the concatenations (aten.cat) in fx graphs (compiled_backward_graphs')."""
    return [tuple(n.meta["val"].shape) for g in graphs for n in g.graph.nodes
            if n.op == "call_function" and n.target is torch.ops.aten.cat.default]

