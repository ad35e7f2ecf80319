"""The Triton kernels behind :class:`mla_autograd.nn.RMSNorm` on CUDA tensors: one launch per direction.

The forward reads a block of rows of x, computes each row's reciprocal root mean square in float32 and writes
``y = weight * round(x * rstd)`` with the roundings of the torch ops it replaces (transformers'
DeepseekV3RMSNorm): ``h = float32(x) * rstd`` rounded to x's dtype, then ``float32(weight) * float32(h)``
rounded once more, as PyTorch's multiply of two bfloat16/float16 tensors computes in float32 and rounds
once. It stores rstd (float32, one per row) for the backward, which recomputes ``float32(x) * rstd`` from x
instead of keeping h or y. The backward runs a grid of at most two programs per SM; each walks row blocks
with a stride of the grid, writes dx for its rows and accumulates its rows' share of d weight in float32
registers, stored as one row of a (programs, N) buffer that the caller sums. Every product, sum and
difference is rounded to float32 on its own, as the separate torch ops round them: the launches turn off the
contraction of ``a * b + c`` into a fused multiply-add (``enable_fp_fusion=False``). Imported only when that
path is taken (it imports triton).
"""
from __future__ import annotations

import contextlib
import functools

import torch
import triton
import triton.language as tl

__all__ = ["MAX_N", "rms_norm_forward", "rms_norm_backward"]

#: Elements of x one program holds per row block (rows times the row width rounded up to a power of two): a
#: row of up to 4096 columns shares a program with others, a wider one has a program of its own.
_ELEMENTS_PER_BLOCK = 4096
#: The widest row the kernels take: a whole row is one block in registers (16 float32 elements per tensor a
#: thread at 16 warps, where the backward holds about six such tensors).
MAX_N = 8192
#: Backward programs per SM: as many 8-warp programs as an SM's registers hold at once (about 100 registers a
#: thread), while the programs' d weight rows, written once and summed, stay a small part of the traffic.
_PROGRAMS_PER_SM = 2
#: Backward programs on a non-CUDA device (CPU tensors under Triton's interpreter): a few, so that programs
#: walk several row blocks and row counts split unevenly between them.
_OTHER_DEVICE_PROGRAMS = 3
#: Compile options of every launch (num_warps is chosen per launch from the block's size).
#: enable_fp_fusion=False keeps each product rounded before it is added (no fused multiply-add): the torch
#: path's rounding. enable_reflect_ftz=False: libdevice's rsqrtf keeps subnormals (rsqrt.approx.f32, not its
#: .ftz form), as PyTorch's CUDA rsqrt, built without flushing them, computes it.
LAUNCH_OPTIONS = dict(enable_fp_fusion=False, enable_reflect_ftz=False)


@triton.jit
def _rms_norm_fwd_kernel(x_ptr, w_ptr, y_ptr, rstd_ptr, M, sxm, sw, eps, inv_n, N: tl.constexpr,
                         BLOCK_ROWS: tl.constexpr, BLOCK_N: tl.constexpr, STORE_RSTD: tl.constexpr):
    # Program pid normalizes rows pid * BLOCK_ROWS ... (BLOCK_ROWS of them, the last block masked), whole.
    # N is a compile-time constant (a model has a few widths): the column mask's runs are then known, so rows
    # are read and written in 16-byte vectors wherever N allows, not only where a launch finds N divisible by 16.
    # int64 offsets: rows * row stride passes 2**31 elements at B * S * N beyond 2**31 (or a strided view).
    pid = tl.program_id(0).to(tl.int64)
    rows = pid * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS).to(tl.int64)
    cols = tl.arange(0, BLOCK_N)
    row_ok = rows < M
    mask = row_ok[:, None] & (cols[None, :] < N)
    ty = y_ptr.dtype.element_ty
    x = tl.load(x_ptr + rows[:, None] * sxm + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    w = tl.load(w_ptr + cols * sw, mask=cols < N, other=0.0).to(tl.float32)
    # mean(x**2) as the torch path has it on CUDA: the float32 sum of the rounded squares, times 1/N in float32
    # (inv_n); masked columns add zeros
    var = tl.sum(x * x, axis=1) * inv_n
    rstd = tl.rsqrt(var + eps)
    h = (x * rstd[:, None]).to(ty).to(tl.float32)  # h.to(dtype): the torch path rounds the normalized row
    tl.store(y_ptr + rows[:, None] * N + cols[None, :], (w[None, :] * h).to(ty), mask=mask)
    if STORE_RSTD:
        tl.store(rstd_ptr + rows, rstd, mask=row_ok)


@triton.jit
def _rms_norm_bwd_kernel(dy_ptr, x_ptr, w_ptr, rstd_ptr, dx_ptr, dw_ptr, M, sdym, sdyn, sxm, sw, inv_n,
                         num_blocks, N: tl.constexpr, BLOCK_ROWS: tl.constexpr, BLOCK_N: tl.constexpr,
                         COMPUTE_DX: tl.constexpr, COMPUTE_DW: tl.constexpr):
    # Program pid takes row blocks pid, pid + G, pid + 2G, ... (G programs): dx of those rows, and their sum of
    # dy * h per column, which stays in registers (one accumulator slot per row of the block) until the end.
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_N)
    col_ok = cols < N
    ty = x_ptr.dtype.element_ty
    w = tl.load(w_ptr + cols * sw, mask=col_ok, other=0.0).to(tl.float32)
    dw_acc = tl.zeros((BLOCK_ROWS, BLOCK_N), dtype=tl.float32)
    for blk in range(pid, num_blocks, tl.num_programs(0)):
        rows = (blk * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)).to(tl.int64)
        row_ok = rows < M
        mask = row_ok[:, None] & col_ok[None, :]
        x = tl.load(x_ptr + rows[:, None] * sxm + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(dy_ptr + rows[:, None] * sdym + cols[None, :] * sdyn, mask=mask, other=0.0).to(tl.float32)
        rstd = tl.load(rstd_ptr + rows, mask=row_ok, other=0.0)
        xhat = x * rstd[:, None]  # the forward's float32(x) * rstd, recomputed
        if COMPUTE_DW:
            # y = w * h: d w = sum over rows of dy * h, h the forward's rounded normalized row; masked rows and
            # columns have dy = 0
            dw_acc += dy * xhat.to(ty).to(tl.float32)
        if COMPUTE_DX:
            # d h = dy * w in x's dtype (the torch path's multiply backward rounds it there); then the float32
            # formula of the normalization's gradient, rounded once
            g = (dy * w[None, :]).to(ty).to(tl.float32)
            c = tl.sum(g * xhat, axis=1) * inv_n
            dx = rstd[:, None] * (g - xhat * c[:, None])
            tl.store(dx_ptr + rows[:, None] * N + cols[None, :], dx.to(ty), mask=mask)
    if COMPUTE_DW:
        tl.store(dw_ptr + pid * N + cols, tl.sum(dw_acc, axis=0), mask=col_ok)


@functools.lru_cache(maxsize=None)
def _inv_n(n: int) -> float:
    """1/n rounded to float32 (the factor torch's CUDA mean multiplies the float32 sum by), as a Python float
    that converts to that float32 exactly."""
    return torch.full((), n, dtype=torch.float32).reciprocal().item()


@functools.lru_cache(maxsize=None)
def _max_programs(device: torch.device) -> int:
    """How many programs the backward's grid has at most on `device`."""
    if device.type == "cuda":
        return _PROGRAMS_PER_SM * torch.cuda.get_device_properties(device).multi_processor_count
    return _OTHER_DEVICE_PROGRAMS


def _blocks(m: int, n: int) -> tuple[int, int, int]:
    """(BLOCK_ROWS, BLOCK_N, num_warps) for rows of n columns, m rows."""
    block_n = triton.next_power_of_2(n)
    rows = max(1, _ELEMENTS_PER_BLOCK // block_n)
    block_rows = min(rows, triton.next_power_of_2(m))
    # 16 elements of each tensor a thread (512 elements a warp), between 4 and 16 warps
    num_warps = min(16, max(4, block_rows * block_n // 512))
    return block_rows, block_n, num_warps


def _guard(t: torch.Tensor):
    """The launch goes to the current CUDA device: make it t's."""
    return torch.cuda.device(t.device) if t.device.type == "cuda" else contextlib.nullcontext()


def rms_norm_forward(x: torch.Tensor, weight: torch.Tensor, eps: float, *,
                     need_rstd: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """RMSNorm of each row of x (one kernel launch).

    Args:
        x: (M, N) bfloat16/float16/float32, M >= 1, 1 <= N <= MAX_N, unit column stride, any row stride (a
            view of a wider projection's output is read in place).
        weight: (N,) x's dtype and device, any stride.
        eps: added to the mean square before the reciprocal square root (rounded to float32).
        need_rstd: also return rstd (what rms_norm_backward needs).

    Returns:
        (y, rstd): y (M, N) contiguous in x's dtype, ``y = round(float32(weight) * float32(round(float32(x) *
        rstd)))`` (each round to x's dtype, to nearest even); rstd (M,) float32, ``rsqrt(sum(float32(x)**2) *
        float32(1/N) + eps)`` per row, or None without need_rstd.

    CUDA tensors, or CPU tensors under Triton's interpreter (``TRITON_INTERPRET=1`` set before this module is
    imported).
    """
    M, N = x.shape
    y = torch.empty((M, N), dtype=x.dtype, device=x.device)
    rstd = torch.empty((M,), dtype=torch.float32, device=x.device) if need_rstd else None
    block_rows, block_n, num_warps = _blocks(M, N)
    with _guard(x):
        _rms_norm_fwd_kernel[(triton.cdiv(M, block_rows),)](
            x, weight, y, rstd if need_rstd else y, M, x.stride(0), weight.stride(0), eps, _inv_n(N), N=N,
            BLOCK_ROWS=block_rows, BLOCK_N=block_n, STORE_RSTD=need_rstd, num_warps=num_warps, **LAUNCH_OPTIONS)
    return y, rstd


def rms_norm_backward(dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, rstd: torch.Tensor, *,
                      need_dx: bool, need_dw: bool) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Gradients of rms_norm_forward's y with respect to x and weight (one kernel launch, and a sum over the
    programs' d weight rows in torch).

    Args:
        dy: (M, N) x's dtype, any strides (stride 0 of an expanded gradient too).
        x: (M, N) as rms_norm_forward took it (unit column stride, any row stride).
        weight: (N,) x's dtype and device, any stride.
        rstd: (M,) float32 contiguous, rms_norm_forward's.
        need_dx, need_dw: which gradients to compute (at least one).

    Returns:
        (dx, dw): dx (M, N) contiguous in x's dtype or None: with ``g = round(float32(dy) * float32(weight))``
        (the torch path's multiply backward, in x's dtype) and ``xhat = float32(x) * rstd``, ``dx = rstd * (g -
        xhat * (sum(g * xhat) * float32(1/N)))`` in float32, rounded once to x's dtype. dw (N,) in weight's
        dtype or None: the float32 sum over rows of ``float32(dy) * float32(round(xhat))``, rounded once;
        deterministic (each program sums a fixed set of rows in a fixed order, then torch sums the programs'
        rows).
    """
    M, N = x.shape
    block_rows, block_n, num_warps = _blocks(M, N)
    num_blocks = triton.cdiv(M, block_rows)
    programs = min(num_blocks, _max_programs(x.device))
    dx = torch.empty((M, N), dtype=x.dtype, device=x.device) if need_dx else None
    partial = torch.empty((programs, N), dtype=torch.float32, device=x.device) if need_dw else None
    with _guard(x):
        _rms_norm_bwd_kernel[(programs,)](
            dy, x, weight, rstd, dx if need_dx else dy, partial if need_dw else rstd, M, dy.stride(0),
            dy.stride(1), x.stride(0), weight.stride(0), _inv_n(N), num_blocks, N=N, BLOCK_ROWS=block_rows,
            BLOCK_N=block_n, COMPUTE_DX=need_dx, COMPUTE_DW=need_dw, num_warps=num_warps, **LAUNCH_OPTIONS)
    dw = partial.sum(0).to(weight.dtype) if need_dw else None
    return dx, dw
