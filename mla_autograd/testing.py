"""Helpers for testing attention kernels: the naive baseline, the tolerance rule, paged caches.

The tolerance rule is FlashAttention's: a kernel's error against a high-precision reference may be
at most ``factor`` times the error of plain PyTorch computing the same thing in the same low
precision, plus a tiny epsilon. It adapts to the shape and the data, and NaN never passes.
"""
from __future__ import annotations

import math

import torch

__all__ = ["naive_attention", "assert_error_within", "random_paged_cache", "dense_mask"]


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
