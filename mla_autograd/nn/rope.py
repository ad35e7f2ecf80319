"""Rotary position embedding for MLA's decoupled rope dims, with DeepSeek's YaRN scaling.

Numerics follow Hugging Face transformers' DeepseekV3 (and DeepSeek's own reference code):

- inverse frequencies and the angle table are computed in float32, ``cos``/``sin`` are multiplied
  by the YaRN attention factor (``mscale / mscale_all_dim``) in float32;
- the rotation is applied in float32 (float64 for float64 inputs) and cast back to the input dtype;
- ``interleaved=True`` (DeepSeek's checkpoints, ``rope_interleave=True`` in transformers) rotates the
  pairs ``(x0, x1), (x2, x3), ...``; ``interleaved=False`` rotates ``(x_i, x_{i+d/2})`` (rotate_half).
  Either way the output is laid out half-split: ``[x_even' ..., x_odd' ...]``, exactly like
  transformers, so q.k products (and cached roped keys) agree bit-for-bit in layout.
- the softmax scale is ``qk_head_dim ** -0.5``, times ``yarn_get_mscale(factor, mscale_all_dim) ** 2``
  when YaRN scaling with ``mscale_all_dim`` is configured.
"""
from __future__ import annotations

import math
from typing import Any, Mapping

import torch
from torch import nn

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


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *, interleaved: bool) -> torch.Tensor:
    """Rotate the last dim of x (..., [H,] d) by angles with cos/sin (..., d/2) (float32).

    cos/sin broadcast against x without its last dim; pass them unsqueezed for a head dim.
    Returns x's dtype, half-split layout (see the module docstring).
    """
    cd = torch.float64 if x.dtype == torch.float64 else torch.float32
    xc = x.to(cd)
    # unbind / chunk rather than two slices: their backward is one stack / concatenation, where each
    # slice's backward would zero-fill a tensor of x's whole shape and the two would be added
    if interleaved:
        x1, x2 = xc.unflatten(-1, (-1, 2)).unbind(-1)
    else:
        x1, x2 = xc.chunk(2, dim=-1)
    c, s = cos.to(cd), sin.to(cd)
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1).to(x.dtype)


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
        """position_ids (...) integer -> cos, sin (..., dim/2) float32 (attention factor applied)."""
        freqs = position_ids.to(torch.float32)[..., None] * self.inv_freq(position_ids.device)
        return freqs.cos() * self.attention_factor, freqs.sin() * self.attention_factor

    def rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        return apply_rotary(x, cos, sin, interleaved=self.interleaved)

    def extra_repr(self) -> str:
        return f"dim={self.dim}, interleaved={self.interleaved}, attention_factor={self.attention_factor:g}"
