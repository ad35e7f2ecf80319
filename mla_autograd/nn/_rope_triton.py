"""The Triton kernel behind :func:`mla_autograd.nn.rope.apply_rotary` on CUDA tensors.

One launch reads x through its strides, rotates every pair in float32 and writes the result, rounded once
to the output's dtype. The forward reads x's pair layout (interleaved or rotate_half) and writes the
half-split layout; the backward is the transposed rotation, the same kernel with sin negated, reading the
half-split gradient and writing x's layout. Each product, difference and sum is rounded to float32 on its
own, as the separate elementwise ops of the torch path round them: the launch turns off the contraction of
``a * b + c`` into a fused multiply-add (``enable_fp_fusion=False``), which would round once where the torch
path rounds twice. Imported only when that path is taken (it imports triton).
"""
from __future__ import annotations

import contextlib

import torch
import triton
import triton.language as tl

__all__ = ["rotate"]

#: Elements of x one program reads (rows of x times columns per row, rounded down to a power of two rows):
#: 8192 is 64 elements, eight 16-byte vectors of bfloat16, a thread at 4 warps.
_ELEMENTS_PER_PROGRAM = 8192
#: Compile options of every launch. enable_fp_fusion=False keeps x1 * c - x2 * s as two multiplies and a
#: subtraction, each rounded (no fused multiply-add): the torch path's rounding.
LAUNCH_OPTIONS = dict(num_warps=4, enable_fp_fusion=False)


@triton.jit
def _load_pairs(row, stride, row_ok, HALF: tl.constexpr, BLOCK_P: tl.constexpr, INTERLEAVED: tl.constexpr):
    """Both members of the pairs of rows `row` ((R, 1) pointers; row_ok (R, 1) masks rows out) as float32
    (R, BLOCK_P) blocks, pair p in column p. Interleaved pairs (2p, 2p + 1) are read as the row's 2 * BLOCK_P
    elements in order, reshaped to (R, BLOCK_P, 2) and split, so that each thread reads 16-byte vectors (loads
    of the two members at stride 2 would read every element on its own); the halves (p, p + HALF) of the other
    layout are contiguous already."""
    if INTERLEAVED:
        e = tl.arange(0, 2 * BLOCK_P)
        both = tl.load(row + e[None, :] * stride, mask=row_ok & (e[None, :] < 2 * HALF))
        first, second = tl.split(tl.reshape(both.to(tl.float32), (both.shape[0], BLOCK_P, 2)))
    else:
        p = tl.arange(0, BLOCK_P)
        mask = row_ok & (p[None, :] < HALF)
        first = tl.load(row + p[None, :] * stride, mask=mask).to(tl.float32)
        second = tl.load(row + (p[None, :] + HALF) * stride, mask=mask).to(tl.float32)
    return first, second


@triton.jit
def _store_pairs(row, stride, row_ok, first, second, HALF: tl.constexpr, BLOCK_P: tl.constexpr,
                 INTERLEAVED: tl.constexpr):
    """Write pairs (first, second) of rows `row` in _load_pairs' layouts, rounded to the output's dtype."""
    ty = row.dtype.element_ty
    if INTERLEAVED:
        e = tl.arange(0, 2 * BLOCK_P)
        both = tl.reshape(tl.join(first.to(ty), second.to(ty)), (first.shape[0], 2 * BLOCK_P))
        tl.store(row + e[None, :] * stride, both, mask=row_ok & (e[None, :] < 2 * HALF))
    else:
        p = tl.arange(0, BLOCK_P)
        mask = row_ok & (p[None, :] < HALF)
        tl.store(row + p[None, :] * stride, first.to(ty), mask=mask)
        tl.store(row + (p[None, :] + HALF) * stride, second.to(ty), mask=mask)


@triton.jit
def _rotary_kernel(x_ptr, cos_ptr, sin_ptr, out_ptr, n1, n2, row_blocks,
                   sx0, sx1, sx2, sx3, sc0, sc1, sc2, sc3, ss0, ss1, ss2, ss3, so0, so1, so2, so3,
                   HALF: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_P: tl.constexpr,
                   X_INTERLEAVED: tl.constexpr, OUT_INTERLEAVED: tl.constexpr, NEGATE_SIN: tl.constexpr,
                   KEEP: tl.constexpr, BLOCK_K: tl.constexpr, IN_PLACE: tl.constexpr):
    # Program pid handles BLOCK_R consecutive indices of dim 2 at one (dim 0, dim 1) index. int64 offsets:
    # a (B, S, H, D) view of a wider projection spans more than 2**31 elements at large B * S.
    pid = tl.program_id(0).to(tl.int64)
    row = pid // row_blocks
    i0 = row // n1
    i1 = row % n1
    i2 = (pid % row_blocks) * BLOCK_R + tl.arange(0, BLOCK_R).to(tl.int64)
    p = tl.arange(0, BLOCK_P)  # pair index: pair p is rotated by angle p
    mask = (i2[:, None] < n2) & (p[None, :] < HALF)

    row_ok = i2[:, None] < n2
    x_row = x_ptr + i0 * sx0 + i1 * sx1 + i2[:, None] * sx2
    out_row = out_ptr + i0 * so0 + i1 * so1 + i2[:, None] * so2
    if KEEP > 0:  # the first KEEP columns pass through unchanged; the pairs follow them
        k = tl.arange(0, BLOCK_K)
        keep_mask = row_ok & (k[None, :] < KEEP)
        tl.store(out_row + k[None, :] * so3, tl.load(x_row + k[None, :] * sx3, mask=keep_mask), mask=keep_mask)
    x1, x2 = _load_pairs(x_row + KEEP * sx3, sx3, row_ok, HALF, BLOCK_P, X_INTERLEAVED)
    c = tl.load(cos_ptr + i0 * sc0 + i1 * sc1 + i2[:, None] * sc2 + p[None, :] * sc3, mask=mask)
    s = tl.load(sin_ptr + i0 * ss0 + i1 * ss1 + i2[:, None] * ss2 + p[None, :] * ss3, mask=mask)
    if NEGATE_SIN:
        s = -s
    if IN_PLACE:
        # out is x: the thread that stores an element need not be the one that loaded it (the pair layouts
        # differ), so every thread's loads are ordered before any store by a barrier of the whole program
        tl.debug_barrier()
    # the torch path's formula, term for term: x1 * c - x2 * s, x2 * c + x1 * s
    y1 = x1 * c - x2 * s
    y2 = x2 * c + x1 * s
    _store_pairs(out_row + KEEP * so3, so3, row_ok, y1, y2, HALF, BLOCK_P, OUT_INTERLEAVED)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, out: torch.Tensor, *, x_interleaved: bool,
           out_interleaved: bool, negate_sin: bool, keep: int = 0) -> torch.Tensor:
    """Write the rotation of x into out (one kernel launch) and return out.

    Args:
        x: (A, B, C, keep + D) bfloat16/float16/float32, any strides (a strided view of a projection's output
            is read in place). Its first `keep` columns are copied to out's unchanged; D even, and the D/2
            pairs of the rest are (x[..., keep + 2p], x[..., keep + 2p + 1]) when x_interleaved, else
            (x[..., keep + p], x[..., keep + p + D/2]).
        cos, sin: (A, B, C, D/2) float32, any strides (stride 0 along broadcast dims, e.g. the heads or the
            batch, costs no copy): pair p of row (a, b, c) turns by the angle whose cos/sin these hold.
        out: (A, B, C, keep + D), any float dtype and strides, either x itself (the same view: the rotation in
            place, keep = 0) or not overlapping x; pair p goes to
            (out[..., keep + 2p], out[..., keep + 2p + 1]) when out_interleaved, else (out[..., keep + p],
            out[..., keep + p + D/2]).
        negate_sin: rotate by the opposite angles (the transposed rotation, i.e. the backward).

    Each output is ``x1 * c - x2 * s`` / ``x2 * c + x1 * s`` in float32, every operation rounded on its own,
    then rounded once to out's dtype (round to nearest even). CUDA tensors, or CPU tensors under Triton's
    interpreter (``TRITON_INTERPRET=1`` set before this module is imported).
    """
    A, B, C, D = x.shape
    in_place = out.data_ptr() == x.data_ptr()
    if in_place and (keep or out.stride() != x.stride() or out.dtype != x.dtype):
        raise ValueError("rotate: an out that aliases x must be x itself (same strides and dtype) with keep = 0")
    half = (D - keep) // 2
    if out.numel() == 0:
        return out
    block_p = triton.next_power_of_2(half)
    width = 2 * block_p + (triton.next_power_of_2(keep) if keep else 0)
    rows = max(1, _ELEMENTS_PER_PROGRAM // width)
    block_r = min(triton.next_power_of_2(C), 1 << (rows.bit_length() - 1))  # a power of two, at most `rows`
    row_blocks = triton.cdiv(C, block_r)
    # the launch goes to the current CUDA device: make it x's
    guard = torch.cuda.device(x.device) if x.device.type == "cuda" else contextlib.nullcontext()
    with guard:
        _rotary_kernel[(A * B * row_blocks,)](
            x, cos, sin, out, B, C, row_blocks, *x.stride(), *cos.stride(), *sin.stride(), *out.stride(),
            HALF=half, BLOCK_R=block_r, BLOCK_P=block_p, X_INTERLEAVED=x_interleaved,
            OUT_INTERLEAVED=out_interleaved, NEGATE_SIN=negate_sin, KEEP=keep,
            BLOCK_K=triton.next_power_of_2(keep) if keep else 1, IN_PLACE=in_place, **LAUNCH_OPTIONS)
    return out
