"""Input validation for the public API. Every error names the argument; nothing is computed before.

Shape, dtype, device and stride checks read metadata only, and every call makes them. Checks that read
tensor values (cu_seqlens monotone and consistent, block_table entries in range, cache_seqlens within
capacity) are made on request: they are computed on the inputs' device into one small int64 result, and
only that is copied to the host: one device-to-host copy of 8 bytes per call, which on a GPU is a
synchronisation of the current stream (the host waits for all work queued before the call). The precise
error (which entry, its value) is then read with further small copies, only when a check has failed. The
helpers here make every tensor on the device of their inputs (never on the default device: they run
unchanged under ``with torch.device(...)``).

Which calls check values: by default none (VARLEN_CHECK_VALUES and DECODE_CHECK_VALUES are False), since a
host synchronisation per call would cost the public calls up to several times their kernels' time in decode
loops. Instead the kernels are memory-safe for any values (they clamp lengths, offsets and page ids on the
device; mla_autograd.attention_varlen and mla_autograd.decode say what a request with bad values computes),
and so is the reference path. Calls check values when they pass ``check_values=True``, and where a kernel
needs it (_ops: families without Family.guards_values, the deterministic varlen backward).
MLA_AUTOGRAD_CHECK_VALUES overrides the argument: ``0`` (or empty) never checks, any other value (``1``)
checks every call. The checks are always skipped while torch.compile traces or a CUDA graph is being
captured (a host copy is impossible there).
"""
from __future__ import annotations

import math
import os

import torch

from .schedule import DecodeSchedule

FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float64)


def _name(dt: torch.dtype) -> str:
    return str(dt).replace("torch.", "")


def _check_tensor(name: str, t, rank: int | None = None) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if rank is not None and t.dim() != rank:
        raise ValueError(f"{name} must have {rank} dimensions, got shape {tuple(t.shape)}")


def _check_float(name: str, t: torch.Tensor) -> None:
    if t.dtype not in FLOAT_DTYPES:
        raise TypeError(f"{name} must be bfloat16, float16, float32 or float64, got {_name(t.dtype)}")


def _check_last_stride(name: str, t: torch.Tensor) -> None:
    if t.shape[-1] > 1 and t.stride(-1) != 1:
        raise ValueError(f"{name} must have stride 1 in its last dimension (got strides {t.stride()}); "
                         f"call .contiguous() on it")


def _check_count(name: str, v) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v < 0:
        raise ValueError(f"{name} must be a non-negative int, got {v!r}")
    return v


def _same(name: str, t: torch.Tensor, ref_name: str, ref: torch.Tensor) -> None:
    if t.device != ref.device:
        raise ValueError(f"{name} is on {t.device} but {ref_name} is on {ref.device}")
    if t.dtype != ref.dtype:
        raise TypeError(f"{name} has dtype {_name(t.dtype)} but {ref_name} has {_name(ref.dtype)}")


#: The default of attention_varlen's ``check_values`` argument: the values of cu_seqlens_q / cu_seqlens_k
#: against the packed token counts and max_seqlen_q / max_seqlen_k (one small device-to-host copy per call,
#: see the module docstring).
VARLEN_CHECK_VALUES = False
#: The default of decode's ``check_values`` argument (cache_seqlens within capacity, used block_table
#: entries in range; one small device-to-host copy per call).
DECODE_CHECK_VALUES = False


def tracing_or_capturing(*tensors: torch.Tensor) -> bool:
    """torch.compile is tracing, or a CUDA graph is being captured on the current stream (for CUDA
    tensors): host-side checks of tensor state are skipped then."""
    if torch.compiler.is_compiling():
        return True
    return any(t.is_cuda for t in tensors) and torch.cuda.is_current_stream_capturing()


def check_values_override() -> bool | None:
    """MLA_AUTOGRAD_CHECK_VALUES: False for ``0`` or empty (never check values), True for any other value
    (check them in every call), None when unset (each call's own setting)."""
    env = os.environ.get("MLA_AUTOGRAD_CHECK_VALUES")
    if env is None:
        return None
    return env.strip() not in ("0", "")


def check_values_enabled(*tensors: torch.Tensor, requested: bool = True) -> bool:
    """Whether a call checks tensor values: its own setting `requested`, overridden by
    MLA_AUTOGRAD_CHECK_VALUES, and never while tracing or capturing (`tensors`: the call's inputs)."""
    forced = check_values_override()
    if not (requested if forced is None else forced):
        return False
    return not tracing_or_capturing(*tensors)


def _first_true(mask: torch.Tensor) -> int:
    """Index of the first True of a 1-D bool mask, or its length if none: one reduction on the mask's
    device, then the one device-to-host copy (8 bytes) of the value checks."""
    n = mask.numel()
    if n == 0:
        return 0
    pos = torch.arange(n, device=mask.device)
    return int(torch.where(mask, pos, n).amin().item())


def softmax_scale_or_default(softmax_scale, dqk: int) -> float:
    if softmax_scale is None:
        return 1.0 / math.sqrt(dqk)
    if isinstance(softmax_scale, torch.Tensor) or not isinstance(softmax_scale, (int, float)):
        raise TypeError(f"softmax_scale must be a Python float or None, got {type(softmax_scale).__name__}")
    # The one rule of every path (each kernel family's host layer checks the same: csrc/common/checks.h).
    if isinstance(softmax_scale, bool) or not (math.isfinite(softmax_scale) and softmax_scale > 0):
        raise ValueError(f"softmax_scale must be a finite number > 0, got {softmax_scale!r}")
    return float(softmax_scale)


def causal_bottom_right(causal_align: str) -> bool:
    if causal_align not in ("top_left", "bottom_right"):
        raise ValueError(f"causal_align must be 'top_left' or 'bottom_right', got {causal_align!r}")
    return causal_align == "bottom_right"


def _check_qkv(q, k, v, rank: int) -> None:
    for n, t in (("q", q), ("k", k), ("v", v)):
        _check_tensor(n, t, rank)
    _check_float("q", q)
    _same("k", k, "q", q)
    _same("v", v, "q", q)
    for n, t in (("q", q), ("k", k), ("v", v)):
        _check_last_stride(n, t)
    if k.shape[-1] != q.shape[-1]:
        raise ValueError(f"k head dim {k.shape[-1]} must equal q head dim {q.shape[-1]}")
    if v.shape[:-1] != k.shape[:-1]:
        raise ValueError(f"v shape {tuple(v.shape)} must match k shape {tuple(k.shape)} except the last dim")
    hq, hkv = q.shape[-2], k.shape[-2]
    if hkv == 0 or hq % hkv != 0:
        raise ValueError(f"number of query heads ({hq}) must be a multiple of the number of "
                         f"key/value heads ({hkv}) in k and v")
    if q.shape[-1] == 0 or v.shape[-1] == 0:
        raise ValueError(f"head dims must be positive, got q {q.shape[-1]}, v {v.shape[-1]}")


def check_attention(q, k, v) -> None:
    """q (B, Sq, Hq, Dqk), k (B, Sk, Hkv, Dqk), v (B, Sk, Hkv, Dv)."""
    _check_qkv(q, k, v, 4)
    if k.shape[0] != q.shape[0]:
        raise ValueError(f"k batch size {k.shape[0]} must equal q batch size {q.shape[0]}")


def check_explain(q, k, v, varlen: bool) -> None:
    """What explain checks: the tensor checks of attention (or, with varlen, of attention_varlen's packed
    q, k, v), so that it raises the error the call would raise."""
    if varlen:
        _check_qkv(q, k, v, 3)
    else:
        check_attention(q, k, v)


def check_attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                           check_values: bool = VARLEN_CHECK_VALUES) -> None:
    """Packed q (Tq, Hq, Dqk), k (Tk, Hkv, Dqk), v (Tk, Hkv, Dv), cu_seqlens int32 (B+1,)."""
    _check_qkv(q, k, v, 3)
    _check_varlen_lengths(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, "q", q, q.shape[0], k.shape[0],
                          check_values)


def _check_varlen_lengths(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, ref_name: str,
                          ref: torch.Tensor, total_q: int, total_k: int, check_values: bool) -> None:
    """cu_seqlens_q/k int32 (B+1,) on ref's device; max_seqlen_q/k non-negative ints. With
    check_values_enabled(requested=check_values) also their values (check_varlen_values), at the cost of one
    8-byte device-to-host copy (see the module docstring)."""
    if not isinstance(check_values, bool):
        raise TypeError(f"check_values must be a bool, got {type(check_values).__name__}")
    for n, cu in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
        _check_tensor(n, cu, 1)
        if cu.dtype != torch.int32:
            raise TypeError(f"{n} must be int32, got {_name(cu.dtype)}")
        if cu.device != ref.device:
            raise ValueError(f"{n} is on {cu.device} but {ref_name} is on {ref.device}")
        if cu.numel() < 1:
            raise ValueError(f"{n} must have length batch_size + 1 >= 1, got 0")
    if cu_seqlens_q.numel() != cu_seqlens_k.numel():
        raise ValueError(f"cu_seqlens_q (length {cu_seqlens_q.numel()}) and cu_seqlens_k (length "
                         f"{cu_seqlens_k.numel()}) must both have length batch_size + 1")
    for n, m in (("max_seqlen_q", max_seqlen_q), ("max_seqlen_k", max_seqlen_k)):
        _check_count(n, m)
    if check_values_enabled(ref, cu_seqlens_q, cu_seqlens_k, requested=check_values):
        check_varlen_values(cu_seqlens_q, cu_seqlens_k, total_q, total_k, max_seqlen_q, max_seqlen_k)


def check_varlen_values(cu_seqlens_q, cu_seqlens_k, total_q: int, total_k: int, max_seqlen_q: int,
                        max_seqlen_k: int) -> None:
    """cu_seqlens_q/k start at 0, are non-decreasing and end at the packed token counts total_q / total_k;
    max_seqlen_q/k are at least the longest sequence. Raises ValueError naming the first bad entry."""
    _check_cu_seqlens_values((("cu_seqlens_q", cu_seqlens_q, total_q, "max_seqlen_q", max_seqlen_q),
                              ("cu_seqlens_k", cu_seqlens_k, total_k, "max_seqlen_k", max_seqlen_k)))


def _check_cu_seqlens_values(specs) -> None:
    """specs: (name, cu int32 (B+1,), packed token count, max_seqlen name, max_seqlen) per cu_seqlens.

    On the device, per cu: [cu[0] != 0] + [len_b < 0 for each b] + [cu[-1] != total] + [len_b > max for
    each b], all concatenated in that order (which is the order errors are reported in); one reduction
    finds the first failure and only its index crosses to the host."""
    c = torch.stack([cu for _, cu, _, _, _ in specs]).long()  # int64: differences of int32 cannot wrap
    lens = c[:, 1:] - c[:, :-1]
    parts = []
    for i, (_, _, total, _, mx) in enumerate(specs):
        parts += [c[i, :1] != 0, lens[i] < 0, c[i, -1:] != total, lens[i] > mx]
    first = _first_true(torch.cat(parts))
    B = lens.shape[1]
    per = 2 * B + 2
    if first >= per * len(specs):
        return
    i, j = divmod(first, per)
    n, _, total, mxn, mx = specs[i]
    cu = c[i]
    # A check failed: read what the message needs (the call raises, so these copies cost nothing that matters).
    if j == 0:
        raise ValueError(f"{n}[0] must be 0, got {cu[0].item()}")
    if j <= B:
        b = j - 1
        raise ValueError(f"{n} must be non-decreasing: {n}[{b + 1}] = {cu[b + 1].item()} < "
                         f"{n}[{b}] = {cu[b].item()}")
    if j == B + 1:
        raise ValueError(f"{n}[-1] = {cu[-1].item()} must equal the number of packed tokens ({total})")
    raise ValueError(f"{mxn} = {mx} is smaller than the longest sequence ({lens[i].max().item()})")


def check_decode_explain(q_nope, q_pe, ckv_cache) -> None:
    """The checks of check_decode that involve only q_nope, q_pe and ckv_cache (what explain_decode takes)."""
    for n, t in (("q_nope", q_nope), ("q_pe", q_pe)):
        _check_tensor(n, t, 4)
    _check_tensor("ckv_cache", ckv_cache, 3)
    _check_float("q_nope", q_nope)
    for n, t in (("q_pe", q_pe), ("ckv_cache", ckv_cache)):
        _same(n, t, "q_nope", q_nope)
    for n, t in (("q_nope", q_nope), ("q_pe", q_pe), ("ckv_cache", ckv_cache)):
        _check_last_stride(n, t)
    if q_pe.shape[:3] != q_nope.shape[:3]:
        raise ValueError(f"q_pe shape {tuple(q_pe.shape)} must match q_nope {tuple(q_nope.shape)} in (B, Sq, H)")
    if ckv_cache.shape[2] != q_nope.shape[3]:
        raise ValueError(f"ckv_cache last dim {ckv_cache.shape[2]} must equal q_nope head dim {q_nope.shape[3]}")
    if ckv_cache.shape[1] < 1:
        raise ValueError("ckv_cache page_size (dim 1) must be >= 1")


def _check_mla_tensors(names, rank: int) -> None:
    """Each (name, tensor) a tensor of `rank` dims with unit last stride, the first of a float dtype and the others
    of its dtype and device."""
    for n, t in names:
        _check_tensor(n, t, rank)
    ref_name, ref = names[0]
    _check_float(ref_name, ref)
    for n, t in names[1:]:
        _same(n, t, ref_name, ref)
    for n, t in names:
        _check_last_stride(n, t)


def _check_mla_heads(q_name: str, hq: int, kv_names: str, hkv: int, k_pe, key_name: str, key, rank: int) -> None:
    """Hq a multiple of Hkv; k_pe with the key's leading dims and 1 or Hkv heads."""
    if hkv == 0 or hq % hkv != 0:
        raise ValueError(f"number of query heads ({hq}, {q_name}) must be a multiple of the number of "
                         f"key/value heads ({hkv}) in {kv_names}")
    lead = "(B, Sk)" if rank == 4 else "(Tk,)"
    if k_pe.shape[:-2] != key.shape[:-2]:
        raise ValueError(f"k_pe shape {tuple(k_pe.shape)} must match {key_name} shape {tuple(key.shape)} in {lead}")
    if k_pe.shape[-2] not in (1, hkv):
        raise ValueError(f"k_pe must have 1 head (the rope key shared by every head) or as many as {key_name} "
                         f"({hkv}), got {k_pe.shape[-2]}")


def _check_mla_parts(q_nope, q_pe, k_nope, k_pe, v, rank: int) -> None:
    _check_mla_tensors((("q_nope", q_nope), ("q_pe", q_pe), ("k_nope", k_nope), ("k_pe", k_pe), ("v", v)), rank)
    lead = "(B, Sq, Hq)" if rank == 4 else "(Tq, Hq)"
    if q_pe.shape[:-1] != q_nope.shape[:-1]:
        raise ValueError(f"q_pe shape {tuple(q_pe.shape)} must match q_nope shape {tuple(q_nope.shape)} in {lead}")
    lead = "(B, Sk, Hkv)" if rank == 4 else "(Tk, Hkv)"
    if v.shape[:-1] != k_nope.shape[:-1]:
        raise ValueError(f"v shape {tuple(v.shape)} must match k_nope shape {tuple(k_nope.shape)} in {lead}")
    if rank == 4 and k_nope.shape[0] != q_nope.shape[0]:
        raise ValueError(f"k_nope batch size {k_nope.shape[0]} must equal q_nope batch size {q_nope.shape[0]}")
    _check_mla_heads("q_nope", q_nope.shape[-2], "k_nope and v", k_nope.shape[-2], k_pe, "k_nope", k_nope, rank)
    if k_nope.shape[-1] != q_nope.shape[-1]:
        raise ValueError(f"k_nope head dim {k_nope.shape[-1]} must equal q_nope head dim {q_nope.shape[-1]}")
    if k_pe.shape[-1] != q_pe.shape[-1]:
        raise ValueError(f"k_pe head dim {k_pe.shape[-1]} must equal q_pe head dim {q_pe.shape[-1]}")
    for n, t in (("q_nope", q_nope), ("q_pe", q_pe), ("v", v)):
        if t.shape[-1] == 0:
            raise ValueError(f"{n} head dim must be positive, got 0")


def check_mla_attention(q_nope, q_pe, k_nope, k_pe, v) -> None:
    """q_nope (B, Sq, Hq, Dn), q_pe (B, Sq, Hq, Dr), k_nope (B, Sk, Hkv, Dn), k_pe (B, Sk, 1 or Hkv, Dr),
    v (B, Sk, Hkv, Dv)."""
    _check_mla_parts(q_nope, q_pe, k_nope, k_pe, v, 4)


def _check_mla_packed(q, kv, k_pe, rank: int) -> int:
    """q (..., Hq, Dn + Dr), kv (..., Hkv, Dn + Dv), k_pe (..., 1 or Hkv, Dr), leading dims (B, S) (rank 4) or
    (T,) (rank 3); returns Dn, q's last dim less k_pe's."""
    _check_mla_tensors((("q", q), ("kv", kv), ("k_pe", k_pe)), rank)
    dr = k_pe.shape[-1]
    if not 0 < dr < q.shape[-1]:
        raise ValueError(f"k_pe head dim ({dr}) must be positive and smaller than q's ({q.shape[-1]}): q holds "
                         f"[q_nope | q_pe] in its last dim, q_pe of k_pe's head dim")
    dn = q.shape[-1] - dr
    if kv.shape[-1] <= dn:
        raise ValueError(f"kv head dim ({kv.shape[-1]}) must exceed the nope dim {dn} (q's head dim {q.shape[-1]} "
                         f"less k_pe's {dr}): kv holds [k_nope | v] in its last dim")
    if rank == 4 and kv.shape[0] != q.shape[0]:
        raise ValueError(f"kv batch size {kv.shape[0]} must equal q batch size {q.shape[0]}")
    _check_mla_heads("q", q.shape[-2], "kv", kv.shape[-2], k_pe, "kv", kv, rank)
    return dn


def check_mla_attention_packed(q, kv, k_pe) -> int:
    """q (B, Sq, Hq, Dn + Dr), kv (B, Sk, Hkv, Dn + Dv), k_pe (B, Sk, 1 or Hkv, Dr); returns Dn."""
    return _check_mla_packed(q, kv, k_pe, 4)


def check_mla_attention_packed_varlen(q, kv, k_pe, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                      check_values: bool = VARLEN_CHECK_VALUES) -> int:
    """Packed q (Tq, Hq, Dn + Dr), kv (Tk, Hkv, Dn + Dv), k_pe (Tk, 1 or Hkv, Dr); cu_seqlens as in
    check_attention_varlen; returns Dn."""
    dn = _check_mla_packed(q, kv, k_pe, 3)
    _check_varlen_lengths(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, "q", q, q.shape[0], kv.shape[0],
                          check_values)
    return dn


def check_explain_mla(q_nope, q_pe, k_nope, k_pe, v, varlen: bool) -> None:
    """What explain_mla checks: the tensor checks of mla_attention (or mla_attention_varlen's packed parts)."""
    _check_mla_parts(q_nope, q_pe, k_nope, k_pe, v, 3 if varlen else 4)


def check_mla_attention_varlen(q_nope, q_pe, k_nope, k_pe, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                               max_seqlen_k, check_values: bool = VARLEN_CHECK_VALUES) -> None:
    """Packed q_nope (Tq, Hq, Dn), q_pe (Tq, Hq, Dr), k_nope (Tk, Hkv, Dn), k_pe (Tk, 1 or Hkv, Dr),
    v (Tk, Hkv, Dv); cu_seqlens as in check_attention_varlen."""
    _check_mla_parts(q_nope, q_pe, k_nope, k_pe, v, 3)
    _check_varlen_lengths(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, "q_nope", q_nope,
                          q_nope.shape[0], k_nope.shape[0], check_values)


def check_decode(q_nope, q_pe, ckv_cache, kpe_cache, block_table, cache_seqlens, softmax_scale, *,
                 check_values: bool = DECODE_CHECK_VALUES, schedule=None) -> None:
    """See mla_autograd.decode for shapes. Metadata first (the schedule's too, when one is given); then,
    if check_values_enabled(..., requested=check_values), the values, in one small device-to-host copy."""
    check_decode_explain(q_nope, q_pe, ckv_cache)
    _check_tensor("kpe_cache", kpe_cache, 3)
    _check_tensor("block_table", block_table, 2)
    _check_tensor("cache_seqlens", cache_seqlens, 1)
    _same("kpe_cache", kpe_cache, "q_nope", q_nope)
    _check_last_stride("kpe_cache", kpe_cache)
    for n, t in (("block_table", block_table), ("cache_seqlens", cache_seqlens)):
        if t.dtype != torch.int32:
            raise TypeError(f"{n} must be int32, got {_name(t.dtype)}")
        if t.device != q_nope.device:
            raise ValueError(f"{n} is on {t.device} but q_nope is on {q_nope.device}")
    B = q_nope.shape[0]
    if ckv_cache.shape[:2] != kpe_cache.shape[:2]:
        raise ValueError(f"ckv_cache {tuple(ckv_cache.shape)} and kpe_cache {tuple(kpe_cache.shape)} must "
                         f"agree in (num_pages, page_size)")
    if kpe_cache.shape[2] != q_pe.shape[3]:
        raise ValueError(f"kpe_cache last dim {kpe_cache.shape[2]} must equal q_pe head dim {q_pe.shape[3]}")
    if block_table.shape[0] != B:
        raise ValueError(f"block_table has {block_table.shape[0]} rows, expected batch size {B}")
    if cache_seqlens.shape[0] != B:
        raise ValueError(f"cache_seqlens has length {cache_seqlens.shape[0]}, expected batch size {B}")
    if softmax_scale is None:
        raise ValueError("softmax_scale is required for decode (the absorbed head dim is not the "
                         "model's: pass e.g. 1/sqrt(qk_nope_head_dim + qk_rope_head_dim))")
    softmax_scale_or_default(softmax_scale, 1)
    if schedule is not None:
        check_decode_schedule(schedule, q_nope, cache_seqlens)
    if check_values_enabled(q_nope, block_table, cache_seqlens, requested=check_values):
        _check_decode_values(q_nope.shape[1], q_nope.shape[2], ckv_cache, block_table, cache_seqlens,
                             None if schedule is None else schedule.seqlens_copy)


def _check_decode_values(Sq: int, H: int, ckv_cache, block_table, cache_seqlens, seqlens_copy) -> None:
    """On the device: [cache_seqlens[b] bad for each b] + [block_table[b, p] used and out of range, row-major]
    (+ [cache_seqlens[b] != the schedule's copy for each b]), concatenated in the order errors are
    reported in; one reduction finds the first failure and only its index crosses to the host."""
    num_pages, page = ckv_cache.shape[:2]
    B, max_pages = block_table.shape
    cap = max_pages * page
    lens = cache_seqlens
    bad_len = (lens != 0) & ((lens < Sq) | (lens > cap))
    # column p of block_table is in use for request b iff its first position p * page_size < cache_seqlens[b]
    starts = torch.arange(0, cap, page, device=lens.device)
    bad_page = (starts[None, :] < lens[:, None]) & ((block_table < 0) | (block_table >= num_pages))
    parts = [bad_len, bad_page.flatten()]
    if seqlens_copy is not None:
        parts.append(lens != seqlens_copy)
    first = _first_true(torch.cat(parts))
    if first < B:
        b = first
        raise ValueError(f"cache_seqlens[{b}] = {lens[b].item()} must be 0 (an idle slot) or between "
                         f"the {Sq} new tokens and the block_table capacity {cap} "
                         f"({max_pages} pages x page_size {page})")
    first -= B
    if first < B * max_pages:
        b, p = divmod(first, max_pages)
        raise ValueError(f"block_table[{b}, {p}] = {block_table[b, p].item()} is not a page index in "
                         f"[0, {num_pages}) (num_pages of ckv_cache)")
    first -= B * max_pages
    if seqlens_copy is not None and first < B:
        b = first
        raise ValueError(f"schedule is stale: cache_seqlens[{b}] is {lens[b].item()} but was "
                         f"{seqlens_copy[b].item()} when the schedule was computed (cache_seqlens, an inference "
                         f"tensor, has no version counter: it was modified in place since); "
                         f"{_reschedule(Sq, H)} (once per decode step, after the lengths change)")


def check_decode_schedule_args(cache_seqlens, seqlen_q, num_heads) -> None:
    """See mla_autograd.decode_schedule."""
    _check_tensor("cache_seqlens", cache_seqlens, 1)
    if cache_seqlens.dtype != torch.int32:
        raise TypeError(f"cache_seqlens must be int32, got {_name(cache_seqlens.dtype)}")
    _check_count("seqlen_q", seqlen_q)
    _check_count("num_heads", num_heads)


def seqlens_identity(cache_seqlens: torch.Tensor) -> tuple[int | None, int | None]:
    """(version counter, data pointer) of cache_seqlens, what a schedule records to detect staleness; None
    for what cannot be read: both while torch.compile traces (fake tensors), the version of an inference
    tensor (made under torch.inference_mode: it has no version counter)."""
    if torch.compiler.is_compiling():
        return None, None
    version = None if cache_seqlens.is_inference() else cache_seqlens._version
    return version, cache_seqlens.data_ptr()


def _reschedule(Sq: int, H: int) -> str:
    return f"call mla_autograd.decode_schedule(cache_seqlens, seqlen_q={Sq}, num_heads={H}) for this call"


def check_decode_schedule(schedule, q_nope, cache_seqlens) -> None:
    """A DecodeSchedule passed to decode must be for this call's (B, Sq, H) and device, and for the
    cache_seqlens tensor of this call unchanged since. Metadata only; the staleness check is skipped under
    torch.compile and CUDA-graph capture (as the value checks are)."""
    if not isinstance(schedule, DecodeSchedule):
        raise TypeError(f"schedule must be a DecodeSchedule from mla_autograd.decode_schedule, got "
                        f"{type(schedule).__name__}")
    B, Sq, H = q_nope.shape[:3]
    again = _reschedule(Sq, H)
    if (schedule.batch, schedule.seqlen_q, schedule.num_heads) != (B, Sq, H):
        raise ValueError(f"schedule was computed for (batch, seqlen_q, num_heads) = ({schedule.batch}, "
                         f"{schedule.seqlen_q}, {schedule.num_heads}) but q_nope has (B, Sq, H) = ({B}, {Sq}, {H}): "
                         f"{again}")
    if schedule.device != q_nope.device:
        raise ValueError(f"schedule was computed on {schedule.device} but q_nope is on {q_nope.device}: {again}")
    if tracing_or_capturing(q_nope, cache_seqlens):
        return
    stale = stale_schedule_message(schedule, cache_seqlens, again)
    if stale is not None:
        raise ValueError(stale)


def stale_schedule_message(schedule, cache_seqlens, again: str) -> str | None:
    """Why a DecodeSchedule does not describe cache_seqlens (another tensor, or this one modified in place
    since: its data pointer and version counter; an inference tensor has no version counter), or None when
    it does. `again` says what to do about it. Outside torch.compile."""
    version, ptr = seqlens_identity(cache_seqlens)
    if schedule.seqlens_ptr is not None and ptr != schedule.seqlens_ptr:
        return f"schedule is stale: it was computed from a different cache_seqlens tensor; {again}"
    if schedule.seqlens_version is not None and version is not None and version != schedule.seqlens_version:
        return (f"schedule is stale: cache_seqlens was modified in place since the schedule was computed "
                f"(version {schedule.seqlens_version} -> {version}); {again} (once per decode step, "
                f"after the lengths change)")
    return None


def check_inference_only(*tensors: torch.Tensor) -> None:
    if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
        raise RuntimeError("mla_autograd.decode is inference only: call it under torch.no_grad() or "
                           "torch.inference_mode() (an input requires grad and autograd is recording)")
