"""Input validation for the public API. Every error names the argument; nothing is computed before.

Shape, dtype, device and stride checks read metadata only. Checks that read tensor values
(cu_seqlens monotone and consistent, block_table entries in range, cache_seqlens within capacity)
cost one small device-to-host copy; they are skipped while torch.compile traces or a CUDA graph is
being captured, and can be switched off with MLA_AUTOGRAD_CHECK_VALUES=0.
"""
from __future__ import annotations

import math
import os

import torch

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


def tracing_or_capturing(*tensors: torch.Tensor) -> bool:
    """torch.compile is tracing, or a CUDA graph is being captured on the current stream (for CUDA
    tensors): host-side checks of tensor state are skipped then."""
    if torch.compiler.is_compiling():
        return True
    return any(t.is_cuda for t in tensors) and torch.cuda.is_current_stream_capturing()


def check_values_enabled(*tensors: torch.Tensor) -> bool:
    if os.environ.get("MLA_AUTOGRAD_CHECK_VALUES", "1") in ("0", ""):
        return False
    return not tracing_or_capturing(*tensors)


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


def check_attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k) -> None:
    """Packed q (Tq, Hq, Dqk), k (Tk, Hkv, Dqk), v (Tk, Hkv, Dv), cu_seqlens int32 (B+1,)."""
    _check_qkv(q, k, v, 3)
    _check_varlen_lengths(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, "q", q, q.shape[0], k.shape[0])


def _check_varlen_lengths(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, ref_name: str,
                          ref: torch.Tensor, total_q: int, total_k: int) -> None:
    """cu_seqlens_q/k int32 (B+1,) on ref's device, starting at 0, non-decreasing, ending at the packed
    token counts total_q / total_k; max_seqlen_q/k ints at least the longest sequence. The value checks
    cost one small device-to-host copy (skipped under tracing / capture, see check_values_enabled)."""
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
    if not check_values_enabled(ref, cu_seqlens_q):
        return
    both = torch.stack([cu_seqlens_q, cu_seqlens_k]).cpu().long()
    for i, (n, total, mx, mxn) in enumerate((("cu_seqlens_q", total_q, max_seqlen_q, "max_seqlen_q"),
                                             ("cu_seqlens_k", total_k, max_seqlen_k, "max_seqlen_k"))):
        cu = both[i]
        if cu[0].item() != 0:
            raise ValueError(f"{n}[0] must be 0, got {cu[0].item()}")
        lens = cu[1:] - cu[:-1]
        if (lens < 0).any():
            bad = int(torch.nonzero(lens < 0)[0])
            raise ValueError(f"{n} must be non-decreasing: {n}[{bad + 1}] = {cu[bad + 1].item()} < "
                             f"{n}[{bad}] = {cu[bad].item()}")
        if cu[-1].item() != total:
            raise ValueError(f"{n}[-1] = {cu[-1].item()} must equal the number of packed tokens ({total})")
        if lens.numel() and lens.max().item() > mx:
            raise ValueError(f"{mxn} = {mx} is smaller than the longest sequence ({lens.max().item()})")


def _check_mla_parts(q_nope, q_pe, k_nope, k_pe, v, rank: int) -> None:
    names = (("q_nope", q_nope), ("q_pe", q_pe), ("k_nope", k_nope), ("k_pe", k_pe), ("v", v))
    for n, t in names:
        _check_tensor(n, t, rank)
    _check_float("q_nope", q_nope)
    for n, t in names[1:]:
        _same(n, t, "q_nope", q_nope)
    for n, t in names:
        _check_last_stride(n, t)
    lead = "(B, Sq, Hq)" if rank == 4 else "(Tq, Hq)"
    if q_pe.shape[:-1] != q_nope.shape[:-1]:
        raise ValueError(f"q_pe shape {tuple(q_pe.shape)} must match q_nope shape {tuple(q_nope.shape)} in {lead}")
    lead = "(B, Sk, Hkv)" if rank == 4 else "(Tk, Hkv)"
    if v.shape[:-1] != k_nope.shape[:-1]:
        raise ValueError(f"v shape {tuple(v.shape)} must match k_nope shape {tuple(k_nope.shape)} in {lead}")
    if rank == 4 and k_nope.shape[0] != q_nope.shape[0]:
        raise ValueError(f"k_nope batch size {k_nope.shape[0]} must equal q_nope batch size {q_nope.shape[0]}")
    hq, hkv = q_nope.shape[-2], k_nope.shape[-2]
    if hkv == 0 or hq % hkv != 0:
        raise ValueError(f"number of query heads ({hq}, q_nope) must be a multiple of the number of "
                         f"key/value heads ({hkv}) in k_nope and v")
    lead = "(B, Sk)" if rank == 4 else "(Tk,)"
    if k_pe.shape[:-2] != k_nope.shape[:-2]:
        raise ValueError(f"k_pe shape {tuple(k_pe.shape)} must match k_nope shape {tuple(k_nope.shape)} in {lead}")
    if k_pe.shape[-2] not in (1, hkv):
        raise ValueError(f"k_pe must have 1 head (the rope key shared by every head) or as many as k_nope "
                         f"({hkv}), got {k_pe.shape[-2]}")
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


def check_mla_attention_varlen(q_nope, q_pe, k_nope, k_pe, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                               max_seqlen_k) -> None:
    """Packed q_nope (Tq, Hq, Dn), q_pe (Tq, Hq, Dr), k_nope (Tk, Hkv, Dn), k_pe (Tk, 1 or Hkv, Dr),
    v (Tk, Hkv, Dv); cu_seqlens as in check_attention_varlen."""
    _check_mla_parts(q_nope, q_pe, k_nope, k_pe, v, 3)
    _check_varlen_lengths(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, "q_nope", q_nope,
                          q_nope.shape[0], k_nope.shape[0])


def check_decode(q_nope, q_pe, ckv_cache, kpe_cache, block_table, cache_seqlens, softmax_scale, *,
                 check_values: bool = True) -> None:
    """See mla_autograd.decode for shapes."""
    for n, t in (("q_nope", q_nope), ("q_pe", q_pe)):
        _check_tensor(n, t, 4)
    for n, t in (("ckv_cache", ckv_cache), ("kpe_cache", kpe_cache)):
        _check_tensor(n, t, 3)
    _check_tensor("block_table", block_table, 2)
    _check_tensor("cache_seqlens", cache_seqlens, 1)
    _check_float("q_nope", q_nope)
    for n, t in (("q_pe", q_pe), ("ckv_cache", ckv_cache), ("kpe_cache", kpe_cache)):
        _same(n, t, "q_nope", q_nope)
    for n, t in (("q_nope", q_nope), ("q_pe", q_pe), ("ckv_cache", ckv_cache), ("kpe_cache", kpe_cache)):
        _check_last_stride(n, t)
    for n, t in (("block_table", block_table), ("cache_seqlens", cache_seqlens)):
        if t.dtype != torch.int32:
            raise TypeError(f"{n} must be int32, got {_name(t.dtype)}")
        if t.device != q_nope.device:
            raise ValueError(f"{n} is on {t.device} but q_nope is on {q_nope.device}")
    B, Sq, H, Dc = q_nope.shape
    if q_pe.shape[:3] != q_nope.shape[:3]:
        raise ValueError(f"q_pe shape {tuple(q_pe.shape)} must match q_nope {tuple(q_nope.shape)} in (B, Sq, H)")
    if ckv_cache.shape[:2] != kpe_cache.shape[:2]:
        raise ValueError(f"ckv_cache {tuple(ckv_cache.shape)} and kpe_cache {tuple(kpe_cache.shape)} must "
                         f"agree in (num_pages, page_size)")
    if ckv_cache.shape[2] != Dc:
        raise ValueError(f"ckv_cache last dim {ckv_cache.shape[2]} must equal q_nope head dim {Dc}")
    if kpe_cache.shape[2] != q_pe.shape[3]:
        raise ValueError(f"kpe_cache last dim {kpe_cache.shape[2]} must equal q_pe head dim {q_pe.shape[3]}")
    if ckv_cache.shape[1] < 1:
        raise ValueError("ckv_cache page_size (dim 1) must be >= 1")
    if block_table.shape[0] != B:
        raise ValueError(f"block_table has {block_table.shape[0]} rows, expected batch size {B}")
    if cache_seqlens.shape[0] != B:
        raise ValueError(f"cache_seqlens has length {cache_seqlens.shape[0]}, expected batch size {B}")
    if softmax_scale is None:
        raise ValueError("softmax_scale is required for decode (the absorbed head dim is not the "
                         "model's: pass e.g. 1/sqrt(qk_nope_head_dim + qk_rope_head_dim))")
    softmax_scale_or_default(softmax_scale, 1)
    if not check_values or not check_values_enabled(q_nope, block_table):
        return
    lens = cache_seqlens.cpu().long()
    page = ckv_cache.shape[1]
    cap = block_table.shape[1] * page
    bad = torch.nonzero((lens < 0) | (lens > cap) | ((lens > 0) & (lens < Sq)))
    if bad.numel():
        b = int(bad[0])
        raise ValueError(f"cache_seqlens[{b}] = {int(lens[b])} must be 0 (an idle slot) or between "
                         f"the {Sq} new tokens and the block_table capacity {cap} "
                         f"({block_table.shape[1]} pages x page_size {page})")
    table = block_table.cpu().long()
    used = torch.arange(block_table.shape[1])[None, :] < ((lens + page - 1) // page)[:, None]
    out_of_range = used & ((table < 0) | (table >= ckv_cache.shape[0]))
    if out_of_range.any():
        b, p = (int(x) for x in torch.nonzero(out_of_range)[0])
        raise ValueError(f"block_table[{b}, {p}] = {int(table[b, p])} is not a page index in "
                         f"[0, {ckv_cache.shape[0]}) (num_pages of ckv_cache)")


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


def check_decode_schedule(schedule, q_nope, cache_seqlens) -> None:
    """A DecodeSchedule passed to decode must be for this call's (B, Sq, H) and device, and for the
    cache_seqlens tensor of this call unchanged since. Metadata only; the staleness check is skipped under
    torch.compile and CUDA-graph capture (as the value checks are)."""
    from .functional import DecodeSchedule

    if not isinstance(schedule, DecodeSchedule):
        raise TypeError(f"schedule must be a DecodeSchedule from mla_autograd.decode_schedule, got "
                        f"{type(schedule).__name__}")
    B, Sq, H = q_nope.shape[:3]
    again = (f"call mla_autograd.decode_schedule(cache_seqlens, seqlen_q={Sq}, num_heads={H}) for this call")
    if (schedule.batch, schedule.seqlen_q, schedule.num_heads) != (B, Sq, H):
        raise ValueError(f"schedule was computed for (batch, seqlen_q, num_heads) = ({schedule.batch}, "
                         f"{schedule.seqlen_q}, {schedule.num_heads}) but q_nope has (B, Sq, H) = ({B}, {Sq}, {H}): "
                         f"{again}")
    if schedule.device != q_nope.device:
        raise ValueError(f"schedule was computed on {schedule.device} but q_nope is on {q_nope.device}: {again}")
    if tracing_or_capturing(q_nope, cache_seqlens):
        return
    version, ptr = seqlens_identity(cache_seqlens)
    if schedule.seqlens_ptr is not None and ptr != schedule.seqlens_ptr:
        raise ValueError(f"schedule is stale: it was computed from a different cache_seqlens tensor; {again}")
    if schedule.seqlens_version is not None and version is not None and version != schedule.seqlens_version:
        raise ValueError(f"schedule is stale: cache_seqlens was modified in place since the schedule was computed "
                         f"(version {schedule.seqlens_version} -> {version}); {again} (once per decode step, "
                         f"after the lengths change)")


def check_inference_only(*tensors: torch.Tensor) -> None:
    if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
        raise RuntimeError("mla_autograd.decode is inference only: call it under torch.no_grad() or "
                           "torch.inference_mode() (an input requires grad and autograd is recording)")
