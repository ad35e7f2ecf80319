"""Rotary position embedding for MLA's decoupled rope dims, with DeepSeek's YaRN scaling.

Numerics follow Hugging Face transformers' DeepseekV3 (and DeepSeek's own reference code):

- inverse frequencies and the angle table are computed in float32, ``cos``/``sin`` are multiplied
  by the YaRN attention factor (``mscale / mscale_all_dim``) in float32;
- the rotation is applied in float32 (float64 for float64 inputs) and cast back to the input dtype,
  rounded once; on CUDA tensors (bfloat16/float16/float32) by one Triton kernel per direction
  (``mla_autograd::rotary``, see `apply_rotary`), bit-identical to the torch ops that run everywhere else;
- ``interleaved=True`` (DeepSeek's checkpoints, ``rope_interleave=True`` in transformers) rotates the
  pairs ``(x0, x1), (x2, x3), ...``; ``interleaved=False`` rotates ``(x_i, x_{i+d/2})`` (rotate_half).
  Either way the output is laid out half-split: ``[x_even' ..., x_odd' ...]``, exactly like
  transformers, so q.k products (and cached roped keys) agree bit-for-bit in layout.
- the softmax scale is ``qk_head_dim ** -0.5``, times ``yarn_get_mscale(factor, mscale_all_dim) ** 2``
  when YaRN scaling with ``mscale_all_dim`` is configured.
"""
from __future__ import annotations

import importlib.util
import math
from typing import Any, Mapping

import torch
from torch import nn

from .._ops import eager_direct

__all__ = [
    "yarn_get_mscale",
    "rope_parameters",
    "mla_softmax_scale",
    "RotaryEmbedding",
    "apply_rotary",
]


def yarn_get_mscale(scale: float = 1.0, mscale: float = 1.0) -> float:
    """YaRN's attention temperature correction: 0.1 * mscale * ln(scale) + 1 (1 for scale <= 1)."""
    if scale <= 1:
        return 1.0
    return 0.1 * mscale * math.log(scale) + 1.0


def _rope_type(rope_scaling: Mapping[str, Any] | None) -> str:
    if not rope_scaling:
        return "default"
    return str(rope_scaling.get("rope_type", rope_scaling.get("type", "default")))


def rope_parameters(dim: int, rope_theta: float, max_position_embeddings: int,
                    rope_scaling: Mapping[str, Any] | None = None) -> tuple[torch.Tensor, float]:
    """Inverse frequencies (float32, dim // 2) and the cos/sin attention factor for the rope dims.

    rope_scaling: None / {"rope_type": "default"}, or YaRN as in DeepSeek-V2/V3 configs:
    {"rope_type" (or "type"): "yarn", "factor", "original_max_position_embeddings", "beta_fast" (32),
    "beta_slow" (1), "mscale", "mscale_all_dim", "attention_factor" (optional), "truncate" (True)}.
    """
    if dim % 2:
        raise ValueError(f"qk_rope_head_dim must be even, got {dim}")
    kind = _rope_type(rope_scaling)
    # on the CPU whatever the default device (RotaryEmbedding copies them to each device on first use)
    pos_freqs = rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float32, device="cpu") / dim)
    if kind == "default":
        return 1.0 / pos_freqs, 1.0
    if kind != "yarn":
        raise ValueError(f"rope_scaling type {kind!r} is not supported (use None/'default' or 'yarn')")
    rs = dict(rope_scaling)
    orig = rs.get("original_max_position_embeddings") or max_position_embeddings
    factor = rs.get("factor")
    if factor is None:
        factor = max_position_embeddings / orig
    factor = float(factor)
    attention_factor = rs.get("attention_factor")
    mscale, mscale_all_dim = rs.get("mscale"), rs.get("mscale_all_dim")
    if attention_factor is None:
        if mscale and mscale_all_dim:
            attention_factor = float(yarn_get_mscale(factor, mscale) / yarn_get_mscale(factor, mscale_all_dim))
        else:
            attention_factor = yarn_get_mscale(factor)
    beta_fast = rs.get("beta_fast") or 32
    beta_slow = rs.get("beta_slow") or 1
    truncate = rs.get("truncate", True)

    def correction_dim(num_rotations):
        return (dim * math.log(orig / (num_rotations * 2 * math.pi))) / (2 * math.log(rope_theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # avoid a zero-width ramp
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32, device="cpu") - low) / (high - low), 0, 1)
    extrapolation = 1.0 - ramp  # 1: keep the original frequency (high-frequency dims)
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    return inv_freq, float(attention_factor)


def mla_softmax_scale(qk_head_dim: int, rope_scaling: Mapping[str, Any] | None = None) -> float:
    """qk_head_dim**-0.5, times mscale(factor, mscale_all_dim)**2 under YaRN (DeepSeek-V2/V3)."""
    scale = qk_head_dim ** -0.5
    if _rope_type(rope_scaling) != "default":
        mscale_all_dim = rope_scaling.get("mscale_all_dim", 0)
        if mscale_all_dim:
            m = yarn_get_mscale(float(rope_scaling["factor"]), mscale_all_dim)
            scale = scale * m * m
    return scale


def _rotate_torch(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, x_interleaved: bool,
                  out_interleaved: bool, negate_sin: bool, keep: int = 0) -> torch.Tensor:
    """The rotation as torch ops (differentiable through them): see `apply_rotary`, and `_rope_triton.rotate`
    for x_interleaved / out_interleaved / negate_sin / keep. Computed in float32 (float64 for float64 x)."""
    kept = None
    if keep:
        kept, x = x.split([keep, x.shape[-1] - keep], dim=-1)
    cd = torch.float64 if x.dtype == torch.float64 else torch.float32
    xc = x.to(cd)
    # unbind / chunk rather than two slices: their backward is one stack / concatenation, where each
    # slice's backward would zero-fill a tensor of x's whole shape and the two would be added
    if x_interleaved:
        x1, x2 = xc.unflatten(-1, (-1, 2)).unbind(-1)
    else:
        x1, x2 = xc.chunk(2, dim=-1)
    c, s = cos.to(cd), sin.to(cd)
    if negate_sin:
        s = -s
    y1, y2 = x1 * c - x2 * s, x2 * c + x1 * s
    y = torch.stack([y1, y2], dim=-1).flatten(-2) if out_interleaved else torch.cat([y1, y2], dim=-1)
    return y.to(x.dtype) if kept is None else torch.cat([kept, y.to(x.dtype)], dim=-1)


_KERNEL_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
# Device types whose tensors the Triton kernel takes. The tests add "cpu" under Triton's interpreter
# (TRITON_INTERPRET=1), which runs the kernel on CPU tensors.
_KERNEL_DEVICE_TYPES = ("cuda",)
# Looked up, not imported: `import mla_autograd.nn` does not import triton (the kernel module does, on first use)
_HAS_TRITON = importlib.util.find_spec("triton") is not None


def _kernel_takes(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, keep: int = 0) -> bool:
    """The Triton kernel serves the call: x a non-empty CUDA tensor of rank 1 to 4 in bfloat16/float16/float32
    whose last dim less `keep` is even, cos/sin float32 of one shape on x's device that broadcast against x without its
    last dim (to x's own leading shape) and have D/2 as their last dim. Metadata only."""
    if not (_HAS_TRITON and x.device.type in _KERNEL_DEVICE_TYPES and x.dtype in _KERNEL_DTYPES):
        return False
    if not 1 <= x.dim() <= 4:
        return False
    d = x.shape[-1] - keep
    if x.numel() == 0 or d <= 0 or d % 2:
        return False
    if cos.dtype != torch.float32 or sin.dtype != torch.float32 or cos.device != x.device or sin.device != x.device:
        return False
    if cos.shape != sin.shape or cos.dim() < 1 or cos.shape[-1] != d // 2 or cos.dim() > x.dim():
        return False
    lead, clead = x.shape[:-1], cos.shape[:-1]
    # broadcastable to x's leading shape: every dim of cos (aligned on the right) is 1 or x's
    return all(c == 1 or c == n for c, n in zip(clead, lead[len(lead) - len(clead):]))


def _rotary_impl(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool,
                 inverse: bool, keep: int = 0) -> torch.Tensor:
    """Body of the mla_autograd::rotary op (no autograd here): the Triton kernel where `_kernel_takes`, else
    the same rotation as torch ops. inverse: the transposed rotation (x in the half-split layout, the result
    in the pair layout `interleaved` names), which is the forward's backward. keep: leading columns of x's
    last dim copied unchanged (the rotation takes the rest)."""
    x_interleaved, out_interleaved = (False, interleaved) if inverse else (interleaved, False)
    if not _kernel_takes(x, cos, sin, keep):
        return _rotate_torch(x, cos, sin, x_interleaved, out_interleaved, inverse, keep)
    from . import _rope_triton
    lead = (1,) * (4 - x.dim())
    shape4 = (*lead, *x.shape[:-1])
    # (A, B, C, D) views for the kernel: leading size-1 dims, cos/sin expanded to x's rows (stride 0, no copy)
    x4 = x.view(*lead, *x.shape) if lead else x
    cos4 = cos.expand(*shape4, cos.shape[-1])
    sin4 = sin.expand(*shape4, sin.shape[-1])
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    _rope_triton.rotate(x4, cos4, sin4, out.view(x4.shape), x_interleaved=x_interleaved,
                        out_interleaved=out_interleaved, negate_sin=inverse, keep=keep)
    return out


# x rotated by cos/sin, computed by _rotary_impl; differentiable in x (its backward is the op with inverse
# flipped: the rotation is linear), never in cos/sin (apply_rotary keeps calls whose cos/sin need a gradient
# on the torch path). The output is a new contiguous tensor of x's shape and dtype.
rotary_op = torch.library.custom_op("mla_autograd::rotary", mutates_args=())(_rotary_impl)


@rotary_op.register_fake
def _(x, cos, sin, interleaved, inverse, keep=0):
    return torch.empty(x.shape, dtype=x.dtype, device=x.device)


def _rotary_setup_context(ctx, inputs, output) -> None:
    _, cos, sin, interleaved, inverse, keep = inputs
    ctx.save_for_backward(cos, sin)  # the tables only (D/2 floats per position), never activations
    ctx.flags = (interleaved, inverse, keep)


def _rotary_backward(ctx, dout: torch.Tensor):
    cos, sin = ctx.saved_tensors
    interleaved, inverse, keep = ctx.flags
    return _rotary(dout, cos, sin, interleaved, not inverse, keep), None, None, None, None, None


rotary_op.register_autograd(_rotary_backward, setup_context=_rotary_setup_context)


class _EagerRotary(torch.autograd.Function):
    """rotary_op with its registered autograd, for plain eager tensors: the op's body and formulas without
    the custom-op dispatcher (as _ops does for attention)."""

    @staticmethod
    def forward(ctx, x, cos, sin, interleaved, inverse, keep):
        out = _rotary_impl(x, cos, sin, interleaved, inverse, keep)
        _rotary_setup_context(ctx, (x, cos, sin, interleaved, inverse, keep), out)
        return out

    backward = staticmethod(_rotary_backward)


def _rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool, inverse: bool,
            keep: int = 0) -> torch.Tensor:
    """rotary_op's result, differentiable in x: the op under torch.compile and for tensor subclasses; for plain
    eager tensors _EagerRotary where autograd records the call, else the op's body."""
    if not eager_direct(x, cos, sin):
        return rotary_op(x, cos, sin, interleaved, inverse, keep)
    if torch.is_grad_enabled() and x.requires_grad:
        return _EagerRotary.apply(x, cos, sin, interleaved, inverse, keep)
    return _rotary_impl(x, cos, sin, interleaved, inverse, keep)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *, interleaved: bool,
                 keep: int = 0) -> torch.Tensor:
    """Rotate the last dim of x (after its first `keep` columns) by the angles whose cosines and sines cos/sin
    hold.

    Args:
        x: (..., D) any float dtype, any strides (e.g. q_pe (B, S, H, D), a view of the query projection's
            output, or k_pe (B, S, D), a view of kv_a_proj_with_mqa's); D even. Its pairs are
            (x[..., 2p], x[..., 2p+1]) when interleaved, else (x[..., p], x[..., p + D/2]) (rotate_half).
        cos, sin: (..., D/2) float32 (as RotaryEmbedding returns them), broadcast against x without its last
            dim; pass them unsqueezed for a head dim (cos.unsqueeze(-2) for x (B, S, H, D)).
        interleaved: x's pair layout (above).
        keep: this many leading columns of x's last dim are copied to the result unchanged and the rotation
            takes the D columns after them: x (..., keep + D), e.g. the whole query head (..., 128 + 64) of
            MLA, whose roped query then leaves in one tensor beside its nope part (no concatenation later).

    Returns:
        A new contiguous tensor of x's shape and dtype in the half-split layout (see the module docstring):
        out[..., p] = x1 * c - x2 * s, out[..., p + D/2] = x2 * c + x1 * s for pair p = (x1, x2), computed in
        float32 (float64 for float64 x) and rounded once to x's dtype.

    CUDA tensors of bfloat16/float16/float32 (rank <= 4, cos/sin float32 broadcasting to x's leading shape and
    not requiring grad) take one Triton kernel launch per direction, bit-identical to the torch ops (forward and
    gradient); it saves only cos/sin for the backward. Everything else (CPU, float64, other shapes) runs the
    rotation as torch ops, with gradients for cos/sin too where they require them.
    """
    if _kernel_takes(x, cos, sin, keep) and not (torch.is_grad_enabled() and (cos.requires_grad or sin.requires_grad)):
        return _rotary(x, cos, sin, interleaved, False, keep)
    return _rotate_torch(x, cos, sin, interleaved, False, False, keep)


def _heads_view(x: torch.Tensor, heads: int) -> torch.Tensor | None:
    """x (..., heads * W) as (..., heads, W), or None where that needs a copy (its last dim split across
    strides). Metadata only."""
    try:
        return x.view(*x.shape[:-1], heads, x.shape[-1] // heads)
    except RuntimeError:
        return None


def _rope_columns(x: torch.Tensor, heads: int, keep: int) -> torch.Tensor:
    """The rotary columns of x (..., heads * (keep + D)) as a 4-d view (A, B, C, D) for the kernel: per head the
    D columns after its first `keep`, leading size-1 dims where x has fewer. Metadata only."""
    xv = _heads_view(x, heads)[..., keep:]
    return xv[(None,) * (4 - xv.dim())] if xv.dim() < 4 else xv


def _rotate_heads_in_place(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, heads: int, keep: int,
                           x_interleaved: bool, out_interleaved: bool, negate_sin: bool) -> None:
    """Rotate the rotary columns of every head of x (..., heads * (keep + D)) in place: one launch of the kernel
    with x's rotary columns as both its input and its output (the kernel then orders all of a program's loads
    before its stores), the `keep` columns untouched. cos/sin (..., 1, D/2) float32."""
    from . import _rope_triton
    x4 = _rope_columns(x, heads, keep)
    cos4 = cos.expand(*x4.shape[:-1], cos.shape[-1])
    sin4 = sin.expand(*x4.shape[:-1], sin.shape[-1])
    _rope_triton.rotate(x4, cos4, sin4, x4, x_interleaved=x_interleaved, out_interleaved=out_interleaved,
                        negate_sin=negate_sin)


# _rotate_heads_in_place as a mutating op, for traced calls: under torch.compile Inductor functionalizes it and
# then writes it back in place where x has no other reader (the projection's output, the attention's dq), so the
# compiled layer rotates its query where it lies, as the eager one does.
rotary_heads_op = torch.library.custom_op("mla_autograd::rotary_heads_", mutates_args=("x",))(_rotate_heads_in_place)


@rotary_heads_op.register_fake
def _(x, cos, sin, heads, keep, x_interleaved, out_interleaved, negate_sin):
    return None


def _rotate_heads_in_place_traced(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, heads: int, keep: int,
                                  x_interleaved: bool, out_interleaved: bool, negate_sin: bool) -> None:
    """_rotate_heads_in_place: directly for plain eager tensors, through rotary_heads_op where the call is traced
    (torch.compile) or takes tensor subclasses."""
    fn = _rotate_heads_in_place if eager_direct(x, cos, sin) else rotary_heads_op
    fn(x, cos, sin, heads, keep, x_interleaved, out_interleaved, negate_sin)


class _RotaryHeadsInPlace(torch.autograd.Function):
    """RotaryEmbedding.rotate_heads on the kernel path: the rotary columns of x rotated where they are (the
    `keep` columns are neither read nor written), x returned marked dirty. The backward rotates the rotary
    columns of the incoming gradient back: in place where the caller said that the gradient is its own
    (grad_in_place; a gradient that does not view as heads with unit stride is copied first), else into a new
    tensor. Under create_graph=True it is the differentiable out-of-place rotation."""

    @staticmethod
    def forward(ctx, x, cos, sin, heads, keep, interleaved, grad_in_place):
        _rotate_heads_in_place_traced(x, cos, sin, heads, keep, interleaved, False, False)
        ctx.mark_dirty(x)
        ctx.save_for_backward(cos, sin)
        ctx.flags = (heads, keep, interleaved, grad_in_place)
        return x

    @staticmethod
    def backward(ctx, dx):
        cos, sin = ctx.saved_tensors
        heads, keep, interleaved, grad_in_place = ctx.flags
        none = (None,) * 6
        if torch.is_grad_enabled() or not grad_in_place:  # a new tensor (differentiable under create_graph=True)
            shape4 = (*dx.shape[:-1], heads, dx.shape[-1] // heads)
            return _rotary(dx.reshape(shape4), cos, sin, interleaved, True, keep).view(dx.shape), *none
        if dx.stride(-1) != 1 or _heads_view(dx, heads) is None:
            dx = dx.contiguous()
        _rotate_heads_in_place_traced(dx, cos, sin, heads, keep, False, interleaved, True)
        return dx, *none


class RotaryEmbedding(nn.Module):
    """cos/sin (float32) for integer positions; holds no parameters or buffers (nothing in state_dict)."""

    def __init__(self, dim: int, rope_theta: float = 10000.0, max_position_embeddings: int = 4096,
                 rope_scaling: Mapping[str, Any] | None = None, *, interleaved: bool = True):
        super().__init__()
        inv_freq, attention_factor = rope_parameters(dim, rope_theta, max_position_embeddings, rope_scaling)
        self.dim = dim
        self.interleaved = interleaved
        self.attention_factor = attention_factor
        # Kept outside the buffer machinery on purpose: module.to(torch.bfloat16) must not round
        # the frequencies. One float32 copy per device, made on first use.
        self._inv_freq = {torch.device("cpu"): inv_freq}

    def inv_freq(self, device: torch.device) -> torch.Tensor:
        device = torch.device(device)
        t = self._inv_freq.get(device)
        if t is None:
            t = self._inv_freq[torch.device("cpu")].to(device)
            self._inv_freq[device] = t
        return t

    def forward(self, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """position_ids (...) integer, any device -> cos, sin (..., dim/2) float32 on that device, contiguous,
        the attention factor applied."""
        freqs = position_ids.to(torch.float32)[..., None] * self.inv_freq(position_ids.device)
        cos, sin = freqs.cos(), freqs.sin()
        if self.attention_factor == 1.0:  # x * 1.0 == x: two launches fewer without YaRN, same values
            return cos, sin
        return cos * self.attention_factor, sin * self.attention_factor

    def rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, keep: int = 0) -> torch.Tensor:
        """`apply_rotary` with this embedding's pair layout: x (..., keep + dim) any float dtype and strides,
        cos/sin (..., dim/2) float32 from forward, broadcasting against x without its last dim -> a new
        contiguous tensor of x's shape and dtype, its first `keep` columns x's, the rest half-split."""
        return apply_rotary(x, cos, sin, interleaved=self.interleaved, keep=keep)

    def rotate_heads(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, heads: int, keep: int = 0, *,
                     grad_in_place: bool = False) -> torch.Tensor:
        """`rotate` over a projection's output that holds `heads` heads side by side: x (..., heads * (keep + dim)),
        cos/sin (..., 1, dim/2) float32 (unsqueezed for the heads) -> (..., heads, keep + dim), each head's first
        `keep` columns x's, the rest rotated into the half-split layout; the same values and gradient as `rotate`
        on x.view(..., heads, keep + dim).

        On the kernel path (plain CUDA tensors, eager or traced by torch.compile, x contiguous along its last dim
        and the fresh result of an op, not a leaf that requires grad nor, eagerly, an autograd view) x's rotary
        columns are rotated in place, its `keep` columns
        neither read nor written (MLA's query: 128 of every 192 columns), and the result is a view of x; x must
        not be needed by the backward of the op that made it (a linear layer's output is not). With grad_in_place
        the backward rotates the gradient that reaches the result in place as well: only for a caller that knows
        that gradient to be a fresh tensor nothing else reads (the layer's query, whose gradient is the
        attention backward's dq); a gradient passed in by a user (``y.backward(dy)``) would be overwritten.
        Elsewhere the result is `rotate`'s new tensor."""
        if isinstance(heads, bool) or not isinstance(heads, int) or heads <= 0 or x.dim() < 1 or x.shape[-1] % heads:
            raise ValueError(f"rotate_heads: heads must be a positive int that divides x's last dim, got heads="
                             f"{heads!r} for x of shape {tuple(x.shape)}")
        shape = (*x.shape[:-1], heads, x.shape[-1] // heads)
        if self._rotates_in_place(x, cos, sin, heads, keep):
            if torch.is_grad_enabled() and x.requires_grad:
                x = _RotaryHeadsInPlace.apply(x, cos, sin, heads, keep, self.interleaved, bool(grad_in_place))
            else:
                _rotate_heads_in_place_traced(x, cos, sin, heads, keep, self.interleaved, False, False)
            return x.view(shape)
        return self.rotate(x.view(shape), cos, sin, keep=keep)

    @staticmethod
    def _rotates_in_place(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, heads: int, keep: int) -> bool:
        """rotate_heads may rotate x in place: plain tensors (eager, or traced by torch.compile) that the kernel
        takes (`_kernel_takes` on the heads' view), cos/sin not requiring grad, x unit stride along its last dim,
        not a leaf that requires grad and, eagerly, not an autograd view (a traced view's mutation is
        functionalized like any other). Metadata only."""
        tracing = torch.compiler.is_compiling()
        if not (tracing or eager_direct(x, cos, sin)) or x.dim() < 1 or x.shape[-1] % heads or x.stride(-1) != 1:
            return False
        if (x.requires_grad and x.is_leaf) or cos.requires_grad or sin.requires_grad:
            return False
        if not tracing and x._is_view():
            return False
        xv = _heads_view(x, heads)
        return xv is not None and _kernel_takes(xv, cos, sin, keep)

    def extra_repr(self) -> str:
        return f"dim={self.dim}, interleaved={self.interleaved}, attention_factor={self.attention_factor:g}"
