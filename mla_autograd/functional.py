"""Public functional API: attention, attention_varlen, mla_attention, mla_attention_varlen, decode,
decode_schedule, explain, explain_mla, explain_decode."""
from __future__ import annotations

import dataclasses

import torch
from torch import Tensor

from . import _ops, _validate as V
from ._dispatch import explain_call
from ._ops import attention_call, decode_call
from .schedule import DecodeSchedule

__all__ = ["attention", "attention_varlen", "mla_attention", "mla_attention_varlen", "decode", "decode_schedule",
           "DecodeSchedule", "explain", "explain_mla", "explain_decode"]


def attention(q: Tensor, k: Tensor, v: Tensor, *, causal: bool = False, causal_align: str = "bottom_right",
              softmax_scale: float | None = None, deterministic: bool = False, return_lse: bool = False):
    """Fused scaled-dot-product attention with (optionally) different q/k and v head dims.

    Args:
        q: (B, Sq, Hq, Dqk) bfloat16/float16 (kernels) or float32/float64 (reference path).
        k: (B, Sk, Hkv, Dqk), same dtype and device; Hq must be a multiple of Hkv (GQA/MQA:
            query head h uses key/value head h // (Hq // Hkv)).
        v: (B, Sk, Hkv, Dv).
            All three may be non-contiguous as long as the last dim has stride 1.
        causal: apply a causal mask.
        causal_align: "bottom_right" (FlashAttention >= 2.1: query i sees keys j <= i + Sk - Sq) or
            "top_left" (PyTorch SDPA is_causal: j <= i). A query that sees no key gets output 0,
            LSE -inf and zero gradients.
        softmax_scale: default 1/sqrt(Dqk).
        deterministic: bit-reproducible backward (slower where the kernel must order its reductions).
        return_lse: also return the log-sum-exp.

    Returns:
        out (B, Sq, Hq, Dv) in q's dtype; with return_lse also lse (B, Hq, Sq) float32 (float64 for
        float64 inputs), natural log of sum_j exp(softmax_scale * q.k_j). lse is not differentiable.

    Kernels: (Dqk, Dv) in {(192, 128), (128, 128), (64, 64)} on SM90 / (192, 128), (128, 128) on SM100;
    anything else runs the reference path (see mla_autograd.explain).
    """
    V.check_attention(q, k, v)
    scale = V.softmax_scale_or_default(softmax_scale, q.shape[-1])
    bottom_right = V.causal_bottom_right(causal_align)
    out, lse = _ops.attention(q, k, v, None, None, q.shape[1], k.shape[1], scale, bool(causal), bottom_right,
                              bool(deterministic))
    return (out, lse) if return_lse else out


def attention_varlen(q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor,
                     max_seqlen_q: int, max_seqlen_k: int, *, causal: bool = False,
                     causal_align: str = "bottom_right", softmax_scale: float | None = None,
                     deterministic: bool = False, return_lse: bool = False,
                     check_values: bool = V.VARLEN_CHECK_VALUES):
    """Attention over packed variable-length sequences (no padding).

    Args:
        q: (Tq, Hq, Dqk), the B query sequences concatenated; k: (Tk, Hkv, Dqk); v: (Tk, Hkv, Dv).
        cu_seqlens_q, cu_seqlens_k: int32 (B + 1,) on q's device, cumulative lengths starting at 0
            and ending at Tq / Tk; sequence b is rows cu[b]:cu[b+1]. Lengths may be 0.
        max_seqlen_q, max_seqlen_k: Python ints >= the longest sequence (they size kernel grids).
        Keywords as in `attention`; the causal offset is taken per sequence.
        check_values: check the rules above on the device (cu_seqlens_*[0] == 0, non-decreasing,
            cu_seqlens_*[-1] == Tq / Tk, max_seqlen_* >= the longest sequence) and raise a ValueError
            naming the first bad entry before anything runs. One int64 result is copied to the host: 8
            bytes, but on a GPU a synchronisation (the host waits for the work queued before the call), so
            it is off by default. MLA_AUTOGRAD_CHECK_VALUES overrides it (``1`` checks every call, ``0``
            none); skipped while torch.compile traces or a CUDA graph is captured.

    Returns:
        out (Tq, Hq, Dv); with return_lse also lse (Hq, Tq) float32.

    Values that break the rules never make a kernel read or write outside these tensors. Every path (the
    SM90 kernels and the reference) takes sequence b as rows [s, s + n) with s = cu[b] clamped into
    [0, T], its end cu[b + 1] clamped into [s, T], and n cut at max_seqlen: a decreasing pair gives an
    empty sequence, rows past the end are dropped, a sequence longer than max_seqlen keeps its first
    max_seqlen rows (queries) or keys. Rows of out and lse that no sequence covers are not written (their
    contents are unspecified), and their gradients are 0. Sequences that overlap (after a decreasing
    cu_seqlens) are computed independently and race where they overlap; the SM90 backward's packed grids hold
    only as many blocks as sequences that do not overlap can fill, so there the gradients of the sequences
    from the overlap on are unspecified (nothing outside the tensors is touched). The deterministic backward
    checks the values whatever check_values says (its ordered dQ reduction cannot complete for overlapping
    sequences). The SM100 kernels run on a copy of cu_seqlens made on the device, each entry clamped into
    [0, T] and raised to the one before: there a sequence that starts before the previous one ends starts
    at that end, and a sequence longer than max_seqlen is not cut (its out, lse and gradients are
    unspecified; nothing outside the tensors is touched and the other sequences are unaffected). On SM100
    a sequence's last partial tile also reads the packed rows after it, so a NaN/Inf in the next
    sequence's k/v (q/dO in the backward) can reach its results.
    """
    V.check_attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, check_values)
    scale = V.softmax_scale_or_default(softmax_scale, q.shape[-1])
    bottom_right = V.causal_bottom_right(causal_align)
    out, lse = _ops.attention(q, k, v, cu_seqlens_q, cu_seqlens_k, int(max_seqlen_q), int(max_seqlen_k), scale,
                              bool(causal), bottom_right, bool(deterministic))
    return (out, lse) if return_lse else out


# ---- MLA-shaped inputs: the query/key split into a "nope" part and a rope part ----

# How mla_attention's parts reach a backend, and why (what explain_mla reports): read in place by a kernel that
# takes them (the mla_fwd rows of the dispatch table), or concatenated at the boundary for attn_fwd's rows.
MLA_PATH_NATIVE = "native"
MLA_PATH_CONCAT = "concat"
MLA_PATH_REASONS = {
    MLA_PATH_NATIVE: ("the forward kernel reads q_nope/q_pe and k_nope/k_pe in place (no concatenated q or k); "
                      "so does the backward where the dispatch table's mla_bwd rows pick a kernel (see .backward), "
                      "else it concatenates the saved parts once for attn_bwd"),
    MLA_PATH_CONCAT: ("q = [q_nope, q_pe] and k = [k_nope, k_pe expanded to Hkv heads] are built at the boundary "
                      "(one copy of each)"),
}


def _mla_dispatch(q_nope: Tensor, q_pe: Tensor, k_nope: Tensor, k_pe: Tensor, v: Tensor, cu_seqlens_q, cu_seqlens_k,
                  max_seqlen_q: int, max_seqlen_k: int, softmax_scale: float, causal: bool, bottom_right: bool,
                  deterministic: bool) -> tuple[Tensor, Tensor]:
    """The one place where mla_attention / mla_attention_varlen hand validated parts to a backend: the
    differentiable mla_attn_fwd op, which at run time reads them in place where the dispatch table's mla_fwd rows
    pick a kernel (SM90, (Dn, Dr, Dv) = (128, 64, 128), 16-bit) and otherwise concatenates them
    (_ops.concat_mla_parts) for attn_fwd's rows, as `attention` on the concatenation would. The choice is made
    inside the op, so torch.compile traces one op either way. Returns (out, lse) as _ops.attention does.
    """
    return _ops.mla_attention(q_nope, q_pe, k_nope, k_pe, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                              softmax_scale, causal, bottom_right, deterministic)


def mla_attention(q_nope: Tensor, q_pe: Tensor, k_nope: Tensor, k_pe: Tensor, v: Tensor, *, causal: bool = False,
                  causal_align: str = "bottom_right", softmax_scale: float | None = None,
                  deterministic: bool = False, return_lse: bool = False):
    """Attention with MLA's split query/key: scores softmax_scale * (q_nope.k_nope + q_pe.k_pe).

    The same result and gradients as
    ``attention(cat([q_nope, q_pe], -1), cat([k_nope, k_pe.expand(B, Sk, Hkv, Dr)], -1), v, ...)``, with
    the gradient of a one-head k_pe summed over the heads that share it.

    Args:
        q_nope: (B, Sq, Hq, Dn) bfloat16/float16 (kernels) or float32/float64 (reference path); the
            non-rotary query part (Dn = qk_nope_head_dim, 128 in DeepSeek-V2/V3).
        q_pe: (B, Sq, Hq, Dr), same dtype and device: the rotary query part (Dr = qk_rope_head_dim, 64).
        k_nope: (B, Sk, Hkv, Dn); Hq must be a multiple of Hkv (GQA/MQA: query head h uses key/value
            head h // (Hq // Hkv)).
        k_pe: (B, Sk, 1, Dr), the roped key shared by every head (as MLA computes it), or (B, Sk, Hkv, Dr).
        v: (B, Sk, Hkv, Dv) (Dv = v_head_dim, 128).
            All five may be non-contiguous (e.g. splits of one projection) as long as the last dim has
            stride 1.
        causal, causal_align, deterministic, return_lse: as in `attention`.
        softmax_scale: default 1/sqrt(Dn + Dr).

    Returns:
        out (B, Sq, Hq, Dv) in q_nope's dtype; with return_lse also lse (B, Hq, Sq) float32 (float64 for
        float64 inputs), not differentiable.

    On SM90 with (Dn, Dr, Dv) = (128, 64, 128) in bfloat16/float16 (dense and varlen) the forward kernel reads
    the five parts where they are: no concatenated q or k is written, and a one-head k_pe is read once per kv
    head from its single copy. out and lse are bit for bit those of `attention` on the concatenation. Parts
    whose base or strides are not 16-byte aligned (TMA's rule) are copied alone first. The backward saves the
    parts and concatenates them once for the attention backward. Everywhere else (CPU, SM100, other dims) the
    parts are concatenated at the boundary (one copy of q and of k, the shared rope key written once per kv
    head) and the kernels serve (Dn + Dr, Dv) as `attention` does. `explain_mla` says which path and backends a
    call uses.
    """
    V.check_mla_attention(q_nope, q_pe, k_nope, k_pe, v)
    scale = V.softmax_scale_or_default(softmax_scale, q_nope.shape[-1] + q_pe.shape[-1])
    bottom_right = V.causal_bottom_right(causal_align)
    out, lse = _mla_dispatch(q_nope, q_pe, k_nope, k_pe, v, None, None, q_nope.shape[1], k_nope.shape[1], scale,
                             bool(causal), bottom_right, bool(deterministic))
    return (out, lse) if return_lse else out


def mla_attention_varlen(q_nope: Tensor, q_pe: Tensor, k_nope: Tensor, k_pe: Tensor, v: Tensor, cu_seqlens_q: Tensor,
                         cu_seqlens_k: Tensor, max_seqlen_q: int, max_seqlen_k: int, *, causal: bool = False,
                         causal_align: str = "bottom_right", softmax_scale: float | None = None,
                         deterministic: bool = False, return_lse: bool = False,
                         check_values: bool = V.VARLEN_CHECK_VALUES):
    """`mla_attention` over packed variable-length sequences (no padding).

    Args:
        q_nope: (Tq, Hq, Dn), q_pe: (Tq, Hq, Dr): the B query sequences concatenated.
        k_nope: (Tk, Hkv, Dn), k_pe: (Tk, 1, Dr) (shared by every head) or (Tk, Hkv, Dr), v: (Tk, Hkv, Dv).
        cu_seqlens_q, cu_seqlens_k: int32 (B + 1,) on q_nope's device, cumulative lengths starting at 0
            and ending at Tq / Tk; lengths may be 0.
        max_seqlen_q, max_seqlen_k: Python ints >= the longest sequence.
        Keywords as in `mla_attention`; the causal offset is taken per sequence. check_values, and what
        values that break these rules compute: as in `attention_varlen`.

    Returns:
        out (Tq, Hq, Dv); with return_lse also lse (Hq, Tq) float32 (float64 for float64 inputs).
    """
    V.check_mla_attention_varlen(q_nope, q_pe, k_nope, k_pe, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                 max_seqlen_k, check_values)
    scale = V.softmax_scale_or_default(softmax_scale, q_nope.shape[-1] + q_pe.shape[-1])
    bottom_right = V.causal_bottom_right(causal_align)
    out, lse = _mla_dispatch(q_nope, q_pe, k_nope, k_pe, v, cu_seqlens_q, cu_seqlens_k, int(max_seqlen_q),
                             int(max_seqlen_k), scale, bool(causal), bottom_right, bool(deterministic))
    return (out, lse) if return_lse else out


def mla_attention_packed(q: Tensor, kv: Tensor, k_pe: Tensor, *, causal: bool = False,
                         causal_align: str = "bottom_right", softmax_scale: float | None = None,
                         deterministic: bool = False, return_lse: bool = False):
    """`mla_attention` with the query and the key/value packed as MLA's projections produce them: q holds
    [q_nope | q_pe] and kv holds [k_nope | v] along their last dims.

    Args:
        q: (B, Sq, Hq, Dn + Dr) bfloat16/float16 (kernels) or float32/float64 (reference path): per head the
            non-rotary part (Dn, 128 in DeepSeek-V2/V3) followed by the rotary part (Dr, 64), e.g. the query
            projection with RoPE applied to its last Dr columns.
        kv: (B, Sk, Hkv, Dn + Dv), same dtype and device: per head k_nope (Dn) followed by v (Dv), e.g. the
            latent's up-projection (kv_b_proj) viewed per head; Hq must be a multiple of Hkv.
        k_pe: (B, Sk, 1, Dr), the roped key shared by every head, or (B, Sk, Hkv, Dr). Its last dim is Dr, which
            fixes Dn = q.shape[-1] - Dr and Dv = kv.shape[-1] - Dn.
            All three may be non-contiguous as long as the last dim has stride 1.
        causal, causal_align, softmax_scale, deterministic, return_lse: as in `mla_attention` (softmax_scale
            defaults to 1/sqrt(Dn + Dr)).

    Returns:
        out (B, Sq, Hq, Dv); with return_lse also lse (B, Hq, Sq) float32 (float64 for float64 inputs).

    The same result, bit for bit, and gradients as `mla_attention` on q's and kv's parts
    (``q[..., :Dn], q[..., Dn:], kv[..., :Dn], k_pe, kv[..., Dn:]``), served by the same kernels. The difference
    is in the backward: dq and dkv come back whole, the kernels writing the parts' gradients into their halves,
    where the parts split off by the caller would have their gradients concatenated by the split's backward
    (one copy of each, which torch.compile does not remove).
    """
    dn = V.check_mla_attention_packed(q, kv, k_pe)
    scale = V.softmax_scale_or_default(softmax_scale, q.shape[-1])
    bottom_right = V.causal_bottom_right(causal_align)
    out, lse = _ops.mla_attention_packed(q, kv, k_pe, dn, None, None, q.shape[1], kv.shape[1], scale, bool(causal),
                                         bottom_right, bool(deterministic))
    return (out, lse) if return_lse else out


def mla_attention_packed_varlen(q: Tensor, kv: Tensor, k_pe: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor,
                                max_seqlen_q: int, max_seqlen_k: int, *, causal: bool = False,
                                causal_align: str = "bottom_right", softmax_scale: float | None = None,
                                deterministic: bool = False, return_lse: bool = False,
                                check_values: bool = V.VARLEN_CHECK_VALUES):
    """`mla_attention_packed` over packed variable-length sequences (no padding).

    Args:
        q: (Tq, Hq, Dn + Dr), kv: (Tk, Hkv, Dn + Dv), k_pe: (Tk, 1 or Hkv, Dr): the B sequences concatenated.
        cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, check_values: as in `attention_varlen`.
        Keywords as in `mla_attention_packed`; the causal offset is taken per sequence.

    Returns:
        out (Tq, Hq, Dv); with return_lse also lse (Hq, Tq) float32 (float64 for float64 inputs).
    """
    dn = V.check_mla_attention_packed_varlen(q, kv, k_pe, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                             check_values)
    scale = V.softmax_scale_or_default(softmax_scale, q.shape[-1])
    bottom_right = V.causal_bottom_right(causal_align)
    out, lse = _ops.mla_attention_packed(q, kv, k_pe, dn, cu_seqlens_q, cu_seqlens_k, int(max_seqlen_q),
                                         int(max_seqlen_k), scale, bool(causal), bottom_right, bool(deterministic))
    return (out, lse) if return_lse else out


def decode_schedule(cache_seqlens: Tensor, *, seqlen_q: int, num_heads: int) -> DecodeSchedule:
    """Plan the split-KV work of `decode` once per decode step (as FlashMLA's get_mla_metadata).

    Every layer of a decode step calls `decode` with the same cache_seqlens; by default each call first
    splits the requests' KV ranges over the SMs: for up to 256 requests inside the main kernel (each of its
    CTAs reads all B lengths to find its own share), for more with a small scheduling kernel. Compute that
    schedule once here (one small kernel) and pass it to every layer's ``decode(..., schedule=...)``: the
    layers then skip that work, with bit-identical results.

    Args:
        cache_seqlens: int32 (B,) on the decode's device, tokens in the cache per request (the Sq new
            ones included): the very tensor the decode calls will be given. Read on the device, never on
            the host (no sync; CUDA-graph capturable).
        seqlen_q: Sq, new tokens per request of the decode calls (q_nope.shape[1]).
        num_heads: H, query heads of the decode calls (q_nope.shape[2]).

    Returns:
        A DecodeSchedule for calls with q_nope of shape (B, seqlen_q, num_heads, Dc) on this device; its
        tensors are on cache_seqlens' device.

    Recompute it whenever the lengths change, i.e. every decode step (they grow by Sq each step): a
    schedule only describes the lengths it was computed from. `decode` raises if it is given another
    lengths tensor (data pointer differs) or if cache_seqlens was modified in place since (its version
    counter changed). An inference tensor (created under torch.inference_mode) has no version counter:
    for one, the schedule keeps a device copy of the lengths (B int32, copied on the device, no sync) and
    an in-place change is detected only by decode calls that check values (check_values=True or
    MLA_AUTOGRAD_CHECK_VALUES=1), in their one host copy; the default decode(check_values=False) cannot see it.
    None of this is checked under torch.compile or CUDA-graph capture. In a captured decode step, compute
    the schedule inside the graph (it is then recomputed at every replay) or recompute it before every
    replay.
    """
    V.check_decode_schedule_args(cache_seqlens, seqlen_q, num_heads)
    version, ptr = V.seqlens_identity(cache_seqlens)
    tensor = torch.ops.mla_autograd.mla_decode_schedule(cache_seqlens, int(seqlen_q), int(num_heads))
    copy = None
    if ptr is not None and version is None and not V.tracing_or_capturing(cache_seqlens):
        copy = cache_seqlens.clone()  # inference tensor: no version counter to detect in-place edits
    return DecodeSchedule(tensor, cache_seqlens.shape[0], int(seqlen_q), int(num_heads), cache_seqlens.device,
                          version, ptr, copy)


def decode(q_nope: Tensor, q_pe: Tensor, ckv_cache: Tensor, kpe_cache: Tensor, block_table: Tensor,
           cache_seqlens: Tensor, *, softmax_scale: float, causal: bool = True, return_lse: bool = False,
           check_values: bool = V.DECODE_CHECK_VALUES, schedule: DecodeSchedule | None = None):
    """Weight-absorbed MLA decode over a paged latent cache. Inference only.

    Every query head attends to the shared latent K = [ckv, kpe] (512 + 64) and V = ckv (512).

    Args:
        q_nope: (B, Sq, H, Dc) absorbed queries (W_UK folded in), Dc = kv_lora_rank (512 for the kernel).
        q_pe: (B, Sq, H, Dr) roped query part, Dr = 64 for the kernel.
        ckv_cache: (num_pages, page_size, Dc) normalised latents; kpe_cache: (num_pages, page_size, Dr)
            roped keys. May be views of one (num_pages, page_size, Dc + Dr) buffer.
        block_table: int32 (B, max_pages): page indices of each request, in order.
        cache_seqlens: int32 (B,): tokens in the cache per request, the Sq new ones included
            (0 marks an idle slot: its output is 0 and its lse -inf).
        softmax_scale: required (e.g. 1/sqrt(qk_nope_head_dim + qk_rope_head_dim), times YaRN mscale^2).
        causal: new token i sees cache positions <= cache_seqlens - Sq + i; else all positions.
        return_lse: also return lse (B, H, Sq) float32.
        check_values: check that every cache_seqlens[b] is 0 or in [Sq, max_pages * page_size] and that
            the block_table entries in use (column p of row b while p * page_size < cache_seqlens[b]) are
            page indices in [0, num_pages), and raise a ValueError naming the first bad entry before anything
            runs. Computed on the device into one int64, of which only that one value is copied to the host:
            8 bytes, but on a GPU a synchronisation per call (the host waits for the work queued before it),
            which costs a decode step far more than the kernel itself: off by default.
            MLA_AUTOGRAD_CHECK_VALUES overrides this argument: ``0`` never checks, ``1`` checks every call.
            The checks are always skipped under torch.compile and CUDA-graph capture.
        schedule: a DecodeSchedule from ``decode_schedule(cache_seqlens, seqlen_q=Sq, num_heads=H)``
            for this very cache_seqlens tensor, unchanged since (recompute it every decode step). Skips
            the kernel's own scheduling launch; results are bit-identical to ``schedule=None``. The
            reference path ignores it. A schedule for another shape or device, for another lengths tensor,
            or for a cache_seqlens modified in place since raises (for an inference-mode cache_seqlens the
            last is seen only while values are checked; see decode_schedule).

    Returns:
        out (B, Sq, H, Dc) in q_nope's dtype [, lse], on q_nope's device.

    Values that break the rules of check_values never make a kernel read or write outside these tensors.
    Every path (kernel and reference) computes a request with bad values as follows: its length is
    cache_seqlens[b] clamped into [0, max_pages * page_size] (a negative one is an idle slot); a block_table
    entry in use outside [0, num_pages) reads as a page of zeros (those positions get score 0 and value 0);
    with causal and 0 < cache_seqlens[b] < Sq, a new token that sees no position gets out 0 and lse -inf.
    Nothing is written outside out and lse.
    """
    if not check_values:
        fast = _ops.decode_fast(q_nope, q_pe, ckv_cache, kpe_cache, block_table, cache_seqlens, softmax_scale,
                                causal, schedule)
        if fast is not None:
            return fast if return_lse else fast[0]
    V.check_decode(q_nope, q_pe, ckv_cache, kpe_cache, block_table, cache_seqlens, softmax_scale,
                   check_values=check_values, schedule=schedule)
    V.check_inference_only(q_nope, q_pe, ckv_cache, kpe_cache)
    op = _ops._mla_decode if _ops.eager_direct(q_nope, q_pe, ckv_cache, kpe_cache) else torch.ops.mla_autograd.mla_decode
    out, lse = op(q_nope, q_pe, ckv_cache, kpe_cache, block_table, cache_seqlens, float(softmax_scale), bool(causal),
                  None if schedule is None else schedule.tensor)
    return (out, lse) if return_lse else out


class Explanation:
    """Which backend serves the forward and the backward of a call, and why."""

    def __init__(self, *decisions):
        self.decisions = decisions

    def __getattr__(self, name):
        ops = {"forward": ("attn_fwd", "mla_fwd"), "backward": ("attn_bwd", "mla_bwd")}.get(name, (name,))
        for d in self.decisions:
            if d.op in ops:
                return d
        raise AttributeError(name)

    def __str__(self):
        return "\n".join(str(d) for d in self.decisions)

    __repr__ = __str__


def explain(q: Tensor, k: Tensor, v: Tensor, *, causal: bool = False, causal_align: str = "bottom_right",
            varlen: bool = False, cu_seqlens_q: Tensor | None = None, cu_seqlens_k: Tensor | None = None,
            max_seqlen_q: int | None = None, deterministic: bool = False) -> Explanation:
    """Say which backend `attention` / `attention_varlen` would use for these tensors, and why.

    Takes the arguments of the call it explains (cu_seqlens_* and max_seqlen_q for a varlen call; or
    just ``varlen=True``, and then the answer assumes the two cu_seqlens are different tensors).
    ``explain(q, k, v).forward.backend`` is e.g. "sm90"; ``print(explain(...))`` lists every row of the
    dispatch table passed over with its reason. Reads only metadata. q, k, v are checked as the call
    checks them (dense (B, S, H, D), or packed (T, H, D) for a varlen call): a call that would raise
    raises the same error here.
    """
    V.check_explain(q, k, v, bool(varlen) or cu_seqlens_q is not None)
    bottom_right = V.causal_bottom_right(causal_align)
    kw = dict(causal=bool(causal), bottom_right=bottom_right, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
              max_seqlen_q=max_seqlen_q, varlen=bool(varlen) or cu_seqlens_q is not None)
    return Explanation(explain_call(attention_call("attn_fwd", q, k, v, **kw)),
                       explain_call(attention_call("attn_bwd", q, k, v, deterministic=bool(deterministic), **kw)))


def explain_decode(q_nope: Tensor, q_pe: Tensor, ckv_cache: Tensor) -> Explanation:
    """Say which backend `decode` would use for these tensors, and why. Raises the error `decode` would
    raise for these three tensors (their shapes, dtypes, devices, strides)."""
    V.check_decode_explain(q_nope, q_pe, ckv_cache)
    return Explanation(explain_call(decode_call(q_nope, q_pe, ckv_cache)))


class MLAExplanation(Explanation):
    """explain_mla's answer: ``path`` (how the parts reach a backend: "native" or "concat") and ``path_reason``,
    ``native`` (the decision of the dispatch table's mla_fwd rows: the kernel that reads the parts in place, or
    why none does), then the forward and backward decisions (``forward``: mla_fwd's on the native path, attn_fwd's
    for the concatenated head dims otherwise; ``backward``: mla_bwd's where a kernel row of it serves the call,
    attn_bwd's for the concatenated head dims otherwise)."""

    def __init__(self, path: str, path_reason: str, native, *decisions):
        super().__init__(*decisions)
        self.path, self.path_reason, self.native = path, path_reason, native

    def __str__(self):
        lines = [f"mla inputs: {self.path} ({self.path_reason})"]
        if self.path == MLA_PATH_CONCAT:
            lines += [f"  not {b} in place: {why}" for b, why in self.native.passed_over]
        return "\n".join(lines) + "\n" + super().__str__()

    __repr__ = __str__


def explain_mla(q_nope: Tensor, q_pe: Tensor, k_nope: Tensor, k_pe: Tensor, v: Tensor, *, causal: bool = False,
                causal_align: str = "bottom_right", varlen: bool = False, cu_seqlens_q: Tensor | None = None,
                cu_seqlens_k: Tensor | None = None, max_seqlen_q: int | None = None,
                deterministic: bool = False) -> MLAExplanation:
    """Say how `mla_attention` / `mla_attention_varlen` would run for these tensors: the path of the parts
    (``.path``: "native" where a kernel reads them in place, else "concat"), the backend of the forward
    (``.forward.backend``: the in-place kernel's, or attn_fwd's for the concatenated head dims (Dn + Dr, Dv)) and
    of the backward (``.backward``: the decision of the mla_bwd rows where one of their kernels reads the parts in
    place, else attn_bwd's for (Dn + Dr, Dv)). Keywords as in `explain`. Reads only
    metadata; the five tensors are checked as the call checks them, so a call that would raise raises the
    same error here."""
    V.check_explain_mla(q_nope, q_pe, k_nope, k_pe, v, bool(varlen) or cu_seqlens_q is not None)
    dims = (q_nope.shape[-1] + q_pe.shape[-1], v.shape[-1])
    kw = dict(causal=bool(causal), bottom_right=V.causal_bottom_right(causal_align), cu_seqlens_q=cu_seqlens_q,
              cu_seqlens_k=cu_seqlens_k, max_seqlen_q=max_seqlen_q, varlen=bool(varlen) or cu_seqlens_q is not None)
    native = explain_call(_ops.mla_call(q_nope, q_pe, k_nope, v))
    bwd = explain_call(_ops.mla_call(q_nope, q_pe, k_nope, v, op="mla_bwd"))
    if bwd.family is None:
        bwd = explain_call(dataclasses.replace(
            attention_call("attn_bwd", q_nope, k_nope, v, deterministic=bool(deterministic), **kw), dims=dims))
    if native.family is not None:
        return MLAExplanation(MLA_PATH_NATIVE, MLA_PATH_REASONS[MLA_PATH_NATIVE], native, native, bwd)
    fwd = explain_call(dataclasses.replace(attention_call("attn_fwd", q_nope, k_nope, v, **kw), dims=dims))
    return MLAExplanation(MLA_PATH_CONCAT, MLA_PATH_REASONS[MLA_PATH_CONCAT], native, fwd, bwd)
