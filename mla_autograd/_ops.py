"""torch.library custom ops with fake (meta) implementations.

``mla_autograd::attn_fwd``, ``mla_autograd::attn_bwd``, ``mla_autograd::mla_attn_fwd``, ``mla_autograd::mla_attn_bwd``,
``mla_autograd::mla_decode`` and ``mla_autograd::mla_decode_schedule`` are opaque to torch.compile (no graph
breaks): their fake implementations give output shapes, and at run time they allocate outputs, consult the
dispatch table and call the chosen backend (a kernel family or the reference path). attn_fwd and mla_attn_fwd
carry their autograd (backward: attn_bwd and mla_attn_bwd; see `attention` and `mla_attention`, the entries of the
functional API). Inputs here are already validated by the functional API.
"""
from __future__ import annotations

import functools
import math
import os
from typing import Optional

import torch
from torch import Tensor

from . import _build, _dispatch, _validate, reference
from ._kernels import FAMILIES
from ._dispatch import Call, explain_call, select
from .schedule import DecodeSchedule

__all__ = ["attn_fwd", "attn_bwd", "mla_attn_fwd", "mla_attn_bwd", "mla_attn_packed_fwd", "mla_attn_packed_bwd",
           "mla_decode", "mla_decode_schedule", "attention", "attention_call", "mla_attention", "mla_attention_packed",
           "mla_call", "adjacent_parts", "concat_mla_parts", "decode_call", "schedule_numel"]


def _lse_dtype(q: Tensor) -> torch.dtype:
    return torch.float64 if q.dtype == torch.float64 else torch.float32


def _lse_shape(q: Tensor, varlen: bool) -> tuple[int, ...]:
    # dense (B, Hq, Sq); varlen (Hq, Tq)
    return (q.shape[1], q.shape[0]) if varlen else (q.shape[0], q.shape[2], q.shape[1])


def _kernel_ready(t: Tensor) -> Tensor:
    """Unit last stride, other strides positive multiples of 8 elements (16-byte TMA/cp.async strides), 16-byte
    aligned base: what every kernel family assumes. Anything else (an expanded, stride-0 view too) is copied
    once here."""
    ok = t.stride(-1) == 1 or t.shape[-1] == 1
    ok = ok and all((s > 0 and s % 8 == 0) or n == 1 for s, n in zip(t.stride()[:-1], t.shape[:-1]))
    ok = ok and t.data_ptr() % 16 == 0
    return t if ok else t.contiguous()


_INT32_MAX = 2**31 - 1


def attention_call(op: str, q: Tensor, k: Tensor, v: Tensor, *, causal: bool, bottom_right: bool,
                   cu_seqlens_q: Optional[Tensor] = None, cu_seqlens_k: Optional[Tensor] = None,
                   max_seqlen_q: Optional[int] = None, deterministic: bool = False,
                   varlen: Optional[bool] = None) -> Call:
    """The dispatch Call of an attention forward / backward: metadata only, no tensor values are read.
    varlen defaults to whether cu_seqlens_q is given (explain() may say varlen without the tensors)."""
    if varlen is None:
        varlen = cu_seqlens_q is not None
    if varlen:
        # one tensor for both (or a view of it): every sequence has as many queries as keys
        seqlens_equal = cu_seqlens_q is not None and cu_seqlens_k is not None and \
            cu_seqlens_q.data_ptr() == cu_seqlens_k.data_ptr() and cu_seqlens_q.shape == cu_seqlens_k.shape and \
            cu_seqlens_q.stride() == cu_seqlens_k.stride()
        rows_q = max_seqlen_q if max_seqlen_q is not None else q.shape[0]
    else:
        seqlens_equal = q.shape[1] == k.shape[1]
        rows_q = q.shape[1]
    return Call(op=op, device=q.device, dtype=q.dtype, dims=(q.shape[-1], v.shape[-1]), causal=causal,
                bottom_right=bottom_right, varlen=varlen, num_heads=q.shape[-2], num_kv_heads=k.shape[-2],
                deterministic=deterministic, seqlens_equal=bool(seqlens_equal),
                out_rows_over_int32=rows_q * q.shape[-2] * v.shape[-1] > _INT32_MAX)


def mla_call(q_nope: Tensor, q_pe: Tensor, k_nope: Tensor, v: Tensor, op: str = "mla_fwd") -> Call:
    """The dispatch Call of an MLA-native forward or backward (op "mla_fwd" / "mla_bwd", dims (Dn, Dr, Dv)):
    metadata only."""
    return Call(op=op, device=q_nope.device, dtype=q_nope.dtype,
                dims=(q_nope.shape[-1], q_pe.shape[-1], v.shape[-1]), num_heads=q_nope.shape[-2],
                num_kv_heads=k_nope.shape[-2])


def decode_call(q_nope: Tensor, q_pe: Tensor, ckv_cache: Tensor) -> Call:
    return Call(op="decode", device=q_nope.device, dtype=q_nope.dtype, dims=(q_nope.shape[-1], q_pe.shape[-1]),
                causal=True, num_heads=q_nope.shape[2], num_kv_heads=1, seqlen_q=q_nope.shape[1],
                page_size=ckv_cache.shape[1])


def eager_direct(*tensors: Tensor) -> bool:
    """Plain tensors outside torch.compile / export tracing: callers may run an op's Python body
    (_attn_fwd, _attn_bwd, _mla_decode) directly instead of through torch.ops: the same code without
    the Python custom-op dispatcher (~55 us of host time per call measured on a 2-core CPU)."""
    return not torch.compiler.is_compiling() and all(type(t) is torch.Tensor for t in tensors)


def _differentiable_call(op, eager_function, body, tensors: tuple, args: tuple):
    """An attention op's differentiable forward: the op under torch.compile and for tensor subclasses; for plain
    eager tensors (eager_direct) eager_function, the op's body with its registered autograd, where autograd records
    the call (a tensor requires grad), else the body itself. tensors: the op's differentiable inputs."""
    if not eager_direct(*tensors):
        return op(*args)
    if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
        return eager_function.apply(*args)
    return body(*args)


def _backward_call(ctx, op, body, tensors: tuple, args: tuple):
    """A backward op's result inside the forward's registered backward (autograd context ctx): its body for plain
    eager tensors, else the op. create_graph=True runs this with grad enabled: then the op, which raises (no double
    backward). A fallback warning of the backward points at the forward's call site (ctx.call_site)."""
    direct = eager_direct(*tensors) and not torch.is_grad_enabled()
    _dispatch.set_backward_site(ctx.call_site)
    try:
        return (body if direct else op)(*args)
    finally:
        _dispatch.set_backward_site(None)


def _empty_problem(q: Tensor, k: Tensor) -> bool:
    return q.numel() == 0 or k.shape[-3] == 0


def _new_out(q: Tensor, v: Tensor, family: str, max_rows_q: int) -> Tensor:
    """The forward's output (q.shape[:-1] + (Dv,), contiguous). For fmha_fwd_sm100 it is a view that starts
    max_rows_q rows (of Hq * Dv elements) into its own allocation: CUTLASS example 77's varlen epilogue
    builds its output descriptor that many rows before the output, and with the padding allocated here
    the kernel writes the result in place instead of through a staging copy."""
    shape = (*q.shape[:-1], v.shape[-1])
    if family != "fmha_fwd_sm100":
        return q.new_empty(shape)
    pad = max_rows_q * q.shape[-2] * v.shape[-1]
    return q.new_empty(pad + math.prod(shape))[pad:].view(shape)


def _check_values_before_kernel(family: str, q: Tensor, k: Tensor, cu_seqlens_q: Optional[Tensor],
                                cu_seqlens_k: Optional[Tensor], max_seqlen_q: int, max_seqlen_k: int,
                                deterministic: bool = False) -> None:
    """The value checks of a varlen call that its kernel needs (by default no call checks values, see
    _validate): a family whose kernels read cu_seqlens unclamped (Family.guards_values false), and the
    deterministic backward, whose ordered dQ reduction waits on per-block counters that sequences overlapping
    each other (a decreasing cu_seqlens) would never complete. MLA_AUTOGRAD_CHECK_VALUES=0 skips these too."""
    if cu_seqlens_q is None or (FAMILIES[family].guards_values and not deterministic):
        return
    if _validate.check_values_enabled(q, cu_seqlens_q, cu_seqlens_k):
        _validate.check_varlen_values(cu_seqlens_q, cu_seqlens_k, q.shape[0], k.shape[0], max_seqlen_q, max_seqlen_k)


def _attn_fwd(q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Optional[Tensor], cu_seqlens_k: Optional[Tensor],
             max_seqlen_q: int, max_seqlen_k: int, softmax_scale: float, causal: bool,
             bottom_right: bool, deterministic: bool = False) -> tuple[Tensor, Tensor]:
    # deterministic is the backward's (saved for it by the op's autograd); the forward is deterministic
    varlen = cu_seqlens_q is not None
    if _empty_problem(q, k):
        out = q.new_zeros(*q.shape[:-1], v.shape[-1])
        return out, torch.full(_lse_shape(q, varlen), float("-inf"), dtype=_lse_dtype(q), device=q.device)
    d = select(attention_call("attn_fwd", q, k, v, causal=causal, bottom_right=bottom_right, cu_seqlens_q=cu_seqlens_q,
                              cu_seqlens_k=cu_seqlens_k, max_seqlen_q=max_seqlen_q))
    if d.family is None:
        return reference.attention_forward(
            q, k, v, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, max_seqlen_q=max_seqlen_q,
            max_seqlen_k=max_seqlen_k, softmax_scale=softmax_scale, causal=causal, bottom_right=bottom_right)
    _check_values_before_kernel(d.family, q, k, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    q, k, v = _kernel_ready(q), _kernel_ready(k), _kernel_ready(v)
    out = _new_out(q, v, d.family, max_seqlen_q if varlen else q.shape[1])
    lse = torch.empty(_lse_shape(q, varlen), dtype=torch.float32, device=q.device)
    _build.load_family(d.family).fwd(q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                     max_seqlen_k, softmax_scale, causal, bottom_right)
    return out, lse


# Each op wraps a plain function that eager callers may run directly (eager_direct); torch.compile sees the op.
attn_fwd = torch.library.custom_op("mla_autograd::attn_fwd", mutates_args=())(_attn_fwd)


@attn_fwd.register_fake
def _(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal, bottom_right,
      deterministic=False):
    varlen = cu_seqlens_q is not None
    out = q.new_empty(*q.shape[:-1], v.shape[-1])
    lse = q.new_empty(_lse_shape(q, varlen), dtype=_lse_dtype(q))
    return out, lse


def _attn_bwd(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
             cu_seqlens_q: Optional[Tensor], cu_seqlens_k: Optional[Tensor], max_seqlen_q: int,
             max_seqlen_k: int, softmax_scale: float, causal: bool, bottom_right: bool,
             deterministic: bool) -> tuple[Tensor, Tensor, Tensor]:
    return _attn_bwd_into(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                          softmax_scale, causal, bottom_right, deterministic)


def _attn_bwd_into(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                   cu_seqlens_q: Optional[Tensor], cu_seqlens_k: Optional[Tensor], max_seqlen_q: int,
                   max_seqlen_k: int, softmax_scale: float, causal: bool, bottom_right: bool, deterministic: bool,
                   dv_out: Optional[Tensor] = None, dk_over_k: bool = False) -> tuple[Tensor, Tensor, Tensor]:
    """attn_bwd's body. dv_out (v's shape and dtype, unit last stride, 16-byte aligned strides): where the SM90
    backward kernel serves the call it writes dv there and returns dv_out itself; every other backend returns
    a new dv (the caller copies it). dk_over_k: k is the caller's scratch, which the SM90 kernel may overwrite
    with dk (dense batches: each CTA reads its K block once, at its start, and writes that block's dK at its
    end, and no other CTA reads those rows; in a packed batch a block's tile reaches into the next sequence's
    rows, whose dK another CTA may already have written). Eager callers only: the op's schema has neither."""
    varlen = cu_seqlens_q is not None
    if _empty_problem(q, k):
        return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    d = select(attention_call("attn_bwd", q, k, v, causal=causal, bottom_right=bottom_right, cu_seqlens_q=cu_seqlens_q,
                              cu_seqlens_k=cu_seqlens_k, max_seqlen_q=max_seqlen_q, deterministic=deterministic))
    if d.family is None:
        return reference.attention_backward(
            dout, q, k, v, out, lse, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
            max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k, softmax_scale=softmax_scale,
            causal=causal, bottom_right=bottom_right)
    _check_values_before_kernel(d.family, q, k, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                deterministic)
    # dout from autograd may be expanded (stride 0) or strided: kernels take a dense copy.
    dout = dout.contiguous()
    q, k, v, out = (_kernel_ready(t) for t in (q, k, v, out))
    dq = torch.empty_like(q, memory_format=torch.contiguous_format)
    if dk_over_k and d.family == "fmha_bwd_sm90" and not varlen and k.is_contiguous():
        dk = k
    else:
        dk = torch.empty_like(k, memory_format=torch.contiguous_format)
    if dv_out is not None and d.family == "fmha_bwd_sm90":  # the family that stores through dv's strides
        dv = dv_out
    else:
        dv = torch.empty_like(v, memory_format=torch.contiguous_format)
    _build.load_family(d.family).bwd(dout, q, k, v, out, lse.contiguous(), dq, dk, dv, cu_seqlens_q, cu_seqlens_k,
                                     max_seqlen_q, max_seqlen_k, softmax_scale, causal, bottom_right,
                                     deterministic)
    return dq, dk, dv


attn_bwd = torch.library.custom_op("mla_autograd::attn_bwd", mutates_args=())(_attn_bwd)


@attn_bwd.register_fake
def _(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale,
      causal, bottom_right, deterministic):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


# ---- autograd: attn_fwd's backward is attn_bwd ----
# Registered on the op itself: torch.compile and export trace attn_fwd as one differentiable op, given any
# tensor for several of its inputs (self-attention's attention(x, x, x), one cu_seqlens for both sides).
# Plain eager tensors take _EagerAttnFwd instead: the same body and formulas in an autograd.Function, since
# the custom-op dispatcher's autograd path adds about 15% to the host time of a small eager forward+backward.
# Saved: q, k, v, out and the float32 LSE (never the attention matrix); attn_bwd recomputes P. lse is not
# differentiable, as in FlashAttention.

def _attn_fwd_setup_context(ctx, inputs, output) -> None:
    q, k, v, cu_seqlens_q, cu_seqlens_k, *args = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k)
    ctx.args = args  # max_seqlen_q, max_seqlen_k, softmax_scale, causal, bottom_right, deterministic
    ctx.mark_non_differentiable(lse)
    # Runs within the forward's call, only when autograd records it: the caller's line outside mla_autograd
    # and torch, where a reference-path warning of the backward points when the autograd engine runs it on
    # a thread with no Python caller. Not walked while torch.compile traces.
    ctx.call_site = None if torch.compiler.is_compiling() else _dispatch.call_site()


def _run_attn_bwd(ctx, dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                  cu_seqlens_q: Optional[Tensor], cu_seqlens_k: Optional[Tensor],
                  dv_out: Optional[Tensor] = None, dk_over_k: bool = False) -> tuple[Tensor, Tensor, Tensor]:
    """(dq, dk, dv) by attn_bwd for a forward whose autograd context is ctx (ctx.args, ctx.call_site). dv_out,
    dk_over_k: see _attn_bwd_into; the returned dv is dv_out only where a kernel wrote it there."""
    body = functools.partial(_attn_bwd_into, dv_out=dv_out, dk_over_k=dk_over_k)
    return _backward_call(ctx, attn_bwd, body, (dout, q, k, v),
                          (dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, *ctx.args))


def _attn_fwd_backward(ctx, dout: Tensor, _dlse):
    q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k = ctx.saved_tensors
    grads = _run_attn_bwd(ctx, dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k)
    return (*grads, *(None,) * (len(ctx.args) + 2))


attn_fwd.register_autograd(_attn_fwd_backward, setup_context=_attn_fwd_setup_context)


def _no_double_backward(ctx, *grads):
    raise RuntimeError("mla_autograd.attention does not support double backward (differentiating "
                       "gradients taken with create_graph=True through the attention op)")


# Backward-of-backward lands on attn_bwd: give it a formula that says so plainly.
attn_bwd.register_autograd(_no_double_backward, setup_context=lambda ctx, inputs, output: None)


def _eager_function(name: str, body, setup_context, backward) -> type:
    """An autograd.Function that runs an op's body with the op's registered autograd (setup_context, backward),
    for plain eager tensors: the op's body and formulas without the custom-op dispatcher."""
    def forward(ctx, *inputs):
        output = body(*inputs)
        setup_context(ctx, inputs, output)
        return output

    return type(name, (torch.autograd.Function,), {"forward": staticmethod(forward), "backward": staticmethod(backward),
                                                   "__doc__": f"{body.__name__} with its registered autograd"})


_EagerAttnFwd = _eager_function("_EagerAttnFwd", _attn_fwd, _attn_fwd_setup_context, _attn_fwd_backward)


def attention(q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Optional[Tensor], cu_seqlens_k: Optional[Tensor],
              max_seqlen_q: int, max_seqlen_k: int, softmax_scale: float, causal: bool, bottom_right: bool,
              deterministic: bool) -> tuple[Tensor, Tensor]:
    """(out, lse) of attn_fwd on validated inputs, differentiable through attn_bwd: the op under torch.compile
    and for tensor subclasses; for plain eager tensors _EagerAttnFwd where autograd records the call, else the
    op's body (eager_direct)."""
    args = (q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal, bottom_right,
            deterministic)
    return _differentiable_call(attn_fwd, _EagerAttnFwd, _attn_fwd, (q, k, v), args)


# ---- MLA's split query / key: mla_attn_fwd reads the parts in place where a kernel row serves it ----

def adjacent_parts(*parts: Tensor) -> Optional[Tensor]:
    """The tensor whose last dim the parts tile in order, as a view of their storage, when they lie side by side
    in one storage as a split of it along the last dim would leave them (same dtype, device, leading shape and
    strides, unit last stride, each starting where the one before ends, rows no narrower than the sum); else
    None, and None for anything but plain eager tensors (a traced graph has no storage to compare). Metadata
    only; never a view autograd records (callers use it with grad off or on grads)."""
    if not eager_direct(*parts):
        return None
    first = parts[0]
    if first.stride(-1) != 1 and first.shape[-1] > 1:
        return None
    width, offset = 0, first.storage_offset()
    storage = first.untyped_storage().data_ptr()
    for t in parts:
        if (t.dtype != first.dtype or t.device != first.device or t.shape[:-1] != first.shape[:-1]
                or t.stride()[:-1] != first.stride()[:-1] or (t.stride(-1) != 1 and t.shape[-1] > 1)
                or t.untyped_storage().data_ptr() != storage or t.storage_offset() != offset + width):
            return None
        width += t.shape[-1]
    if any(s < width for s, n in zip(first.stride()[:-1], first.shape[:-1]) if n > 1):
        return None  # rows would overlap: not the parts of one tensor
    return first.as_strided((*first.shape[:-1], width), (*first.stride()[:-1], 1), first.storage_offset())


def concat_mla_parts(q_nope: Tensor, q_pe: Tensor, k_nope: Tensor, k_pe: Tensor) -> tuple[Tensor, Tensor]:
    """q (..., Hq, Dn + Dr) and k (..., Hkv, Dn + Dr) from the parts, for backends that take q and k whole.

    Parts that already lie side by side (q_nope and q_pe as views of one roped query, see adjacent_parts) are
    that tensor, no copy, where autograd does not record the call. k_pe with one head is expanded (a stride-0
    view, no copy) to k_nope's Hkv heads before the one concatenation that writes k, so the shared rope key is
    materialised only inside k. Differentiable: autograd through cat and expand splits dq / dk back into the
    parts and sums a one-head k_pe's gradient over the heads that shared it, as _split_mla_grads does.
    """
    recorded = torch.is_grad_enabled() and any(t.requires_grad for t in (q_nope, q_pe, k_nope, k_pe))
    q = None if recorded else adjacent_parts(q_nope, q_pe)
    if q is None:
        q = torch.cat([q_nope, q_pe], dim=-1)
    if k_pe.shape[-2] != k_nope.shape[-2]:
        k_pe = k_pe.expand(*k_nope.shape[:-1], k_pe.shape[-1])
    if recorded:
        return q, torch.cat([k_nope, k_pe], dim=-1)
    k = adjacent_parts(k_nope, k_pe)
    if k is None:
        # two copies into one new tensor, not torch.cat: cat's kernel for strided and stride-0 (expanded) inputs
        # runs at about half the bandwidth of a copy at the layer's sizes
        k = torch.empty((*k_nope.shape[:-1], k_nope.shape[-1] + k_pe.shape[-1]), dtype=k_nope.dtype,
                        device=k_nope.device)
        k[..., :k_nope.shape[-1]].copy_(k_nope)
        k[..., k_nope.shape[-1]:].copy_(k_pe)
    return q, k


def _split_mla_grads(dq: Tensor, dk: Tensor, q_nope: Tensor, k_pe: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(dq_nope, dq_pe, dk_nope, dk_pe) of the concatenated q / k's gradients: the backward of
    concat_mla_parts (the same views and the same head sum that autograd of cat and expand computes)."""
    dn = q_nope.shape[-1]
    dq_nope, dq_pe = dq[..., :dn], dq[..., dn:]
    return dq_nope, dq_pe, dk[..., :dn], _rope_key_grad(dk[..., dn:], k_pe)


def _rope_key_grad(dk_pe: Tensor, k_pe: Tensor) -> Tensor:
    """k_pe's gradient from dk_pe (..., Hkv, Dr), the rope key's gradient per kv head: a one-head k_pe's is the sum
    over the heads that shared it (what autograd through its expand computes), else dk_pe itself."""
    return dk_pe.sum(-2, keepdim=True) if k_pe.shape[-2] != dk_pe.shape[-2] else dk_pe


def _mla_attn_fwd(q_nope: Tensor, q_pe: Tensor, k_nope: Tensor, k_pe: Tensor, v: Tensor,
                  cu_seqlens_q: Optional[Tensor], cu_seqlens_k: Optional[Tensor], max_seqlen_q: int, max_seqlen_k: int,
                  softmax_scale: float, causal: bool, bottom_right: bool,
                  deterministic: bool = False) -> tuple[Tensor, Tensor]:
    """(out, lse) of attention on q = [q_nope | q_pe], k = [k_nope | k_pe] (k_pe of one head shared by every kv
    head): where the table's mla_fwd rows pick a kernel, it reads the parts in place; anywhere else the parts
    are concatenated (concat_mla_parts) and attn_fwd's body runs. Shapes: dense q_nope (B, Sq, Hq, Dn), q_pe
    (B, Sq, Hq, Dr), k_nope (B, Sk, Hkv, Dn), k_pe (B, Sk, 1 or Hkv, Dr), v (B, Sk, Hkv, Dv); varlen the same
    without B, packed along the rows. deterministic is the backward's."""
    varlen = cu_seqlens_q is not None
    if _empty_problem(q_nope, k_nope):
        out = q_nope.new_zeros(*q_nope.shape[:-1], v.shape[-1])
        return out, torch.full(_lse_shape(q_nope, varlen), float("-inf"), dtype=_lse_dtype(q_nope),
                               device=q_nope.device)
    d = select(mla_call(q_nope, q_pe, k_nope, v))
    if d.family is None:
        q, k = concat_mla_parts(q_nope, q_pe, k_nope, k_pe)
        return _attn_fwd(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal,
                         bottom_right)
    _check_values_before_kernel(d.family, q_nope, k_nope, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    # TMA's rules (16-byte aligned base and strides) per part, as attn_fwd applies them to q and k: a part that
    # breaks them is copied alone; views of one projection that keep them (a q split at column 128, a k_pe
    # sliced from a (.., 576) row) are read where they are.
    q_nope, q_pe, k_nope, k_pe, v = (_kernel_ready(t) for t in (q_nope, q_pe, k_nope, k_pe, v))
    out = _new_out(q_nope, v, d.family, max_seqlen_q if varlen else q_nope.shape[1])
    lse = torch.empty(_lse_shape(q_nope, varlen), dtype=torch.float32, device=q_nope.device)
    _build.load_family(d.family).fwd_mla(q_nope, q_pe, k_nope, k_pe, v, out, lse, cu_seqlens_q, cu_seqlens_k,
                                         max_seqlen_q, max_seqlen_k, softmax_scale, causal, bottom_right)
    return out, lse


mla_attn_fwd = torch.library.custom_op("mla_autograd::mla_attn_fwd", mutates_args=())(_mla_attn_fwd)


@mla_attn_fwd.register_fake
def _(q_nope, q_pe, k_nope, k_pe, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal,
      bottom_right, deterministic=False):
    out = q_nope.new_empty(*q_nope.shape[:-1], v.shape[-1])
    return out, q_nope.new_empty(_lse_shape(q_nope, cu_seqlens_q is not None), dtype=_lse_dtype(q_nope))


# ---- the MLA-native backward: mla_attn_bwd reads the saved parts in place where a kernel row serves it ----

def _mla_attn_bwd_into(dout: Tensor, q_nope: Tensor, q_pe: Tensor, k_nope: Tensor, k_pe: Tensor, v: Tensor, out: Tensor,
                       lse: Tensor, cu_seqlens_q: Optional[Tensor], cu_seqlens_k: Optional[Tensor], max_seqlen_q: int,
                       max_seqlen_k: int, softmax_scale: float, causal: bool, bottom_right: bool, deterministic: bool,
                       dkv: Optional[Tensor] = None) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """mla_attn_bwd's body: (dq, dk_nope, dk_pe, dv) of mla_attn_fwd for the parts it saved, dq whole
    (..., Hq, Dn + Dr) (dq_nope and dq_pe are its two views), dk_pe of k_pe's shape (a one-head k_pe's gradient
    summed over the kv heads that shared it).

    Where the table's mla_bwd rows pick a kernel it reads the parts in place and writes dk as dk_nope and dk_pe;
    anywhere else the parts are concatenated (concat_mla_parts) for attn_bwd's body and dk split back
    (_split_mla_grads). dkv (mla_attn_packed_bwd's; mla_attn_bwd passes none): a new (..., Hkv, Dn + Dv) buffer,
    the gradient of the tensor whose two halves k_nope and v are: dk_nope and dv are then written into its halves
    and returned as those views."""
    dn = q_nope.shape[-1]
    dk_out = None if dkv is None else dkv[..., :dn]
    dv_out = None if dkv is None else dkv[..., dn:]
    d = None if _empty_problem(q_nope, k_nope) else select(mla_call(q_nope, q_pe, k_nope, v, op="mla_bwd"))
    if d is not None and d.family is not None:
        _check_values_before_kernel(d.family, q_nope, k_nope, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                    deterministic)
        dout = dout.contiguous()  # from autograd it may be expanded (stride 0) or strided
        q_nope, q_pe, k_nope, k_pe, v, out = (_kernel_ready(t) for t in (q_nope, q_pe, k_nope, k_pe, v, out))
        dq = torch.empty((*q_nope.shape[:-1], dn + q_pe.shape[-1]), dtype=q_nope.dtype, device=q_nope.device)
        dk_nope = torch.empty_like(k_nope, memory_format=torch.contiguous_format) if dk_out is None else dk_out
        dv = torch.empty_like(v, memory_format=torch.contiguous_format) if dv_out is None else dv_out
        # per kv head: the kernel writes each head's rope-key gradient, the heads that share k_pe are summed below
        dk_pe = torch.empty((*k_nope.shape[:-1], k_pe.shape[-1]), dtype=k_pe.dtype, device=k_pe.device)
        _build.load_family(d.family).bwd_mla(dout, q_nope, q_pe, k_nope, k_pe, v, out, lse.contiguous(), dq, dk_nope,
                                             dk_pe, dv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                             softmax_scale, causal, bottom_right, deterministic)
        return dq, dk_nope, _rope_key_grad(dk_pe, k_pe), dv
    q, k = concat_mla_parts(q_nope, q_pe, k_nope, k_pe)
    # k is a new tensor here unless k_nope and k_pe lay side by side: then the kernel may write dk over it
    k_is_scratch = eager_direct(k, k_nope) and k.data_ptr() != k_nope.data_ptr()
    dq, dk, dv = _attn_bwd_into(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                softmax_scale, causal, bottom_right, deterministic, dv_out=dv_out,
                                dk_over_k=k_is_scratch)
    _, _, dk_nope, dk_pe = _split_mla_grads(dq, dk, q_nope, k_pe)
    if dkv is not None:
        if dv.data_ptr() != dv_out.data_ptr():
            dv_out.copy_(dv)
        return dq, dk_out.copy_(dk_nope), dk_pe, dv_out
    return dq, dk_nope, dk_pe, dv


def _mla_attn_bwd(dout: Tensor, q_nope: Tensor, q_pe: Tensor, k_nope: Tensor, k_pe: Tensor, v: Tensor, out: Tensor,
                  lse: Tensor, cu_seqlens_q: Optional[Tensor], cu_seqlens_k: Optional[Tensor], max_seqlen_q: int,
                  max_seqlen_k: int, softmax_scale: float, causal: bool, bottom_right: bool,
                  deterministic: bool) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    # an op's outputs may alias neither its inputs nor each other (the concatenated path's dk_nope / dk_pe are views
    # of one dk: copied), and leave in the layout the fake implementation promises (contiguous)
    dq, dk_nope, dk_pe, dv = _mla_attn_bwd_into(dout, q_nope, q_pe, k_nope, k_pe, v, out, lse, cu_seqlens_q,
                                                cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal,
                                                bottom_right, deterministic)
    return dq.contiguous(), dk_nope.contiguous(), dk_pe.contiguous(), dv.contiguous()


mla_attn_bwd = torch.library.custom_op("mla_autograd::mla_attn_bwd", mutates_args=())(_mla_attn_bwd)


@mla_attn_bwd.register_fake
def _(dout, q_nope, q_pe, k_nope, k_pe, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
      softmax_scale, causal, bottom_right, deterministic):
    dq = q_nope.new_empty(*q_nope.shape[:-1], q_nope.shape[-1] + q_pe.shape[-1])
    dense = torch.contiguous_format
    return (dq, torch.empty_like(k_nope, memory_format=dense), torch.empty_like(k_pe, memory_format=dense),
            torch.empty_like(v, memory_format=dense))


mla_attn_bwd.register_autograd(_no_double_backward, setup_context=lambda ctx, inputs, output: None)


# Saved: the five parts (never the concatenated q / k), out and lse; the backward is mla_attn_bwd on them.

def _mla_attn_fwd_setup_context(ctx, inputs, output) -> None:
    q_nope, q_pe, k_nope, k_pe, v, cu_seqlens_q, cu_seqlens_k, *args = inputs
    out, lse = output
    ctx.save_for_backward(q_nope, q_pe, k_nope, k_pe, v, out, lse, cu_seqlens_q, cu_seqlens_k)
    ctx.args = args  # max_seqlen_q, max_seqlen_k, softmax_scale, causal, bottom_right, deterministic
    ctx.mark_non_differentiable(lse)
    ctx.call_site = None if torch.compiler.is_compiling() else _dispatch.call_site()


def _mla_attn_fwd_backward(ctx, dout: Tensor, _dlse):
    q_nope, q_pe, k_nope, k_pe, v, out, lse, cu_seqlens_q, cu_seqlens_k = ctx.saved_tensors
    saved = (q_nope, q_pe, k_nope, k_pe, v, out, lse, cu_seqlens_q, cu_seqlens_k)
    dq, dk_nope, dk_pe, dv = _backward_call(ctx, mla_attn_bwd, _mla_attn_bwd_into,
                                            (dout, q_nope, q_pe, k_nope, k_pe, v), (dout, *saved, *ctx.args))
    dn = q_nope.shape[-1]
    return (dq[..., :dn], dq[..., dn:], dk_nope, dk_pe, dv, *(None,) * (len(ctx.args) + 2))


mla_attn_fwd.register_autograd(_mla_attn_fwd_backward, setup_context=_mla_attn_fwd_setup_context)


_EagerMlaAttnFwd = _eager_function("_EagerMlaAttnFwd", _mla_attn_fwd, _mla_attn_fwd_setup_context,
                                   _mla_attn_fwd_backward)


def mla_attention(q_nope: Tensor, q_pe: Tensor, k_nope: Tensor, k_pe: Tensor, v: Tensor,
                  cu_seqlens_q: Optional[Tensor], cu_seqlens_k: Optional[Tensor], max_seqlen_q: int, max_seqlen_k: int,
                  softmax_scale: float, causal: bool, bottom_right: bool, deterministic: bool) -> tuple[Tensor, Tensor]:
    """(out, lse) of mla_attn_fwd on validated parts, differentiable: chosen as `attention` chooses between the
    op, its eager autograd Function and its body."""
    args = (q_nope, q_pe, k_nope, k_pe, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale,
            causal, bottom_right, deterministic)
    return _differentiable_call(mla_attn_fwd, _EagerMlaAttnFwd, _mla_attn_fwd, (q_nope, q_pe, k_nope, k_pe, v), args)


# ---- the packed MLA op: q = [q_nope | q_pe] and kv = [k_nope | v] as MLA's projections produce them ----
# The same kernels as mla_attn_fwd / mla_attn_bwd on views of q and kv; the backward returns dq and dkv whole
# (the kernel writes dk_nope and dv into the two halves of one dkv), so the projections' backward takes them as
# they are: no concatenation of the parts' gradients, under torch.compile too (where a split's backward is one).

def _packed_parts(q: Tensor, kv: Tensor, d_nope: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(q_nope, q_pe, k_nope, v): views of q (..., Dn + Dr) and kv (..., Dn + Dv) split at d_nope = Dn."""
    return q[..., :d_nope], q[..., d_nope:], kv[..., :d_nope], kv[..., d_nope:]


def _mla_attn_packed_fwd(q: Tensor, kv: Tensor, k_pe: Tensor, d_nope: int, cu_seqlens_q: Optional[Tensor],
                         cu_seqlens_k: Optional[Tensor], max_seqlen_q: int, max_seqlen_k: int, softmax_scale: float,
                         causal: bool, bottom_right: bool, deterministic: bool = False) -> tuple[Tensor, Tensor]:
    """(out, lse) of mla_attn_fwd on q's and kv's parts (_packed_parts): dense q (B, Sq, Hq, Dn + Dr), kv
    (B, Sk, Hkv, Dn + Dv), k_pe (B, Sk, 1 or Hkv, Dr); varlen the same without B."""
    q_nope, q_pe, k_nope, v = _packed_parts(q, kv, d_nope)
    return _mla_attn_fwd(q_nope, q_pe, k_nope, k_pe, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                         softmax_scale, causal, bottom_right, deterministic)


mla_attn_packed_fwd = torch.library.custom_op("mla_autograd::mla_attn_packed_fwd", mutates_args=())(
    _mla_attn_packed_fwd)


@mla_attn_packed_fwd.register_fake
def _(q, kv, k_pe, d_nope, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal,
      bottom_right, deterministic=False):
    out = q.new_empty(*q.shape[:-1], kv.shape[-1] - d_nope)
    return out, q.new_empty(_lse_shape(q, cu_seqlens_q is not None), dtype=_lse_dtype(q))


def _mla_attn_packed_bwd(dout: Tensor, q: Tensor, kv: Tensor, k_pe: Tensor, out: Tensor, lse: Tensor, d_nope: int,
                         cu_seqlens_q: Optional[Tensor], cu_seqlens_k: Optional[Tensor], max_seqlen_q: int,
                         max_seqlen_k: int, softmax_scale: float, causal: bool, bottom_right: bool,
                         deterministic: bool) -> tuple[Tensor, Tensor, Tensor]:
    """(dq, dkv, dk_pe) of mla_attn_packed_fwd: dq and dkv contiguous of q's and kv's shapes, dk_pe of k_pe's (a
    one-head k_pe's gradient summed over the kv heads that shared it)."""
    q_nope, q_pe, k_nope, v = _packed_parts(q, kv, d_nope)
    dkv = torch.empty(kv.shape, dtype=kv.dtype, device=kv.device)
    dq, _, dk_pe, _ = _mla_attn_bwd_into(dout, q_nope, q_pe, k_nope, k_pe, v, out, lse, cu_seqlens_q, cu_seqlens_k,
                                         max_seqlen_q, max_seqlen_k, softmax_scale, causal, bottom_right,
                                         deterministic, dkv=dkv)
    # an op's outputs alias nothing: dk_pe may be a view of the concatenated path's dk
    return dq, dkv, dk_pe.contiguous()


mla_attn_packed_bwd = torch.library.custom_op("mla_autograd::mla_attn_packed_bwd", mutates_args=())(
    _mla_attn_packed_bwd)


@mla_attn_packed_bwd.register_fake
def _(dout, q, kv, k_pe, out, lse, d_nope, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale,
      causal, bottom_right, deterministic):
    dense = torch.contiguous_format
    return (torch.empty_like(q, memory_format=dense), torch.empty_like(kv, memory_format=dense),
            torch.empty_like(k_pe, memory_format=dense))


mla_attn_packed_bwd.register_autograd(_no_double_backward, setup_context=lambda ctx, inputs, output: None)


def _mla_attn_packed_setup_context(ctx, inputs, output) -> None:
    q, kv, k_pe, d_nope, cu_seqlens_q, cu_seqlens_k, *args = inputs
    out, lse = output
    ctx.save_for_backward(q, kv, k_pe, out, lse, cu_seqlens_q, cu_seqlens_k)
    ctx.d_nope = d_nope
    ctx.args = args  # max_seqlen_q, max_seqlen_k, softmax_scale, causal, bottom_right, deterministic
    ctx.mark_non_differentiable(lse)
    ctx.call_site = None if torch.compiler.is_compiling() else _dispatch.call_site()


def _mla_attn_packed_backward(ctx, dout: Tensor, _dlse):
    q, kv, k_pe, out, lse, cu_seqlens_q, cu_seqlens_k = ctx.saved_tensors
    saved = (q, kv, k_pe, out, lse, ctx.d_nope, cu_seqlens_q, cu_seqlens_k)
    dq, dkv, dk_pe = _backward_call(ctx, mla_attn_packed_bwd, _mla_attn_packed_bwd, (dout, q, kv, k_pe),
                                    (dout, *saved, *ctx.args))
    return (dq, dkv, dk_pe, *(None,) * (len(ctx.args) + 3))


mla_attn_packed_fwd.register_autograd(_mla_attn_packed_backward, setup_context=_mla_attn_packed_setup_context)


_EagerMlaAttnPackedFwd = _eager_function("_EagerMlaAttnPackedFwd", _mla_attn_packed_fwd,
                                         _mla_attn_packed_setup_context, _mla_attn_packed_backward)


def mla_attention_packed(q: Tensor, kv: Tensor, k_pe: Tensor, d_nope: int, cu_seqlens_q: Optional[Tensor],
                         cu_seqlens_k: Optional[Tensor], max_seqlen_q: int, max_seqlen_k: int, softmax_scale: float,
                         causal: bool, bottom_right: bool, deterministic: bool) -> tuple[Tensor, Tensor]:
    """(out, lse) of mla_attn_packed_fwd on validated inputs, differentiable: chosen as `attention` chooses between
    the op, its eager autograd Function and its body."""
    args = (q, kv, k_pe, d_nope, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal,
            bottom_right, deterministic)
    return _differentiable_call(mla_attn_packed_fwd, _EagerMlaAttnPackedFwd, _mla_attn_packed_fwd, (q, kv, k_pe), args)


def _mla_decode(q_nope: Tensor, q_pe: Tensor, ckv_cache: Tensor, kpe_cache: Tensor, block_table: Tensor,
               cache_seqlens: Tensor, softmax_scale: float, causal: bool,
               schedule: Optional[Tensor] = None) -> tuple[Tensor, Tensor]:
    B, Sq, H, Dc = q_nope.shape
    if q_nope.numel() == 0:
        return q_nope.new_zeros(B, Sq, H, Dc), torch.full((B, H, Sq), float("-inf"), dtype=_lse_dtype(q_nope),
                                                           device=q_nope.device)
    d = select(decode_call(q_nope, q_pe, ckv_cache))
    if d.family is None:  # the reference path needs no schedule: it is ignored
        return reference.decode_forward(q_nope, q_pe, ckv_cache, kpe_cache, block_table, cache_seqlens,
                                        softmax_scale=softmax_scale, causal=causal)
    if schedule is not None and schedule.numel() == 0:
        schedule = None  # made while the table routed decode to the reference path (the kernel computes its own)
    ext = _build.load_family(d.family)
    route = _decode_route_key(q_nope, q_pe, ckv_cache)
    q_nope, q_pe = _kernel_ready(q_nope), _kernel_ready(q_pe)
    out, lse = ext.decode(q_nope, q_pe, ckv_cache, kpe_cache, block_table.contiguous(), cache_seqlens.contiguous(),
                          None, None, softmax_scale, causal, schedule)
    _decode_kernels[route] = ext
    return out, lse


mla_decode = torch.library.custom_op("mla_autograd::mla_decode", mutates_args=())(_mla_decode)


# ---- decode's eager fast path ----
# A decode step is short (tens of microseconds on the GPU for small batches), so the host time of the call
# matters: the Python checks, the dispatch and the allocations of the checked path take longer than the
# kernels at such sizes. Once a call's route has been checked and taken (in _mla_decode), later eager calls
# with the same route key go straight to the kernel family, whose C++ layer checks every argument before it
# launches anything and allocates out and lse itself. Whatever it refuses goes the checked way, which raises
# the error naming the argument (or copies an input the kernel cannot take as it is).

_decode_kernels: dict = {}  # route key (_decode_route_key) -> the extension module of the family serving it


def _decode_route_key(q_nope: Tensor, q_pe: Tensor, ckv_cache: Tensor) -> tuple:
    """What decode's route depends on (ROUTE_FIELDS["decode"], read off the tensors without building a Call)
    plus MLA_AUTOGRAD_BACKEND."""
    return (q_nope.device, q_nope.dtype, q_nope.shape[1:], q_pe.shape[-1], ckv_cache.shape[1],
            os.environ.get("MLA_AUTOGRAD_BACKEND"))


def decode_fast(q_nope: Tensor, q_pe: Tensor, ckv_cache: Tensor, kpe_cache: Tensor, block_table: Tensor,
                cache_seqlens: Tensor, softmax_scale, causal, schedule) -> tuple[Tensor, Tensor] | None:
    """(out, lse) of mla_autograd.decode (arguments as there; check_values off) straight from its kernel, or
    None where the call must take the checked path: not plain eager CUDA tensors, a route not taken before,
    autograd recording, an empty problem, a schedule that does not match the call, MLA_AUTOGRAD_CHECK_VALUES
    set, or anything the kernel's own checks refuse."""
    T = torch.Tensor
    if not (type(q_nope) is T and type(q_pe) is T and type(ckv_cache) is T and type(kpe_cache) is T
            and type(block_table) is T and type(cache_seqlens) is T):
        return None
    if type(softmax_scale) not in (float, int) or os.environ.get("MLA_AUTOGRAD_CHECK_VALUES") is not None:
        return None
    try:
        ext = _decode_kernels.get(_decode_route_key(q_nope, q_pe, ckv_cache))
    except IndexError:  # fewer dimensions than decode takes
        return None
    if ext is None or torch.compiler.is_compiling() or q_nope.numel() == 0:
        return None
    if torch.is_grad_enabled() and (q_nope.requires_grad or q_pe.requires_grad or ckv_cache.requires_grad
                                    or kpe_cache.requires_grad):
        return None
    sched = None
    if schedule is not None:
        if (type(schedule) is not DecodeSchedule or schedule.device != q_nope.device
                or (schedule.batch, schedule.seqlen_q, schedule.num_heads) != q_nope.shape[:3]
                or schedule.tensor.numel() == 0):
            return None
        if _validate.stale_schedule_message(schedule, cache_seqlens, "") is not None:
            return None  # the checked path raises (or, under CUDA-graph capture, goes on) as it always does
        sched = schedule.tensor
    try:
        return ext.decode(q_nope, q_pe, ckv_cache, kpe_cache, block_table, cache_seqlens, None, None,
                          float(softmax_scale), bool(causal), sched)
    except (RuntimeError, TypeError, ValueError):
        return None


@mla_decode.register_fake
def _(q_nope, q_pe, ckv_cache, kpe_cache, block_table, cache_seqlens, softmax_scale, causal, schedule=None):
    B, Sq, H, Dc = q_nope.shape
    return q_nope.new_empty(B, Sq, H, Dc), q_nope.new_empty((B, H, Sq), dtype=_lse_dtype(q_nope))


# ---- the split-KV schedule of the decode kernel (plan once per decode step, run every layer) ----

_schedule_families: dict = {}


def _schedule_family(device: torch.device, batch: int, seqlen_q: int, num_heads: int) -> str | None:
    """The kernel family a decode of (B, Sq, H) on `device` would use; None for the reference path and for
    an empty problem (neither needs a schedule). The schedule depends on neither dtype nor page size, so
    the table is asked with values the kernel takes
    (bfloat16, (512, 64), page 64); a decode whose dtype or page size sends it to the reference path
    ignores the schedule. Memoised (once per decode step); no fallback warning here, decode gives it."""
    if batch * seqlen_q * num_heads == 0:
        return None
    key = (device, seqlen_q, num_heads, os.environ.get("MLA_AUTOGRAD_BACKEND"))
    fam = _schedule_families.get(key, False)
    if fam is False:
        call = Call(op="decode", device=device, dtype=torch.bfloat16, dims=(512, 64), causal=True,
                    num_heads=num_heads, num_kv_heads=1, seqlen_q=seqlen_q, page_size=64)
        fam = _schedule_families[key] = explain_call(call).family
    return fam


def schedule_numel(device: torch.device, batch: int, seqlen_q: int, num_heads: int) -> int:
    """Elements of mla_decode_schedule's result on `device` (0 where decode runs the reference path): asked
    of the kernel family's own launch-shape code, so the fake size is the real one."""
    fam = _schedule_family(device, batch, seqlen_q, num_heads)
    if fam is None:
        return 0
    index = device.index if device.index is not None else torch.cuda.current_device()
    return int(_build.load_family(fam).schedule_numel(batch, seqlen_q, num_heads, index))


@torch.library.custom_op("mla_autograd::mla_decode_schedule", mutates_args=())
def mla_decode_schedule(cache_seqlens: Tensor, seqlen_q: int, num_heads: int) -> Tensor:
    """The decode kernel's split-KV schedule for these lengths (int32, schedule_numel elements), computed
    on the device; empty where decode runs the reference path (which needs none)."""
    fam = _schedule_family(cache_seqlens.device, cache_seqlens.shape[0], seqlen_q, num_heads)
    if fam is None:
        return torch.empty(0, dtype=torch.int32, device=cache_seqlens.device)
    return _build.load_family(fam).decode_schedule(cache_seqlens.contiguous(), seqlen_q, num_heads)


@mla_decode_schedule.register_fake
def _(cache_seqlens, seqlen_q, num_heads):
    n = schedule_numel(cache_seqlens.device, cache_seqlens.shape[0], seqlen_q, num_heads)
    return cache_seqlens.new_empty((n,), dtype=torch.int32)
