"""Pure-PyTorch reference path: the exact math the kernels implement, forward and backward.

Serves CPU tensors, float32/float64 inputs, and GPUs or shapes that have no kernel. It is also
what the kernels are tested against. Memory is bounded: work is chunked over queries, so no full
(B, H, Sq, Sk) buffer exists for long sequences, and grouped-query heads are never expanded.

The backward is written out explicitly, FlashAttention style (P recomputed from the saved LSE,
dS = P * (dP - rowsum(dO * O))), instead of being left to autograd, so that float64 gradcheck
through the public API verifies the very formulas the kernels use.

Layouts (see docs/architecture.md): dense q (B, Sq, Hq, Dqk), k (B, Sk, Hkv, Dqk), v (B, Sk, Hkv, Dv),
out (B, Sq, Hq, Dv), lse (B, Hq, Sq); varlen q (Tq, Hq, Dqk) ... with cu_seqlens int32 (B+1,),
out (Tq, Hq, Dv), lse (Hq, Tq). Arithmetic in float32 (float64 for float64 inputs); out in the
input dtype, lse in float32 (float64 for float64 inputs). A query row that sees no key has out 0,
lse -inf, and contributes no gradient.
"""
from __future__ import annotations

import torch

__all__ = ["attention_forward", "attention_backward", "decode_forward"]

# Upper bound on the elements of one chunk's score matrix (float32: 64 MiB).
_CHUNK_ELEMS = 1 << 24


def _compute_dtype(t: torch.Tensor) -> torch.dtype:
    return torch.float64 if t.dtype == torch.float64 else torch.float32


def _chunk_rows(b: int, h: int, sk: int) -> int:
    return max(1, _CHUNK_ELEMS // max(1, b * h * sk))


def _visible(i0: int, i1: int, sq: int, sk: int, causal: bool, bottom_right: bool,
             device: torch.device) -> torch.Tensor | None:
    """(i1-i0, sk) bool mask of keys each query row sees, or None when it sees all of them."""
    if not causal:
        return None
    offset = sk - sq if bottom_right else 0
    i = torch.arange(i0, i1, device=device).unsqueeze(1)
    j = torch.arange(sk, device=device).unsqueeze(0)
    return j <= i + offset


def _scores(qc, k, scale, vis):
    # qc (B, m, Hkv, G, D), k (B, Sk, Hkv, D) -> (B, Hkv, G, m, Sk)
    s = torch.einsum("bihgd,bjhd->bhgij", qc, k) * scale
    if vis is not None:
        s = s.masked_fill(~vis, float("-inf"))
    return s


def _fwd_dense(q, k, v, scale, causal, bottom_right):
    """q (B,Sq,Hq,D) etc. in the compute dtype -> out (B,Sq,Hq,Dv), lse (B,Hq,Sq), compute dtype."""
    B, Sq, Hq, D = q.shape
    Sk, Hkv, Dv = k.shape[1], k.shape[2], v.shape[3]
    G = Hq // Hkv
    out = q.new_zeros(B, Sq, Hq, Dv)
    lse = q.new_full((B, Hq, Sq), float("-inf"))
    if Sq == 0 or Sk == 0:
        return out, lse
    qg = q.view(B, Sq, Hkv, G, D)
    step = _chunk_rows(B, Hq, Sk)
    for i0 in range(0, Sq, step):
        i1 = min(Sq, i0 + step)
        s = _scores(qg[:, i0:i1], k, scale, _visible(i0, i1, Sq, Sk, causal, bottom_right, q.device))
        m = s.amax(dim=-1, keepdim=True)
        m = torch.where(torch.isinf(m), torch.zeros_like(m), m)  # rows with no key: avoid -inf - -inf
        p = torch.exp(s - m)
        l = p.sum(dim=-1, keepdim=True)
        lse_c = (torch.log(l) + m).squeeze(-1)  # log(0) = -inf for rows with no key
        p = p / torch.where(l == 0, torch.ones_like(l), l)
        o = torch.einsum("bhgij,bjhd->bihgd", p, v)
        out[:, i0:i1] = o.reshape(B, i1 - i0, Hq, Dv)
        lse[:, :, i0:i1] = lse_c.reshape(B, Hq, i1 - i0)
    return out, lse


def _bwd_dense(do, q, k, v, o, lse, scale, causal, bottom_right):
    """Explicit FlashAttention backward in the compute dtype -> dq, dk, dv."""
    B, Sq, Hq, D = q.shape
    Sk, Hkv, Dv = k.shape[1], k.shape[2], v.shape[3]
    G = Hq // Hkv
    dq = torch.zeros_like(q)
    dk = torch.zeros_like(k)
    dv = torch.zeros_like(v)
    if Sq == 0 or Sk == 0:
        return dq, dk, dv
    qg = q.view(B, Sq, Hkv, G, D)
    dog = do.view(B, Sq, Hkv, G, Dv)
    delta = (do * o).sum(-1).view(B, Sq, Hkv, G).permute(0, 2, 3, 1)  # (B, Hkv, G, Sq)
    lse_g = lse.view(B, Hkv, G, Sq)
    lse_g = torch.where(torch.isinf(lse_g), torch.zeros_like(lse_g), lse_g)  # empty rows: exp(-inf - 0) = 0
    step = _chunk_rows(B, Hq, Sk)
    for i0 in range(0, Sq, step):
        i1 = min(Sq, i0 + step)
        s = _scores(qg[:, i0:i1], k, scale, _visible(i0, i1, Sq, Sk, causal, bottom_right, q.device))
        p = torch.exp(s - lse_g[..., i0:i1, None])
        doc = dog[:, i0:i1]
        dv += torch.einsum("bhgij,bihgd->bjhd", p, doc)
        dp = torch.einsum("bihgd,bjhd->bhgij", doc, v)
        ds = p * (dp - delta[..., i0:i1, None])
        dq[:, i0:i1] = (torch.einsum("bhgij,bjhd->bihgd", ds, k) * scale).reshape(B, i1 - i0, Hq, D)
        dk += torch.einsum("bhgij,bihgd->bjhd", ds, qg[:, i0:i1]) * scale
    return dq, dk, dv


def _segments(cu: torch.Tensor, rows: int, max_len: int | None) -> list[tuple[int, int]]:
    """Row range [start, end) of each sequence of a packed batch, by the kernels' rule for any values
    (mla_autograd.attention_varlen): cu[b] clamped into [0, rows], cu[b + 1] into [start, rows], the length
    cut at max_len. For valid cu_seqlens, exactly [cu[b], cu[b + 1])."""
    c = cu.tolist()
    out = []
    for a, e in zip(c[:-1], c[1:]):
        s = min(max(a, 0), rows)
        e = min(max(e, s), rows)
        if max_len is not None:
            e = min(e, s + max(max_len, 0))
        out.append((s, e))
    return out


def attention_forward(q, k, v, *, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None,
                      max_seqlen_k=None, softmax_scale, causal, bottom_right):
    """Reference attention forward. Returns (out in q.dtype, lse float32/float64)."""
    cd = _compute_dtype(q)
    qc, kc, vc = q.to(cd), k.to(cd), v.to(cd)
    if cu_seqlens_q is None:
        out, lse = _fwd_dense(qc, kc, vc, softmax_scale, causal, bottom_right)
        return out.to(q.dtype), lse
    Tq, Hq, _ = q.shape
    out = qc.new_zeros(Tq, Hq, v.shape[-1])
    lse = qc.new_full((Hq, Tq), float("-inf"))
    for (qs, qe), (ks, ke) in zip(_segments(cu_seqlens_q, Tq, max_seqlen_q),
                                  _segments(cu_seqlens_k, k.shape[0], max_seqlen_k)):
        o, l = _fwd_dense(qc[None, qs:qe], kc[None, ks:ke], vc[None, ks:ke], softmax_scale, causal, bottom_right)
        out[qs:qe] = o[0]
        lse[:, qs:qe] = l[0]
    return out.to(q.dtype), lse


def attention_backward(dout, q, k, v, out, lse, *, cu_seqlens_q=None, cu_seqlens_k=None,
                       max_seqlen_q=None, max_seqlen_k=None, softmax_scale, causal, bottom_right):
    """Reference attention backward. Returns (dq, dk, dv) in the dtypes of q, k, v."""
    cd = _compute_dtype(q)
    do, qc, kc, vc, oc, lc = (t.to(cd) for t in (dout, q, k, v, out, lse))
    if cu_seqlens_q is None:
        dq, dk, dv = _bwd_dense(do, qc, kc, vc, oc, lc, softmax_scale, causal, bottom_right)
    else:
        dq, dk, dv = torch.zeros_like(qc), torch.zeros_like(kc), torch.zeros_like(vc)
        for (qs, qe), (ks, ke) in zip(_segments(cu_seqlens_q, q.shape[0], max_seqlen_q),
                                      _segments(cu_seqlens_k, k.shape[0], max_seqlen_k)):
            g = _bwd_dense(do[None, qs:qe], qc[None, qs:qe], kc[None, ks:ke], vc[None, ks:ke],
                           oc[None, qs:qe], lc[None, :, qs:qe], softmax_scale, causal, bottom_right)
            dq[qs:qe], dk[ks:ke], dv[ks:ke] = g[0][0], g[1][0], g[2][0]
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


def decode_forward(q_nope, q_pe, ckv_cache, kpe_cache, block_table, cache_seqlens, *, softmax_scale, causal):
    """Reference weight-absorbed MLA decode over a paged latent cache.

    Per request b with L = cache_seqlens[b] tokens (the Sq new ones included), K = [ckv, kpe] and
    V = ckv of positions 0..L-1, gathered through block_table; every head attends to the same K/V.
    Only the rows in use are read, so unused (e.g. NaN-filled) page contents never reach the result.
    Bad values follow the kernels' rule (mla_autograd.decode): L clamped into [0, max_pages * page_size],
    a block_table entry outside [0, num_pages) reads as a page of zeros.
    Returns out (B, Sq, H, Dc) in q_nope.dtype and lse (B, H, Sq).
    """
    B, Sq, H, Dc = q_nope.shape
    num_pages, page = ckv_cache.shape[:2]
    capacity = block_table.shape[1] * page
    cd = _compute_dtype(q_nope)
    out = torch.zeros(B, Sq, H, Dc, dtype=cd, device=q_nope.device)
    lse = torch.full((B, H, Sq), float("-inf"), dtype=cd, device=q_nope.device)
    lens = cache_seqlens.tolist()
    for b in range(B):
        L = min(max(lens[b], 0), capacity)
        if L == 0:
            continue
        pos = torch.arange(L, device=q_nope.device)
        pages = block_table[b].long()[pos // page]
        in_cache = (pages >= 0) & (pages < num_pages)
        if num_pages == 0:
            k = torch.zeros(L, Dc + kpe_cache.shape[2], dtype=cd, device=q_nope.device)
        else:
            pages = torch.where(in_cache, pages, 0)
            rows = pos % page
            k = torch.cat([ckv_cache[pages, rows], kpe_cache[pages, rows]], dim=-1).to(cd)  # (L, Dc+Dr)
            k = torch.where(in_cache[:, None], k, 0)
        q = torch.cat([q_nope[b], q_pe[b]], dim=-1).to(cd)  # (Sq, H, Dc+Dr)
        o, l = _fwd_dense(q[None], k[None, :, None], k[None, :, None, :Dc], softmax_scale, causal, True)
        out[b], lse[b] = o[0], l[0]
    return out.to(q_nope.dtype), lse
