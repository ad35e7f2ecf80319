"""MultiHeadLatentAttention: DeepSeek-V2/V3 MLA as a drop-in nn.Module.

Parameter names and shapes are those of Hugging Face transformers' ``DeepseekV3Attention``
(``q_proj`` or ``q_a_proj`` + ``q_a_layernorm`` + ``q_b_proj``; ``kv_a_proj_with_mqa``,
``kv_a_layernorm``, ``kv_b_proj``, ``o_proj``), so its state_dict loads with ``strict=True`` and the
outputs match (same rotary layout, same softmax scale including YaRN's mscale).

Two execution paths:

- Training / prefill (``forward`` without a cache, or the first chunk into an empty cache): the
  latent is expanded to per-head ``[k_nope | v]`` (``kv_b_proj``), and
  :func:`mla_autograd.mla_attention_packed` (or ``mla_attention_packed_varlen`` for packed batches) runs
  on the roped query ``[q_nope | q_pe]``, that expansion and the roped key shared by every head (one
  head, ``(B, S, 1, d_rope)``), with bottom-right causal masking. Fully differentiable; the attention's
  backward hands both projections their gradients whole (no concatenation, also under torch.compile).
- Cached inference (``cache=MLACache``): the normalized latent and the roped shared key are written
  into the paged cache. Decode steps (at most ``absorb_max_new_tokens`` = 8 new tokens per sequence)
  run weight-absorbed on the latent (W_UK folded into the query, W_UV applied to the latent output)
  through :func:`mla_autograd.decode`. A prefill into an empty cache attends over the new tokens with
  the expanded path; a longer chunk into a non-empty cache (chunked prefill, or packed sequences of
  different lengths) expands each sequence's cached latent and runs ``mla_attention_packed_varlen``
  (bottom-right causal). The absorbed weights are
  computed once and recomputed when ``kv_b_proj.weight`` changes (tracked by its version counter,
  storage and dtype; call :meth:`MultiHeadLatentAttention.invalidate_absorbed` after writing
  ``.data`` directly). Inference only: run it under ``torch.no_grad()`` / ``torch.inference_mode()``.
"""
from __future__ import annotations

import math
import numbers
from typing import Any, Mapping

import torch
from torch import nn

from .._ops import eager_direct
from .cache import MLACache, _to_device
from .rope import _HAS_TRITON, RotaryEmbedding, mla_softmax_scale

__all__ = ["MultiHeadLatentAttention", "RMSNorm"]


def _positive(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value <= 0:
        raise ValueError(f"MultiHeadLatentAttention: {name} must be a positive int, got {value!r}")
    return int(value)


def _api():
    """The package's public attention entry points (mla_attention, mla_attention_varlen, decode)."""
    from .. import functional  # late import: keeps `import mla_autograd.nn` free of import cycles
    return functional


def _rms_norm_torch(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm as torch ops (differentiable through them), transformers' DeepseekV3RMSNorm: statistics and
    normalization in float32 (float64 for float64 x), the normalized x rounded to x's dtype, then times weight
    (in the two dtypes' promotion)."""
    dtype = x.dtype
    h = x.to(torch.float32) if dtype != torch.float64 else x
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(dtype)


_NORM_KERNEL_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
# Device types whose tensors RMSNorm's Triton kernels take. The tests add "cpu" under Triton's interpreter
# (TRITON_INTERPRET=1), which runs the kernels on CPU tensors.
_NORM_KERNEL_DEVICE_TYPES = ("cuda",)
#: The widest rows the kernels take (_rmsnorm_triton.MAX_N, repeated here so that the check imports no triton).
_NORM_KERNEL_MAX_N = 8192


def _rows_stride(t: torch.Tensor) -> int | None:
    """The stride between consecutive rows of t (..., N) viewed as (rows, N), or None when its leading dims do
    not flatten into one without a copy (t.view(-1, N) would fail). Metadata only."""
    stride = None
    span = None  # the stride the next outer dim needs to continue the rows evenly
    for size, st in zip(reversed(t.shape[:-1]), reversed(t.stride()[:-1])):
        if size == 1:
            continue
        if span is None:
            stride = st
        elif st != span:
            return None
        span = st * size
    return t.shape[-1] if stride is None else stride  # one row: any stride does


def _norm_kernel_takes(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """RMSNorm's Triton kernels serve the call: x a non-empty tensor of rank >= 1 on a kernel device (CUDA) in
    bfloat16/float16/float32, at most _NORM_KERNEL_MAX_N wide, unit stride along its last dim (or one column)
    and leading dims that view as one row dim without a copy; weight (N,) of x's dtype on x's device (any
    stride). Metadata only; plain eager tensors are RMSNorm.forward's own check."""
    if not (_HAS_TRITON and x.device.type in _NORM_KERNEL_DEVICE_TYPES and x.dtype in _NORM_KERNEL_DTYPES):
        return False
    if x.dim() == 0 or x.numel() == 0 or x.shape[-1] > _NORM_KERNEL_MAX_N:
        return False
    if weight.dtype != x.dtype or weight.device != x.device or weight.dim() != 1 or weight.shape[0] != x.shape[-1]:
        return False
    return (x.stride(-1) == 1 or x.shape[-1] == 1) and _rows_stride(x) is not None


def _rms_norm_kernel(x: torch.Tensor, weight: torch.Tensor, eps: float,
                     need_rstd: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The forward kernel on x (..., N) where `_norm_kernel_takes`: (y of x's shape, contiguous; rstd (rows,)
    float32 or None). See `_rmsnorm_triton.rms_norm_forward`."""
    from . import _rmsnorm_triton
    n = x.shape[-1]
    y, rstd = _rmsnorm_triton.rms_norm_forward(x.view(-1, n), weight, eps, need_rstd=need_rstd)
    return y.view(x.shape), rstd


def _rms_norm_kernel_backward(dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, rstd: torch.Tensor,
                              need_dx: bool, need_dw: bool) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """The backward kernel: (dx of x's shape or None, d weight or None) for the upstream gradient dy (x's shape,
    any strides). See `_rmsnorm_triton.rms_norm_backward`."""
    from . import _rmsnorm_triton
    n = x.shape[-1]
    # a gradient whose leading dims do not flatten in place (e.g. a transpose's), or whose last dim is not unit
    # stride (an expanded y.sum() gradient, a column-major one), is copied once: Triton specializes its kernel on a
    # unit last stride, and the other compilation would sum the rows in another order (other bits)
    if dy.stride(-1) == 1 and _rows_stride(dy) is not None:
        dy2 = dy.view(-1, n)
    else:
        dy2 = dy.contiguous().view(-1, n)
    dx, dw = _rmsnorm_triton.rms_norm_backward(dy2, x.view(-1, n), weight, rstd, need_dx=need_dx, need_dw=need_dw)
    return (dx.view(x.shape) if dx is not None else None), dw


class _FusedRMSNorm(torch.autograd.Function):
    """RMSNorm through the Triton kernels, forward and backward; saves x (the input, held anyway), weight and
    rstd (float32, one per row), never the normalized x or the output.

    The backward computes only the gradients asked for (ctx.needs_input_grad). Under create_graph=True (double
    backward) it recomputes the forward as torch ops from the saved x and weight and returns their gradient,
    itself differentiable: the gradient's own gradient follows the torch path's formulas."""

    @staticmethod
    def forward(ctx, x, weight, eps):
        y, rstd = _rms_norm_kernel(x, weight, eps, need_rstd=True)
        ctx.save_for_backward(x, weight, rstd)
        ctx.eps = eps
        return y

    @staticmethod
    def backward(ctx, dy):
        x, weight, rstd = ctx.saved_tensors
        need_dx, need_dw = ctx.needs_input_grad[:2]
        if not (need_dx or need_dw):
            return None, None, None
        if torch.is_grad_enabled():  # create_graph=True: a differentiable gradient, through the torch ops
            wrt = [t for t, need in ((x, need_dx), (weight, need_dw)) if need]
            grads = list(torch.autograd.grad(_rms_norm_torch(x, weight, ctx.eps), wrt, dy, create_graph=True))
            return (grads.pop(0) if need_dx else None), (grads.pop(0) if need_dw else None), None
        dx, dw = _rms_norm_kernel_backward(dy, x, weight, rstd, need_dx, need_dw)
        return dx, dw, None


# Parameters are a tensor subclass that holds a plain tensor: the kernels take them like plain tensors
_PLAIN_WEIGHT_TYPES = (torch.Tensor, nn.Parameter)


class RMSNorm(nn.Module):
    """RMSNorm with transformers' DeepseekV3RMSNorm numerics: per row of x (..., hidden_size),
    ``weight * round(float32(x) * rsqrt(mean(float32(x)**2) + eps))``, the statistics and the normalization in
    float32 (float64 for float64 x), the normalized x rounded to x's dtype before the weight multiplies it.

    Plain eager CUDA tensors of bfloat16/float16/float32 (at most 8192 columns, unit stride along the last dim
    and leading dims that flatten without a copy, weight of x's dtype and device) take one Triton launch per
    direction (`_rmsnorm_triton`), output contiguous. Given the same mean square the forward is the torch ops' bit
    for bit (the mean taken as torch's CUDA mean takes it, the float32 sum times float32(1/N)); the kernel adds
    the squares in its own order, which can move the sum's last bits and so an output by a few float32 ulps, or
    by one or two in bfloat16/float16. The backward saves only x, weight and one float32 rstd per row (never the
    normalized x or the output) and computes only the gradients asked for, with the torch ops' formulas in
    float32 (d weight summed over the rows in float32, each product unrounded, deterministically): within the
    torch ops' rounding error. Under create_graph=True it recomputes the torch ops from x and weight and returns
    their gradient, itself differentiable: double backward works and follows the torch path. Everything else
    (CPU, float64, a weight of another dtype, wider or non-flattening inputs, torch.compile tracing, tensor
    subclasses) runs the torch ops, which Inductor fuses when compiled."""

    def __init__(self, hidden_size: int, eps: float = 1e-6, device=None, dtype=None):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size, device=device, dtype=dtype))
        self.variance_epsilon = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weight
        if eager_direct(x) and type(w) in _PLAIN_WEIGHT_TYPES and _norm_kernel_takes(x, w):
            if torch.is_grad_enabled() and (x.requires_grad or w.requires_grad):
                return _FusedRMSNorm.apply(x, w, self.variance_epsilon)
            return _rms_norm_kernel(x, w, self.variance_epsilon, need_rstd=False)[0]
        return _rms_norm_torch(x, w, self.variance_epsilon)

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.variance_epsilon}"


class MultiHeadLatentAttention(nn.Module):
    """Multi-head Latent Attention (DeepSeek-V2/V3).

    Args:
        hidden_size: model width.
        num_heads: attention heads.
        q_lora_rank: None for a full-rank ``q_proj``; else the query low-rank width
            (``q_a_proj`` -> ``q_a_layernorm`` -> ``q_b_proj``).
        kv_lora_rank: latent width (512 in DeepSeek; the decode kernel needs 512).
        qk_nope_head_dim, qk_rope_head_dim, v_head_dim: per-head dims (128, 64, 128 in DeepSeek;
            the decode kernel needs rope 64, the training kernels qk 192 / v 128).
        rope_theta, max_position_embeddings, rope_scaling: rotary settings; rope_scaling is None or
            a YaRN dict as in DeepSeek configs (``{"type": "yarn", "factor": 40, "mscale": 1.0,
            "mscale_all_dim": 1.0, "original_max_position_embeddings": 4096, ...}``).
        attention_bias: bias on q_a_proj, kv_a_proj_with_mqa and o_proj (as in transformers).
        rope_interleave: DeepSeek checkpoints rotate interleaved pairs (transformers' default True).
        norm_eps: epsilon of q_a_layernorm / kv_a_layernorm (1e-6 as in transformers).

    Every size (hidden_size, num_heads, q_lora_rank when given, kv_lora_rank, the three head dims,
    max_position_embeddings) must be a positive int, qk_rope_head_dim even, rope_theta a positive
    finite number: anything else raises ValueError naming the argument.
    """

    def __init__(self, hidden_size: int, num_heads: int, q_lora_rank: int | None = None,
                 kv_lora_rank: int = 512, qk_nope_head_dim: int = 128, qk_rope_head_dim: int = 64,
                 v_head_dim: int = 128, rope_theta: float = 10000.0, max_position_embeddings: int = 4096,
                 rope_scaling: Mapping[str, Any] | None = None, attention_bias: bool = False, *,
                 rope_interleave: bool = True, norm_eps: float = 1e-6, device=None, dtype=None):
        super().__init__()
        for name, value in (("hidden_size", hidden_size), ("num_heads", num_heads), ("kv_lora_rank", kv_lora_rank),
                            ("qk_nope_head_dim", qk_nope_head_dim), ("qk_rope_head_dim", qk_rope_head_dim),
                            ("v_head_dim", v_head_dim), ("max_position_embeddings", max_position_embeddings)):
            _positive(name, value)
        if q_lora_rank is not None:
            _positive("q_lora_rank", q_lora_rank)
        if qk_rope_head_dim % 2:
            raise ValueError(f"MultiHeadLatentAttention: qk_rope_head_dim must be even (rotary pairs), got "
                             f"{qk_rope_head_dim}")
        if isinstance(rope_theta, bool) or not isinstance(rope_theta, numbers.Real) or not (
                math.isfinite(rope_theta) and rope_theta > 0):
            raise ValueError(f"MultiHeadLatentAttention: rope_theta must be a positive finite number, got "
                             f"{rope_theta!r}")
        fk = {"device": device, "dtype": dtype}
        self.hidden_size = hidden_size
        self.num_heads = num_heads
        self.q_lora_rank = q_lora_rank
        self.kv_lora_rank = kv_lora_rank
        self.qk_nope_head_dim = qk_nope_head_dim
        self.qk_rope_head_dim = qk_rope_head_dim
        self.qk_head_dim = qk_nope_head_dim + qk_rope_head_dim
        self.v_head_dim = v_head_dim
        self.rope_scaling = dict(rope_scaling) if rope_scaling else None

        if q_lora_rank is None:
            self.q_proj = nn.Linear(hidden_size, num_heads * self.qk_head_dim, bias=False, **fk)
        else:
            self.q_a_proj = nn.Linear(hidden_size, q_lora_rank, bias=attention_bias, **fk)
            self.q_a_layernorm = RMSNorm(q_lora_rank, norm_eps, **fk)
            self.q_b_proj = nn.Linear(q_lora_rank, num_heads * self.qk_head_dim, bias=False, **fk)
        self.kv_a_proj_with_mqa = nn.Linear(hidden_size, kv_lora_rank + qk_rope_head_dim,
                                            bias=attention_bias, **fk)
        self.kv_a_layernorm = RMSNorm(kv_lora_rank, norm_eps, **fk)
        self.kv_b_proj = nn.Linear(kv_lora_rank, num_heads * (qk_nope_head_dim + v_head_dim), bias=False, **fk)
        self.o_proj = nn.Linear(num_heads * v_head_dim, hidden_size, bias=attention_bias, **fk)

        self.rotary = RotaryEmbedding(qk_rope_head_dim, rope_theta, max_position_embeddings, rope_scaling,
                                      interleaved=rope_interleave)
        self.softmax_scale = mla_softmax_scale(self.qk_head_dim, rope_scaling)
        self._absorbed: tuple[torch.Tensor, torch.Tensor] | None = None
        self._absorbed_key = None
        self._rope_tables: dict[tuple[int, torch.device], tuple[torch.Tensor, torch.Tensor]] = {}

    #: With a non-empty cache, dense steps of at most this many new tokens per sequence run the
    #: weight-absorbed decode (the decode kernel takes 1..8); longer chunks expand the cached latent.
    absorb_max_new_tokens: int = 8

    # ------------------------------------------------------------------ construction helpers
    @classmethod
    def from_config(cls, config, **overrides) -> "MultiHeadLatentAttention":
        """Build from a transformers DeepseekV2/V3 config (or any object with the same attributes)."""
        rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None)
        rope = dict(rope) if rope else None
        theta = getattr(config, "rope_theta", None)
        if rope is not None:
            theta = rope.get("rope_theta", theta)
            if rope.get("rope_type", rope.get("type", "default")) == "default":
                rope = None
        kw = dict(
            hidden_size=config.hidden_size, num_heads=config.num_attention_heads,
            q_lora_rank=config.q_lora_rank, kv_lora_rank=config.kv_lora_rank,
            qk_nope_head_dim=config.qk_nope_head_dim, qk_rope_head_dim=config.qk_rope_head_dim,
            v_head_dim=config.v_head_dim, rope_theta=theta if theta is not None else 10000.0,
            max_position_embeddings=config.max_position_embeddings, rope_scaling=rope,
            attention_bias=getattr(config, "attention_bias", False),
            rope_interleave=getattr(config, "rope_interleave", True),
        )
        kw.update(overrides)
        return cls(**kw)

    def extra_repr(self) -> str:
        return (f"hidden_size={self.hidden_size}, num_heads={self.num_heads}, q_lora_rank={self.q_lora_rank}, "
                f"kv_lora_rank={self.kv_lora_rank}, qk_nope={self.qk_nope_head_dim}, "
                f"qk_rope={self.qk_rope_head_dim}, v={self.v_head_dim}, softmax_scale={self.softmax_scale:.6g}")

    def new_cache(self, num_pages: int, page_size: int, batch: int, device=None, dtype=None) -> MLACache:
        """An allocated :class:`MLACache` sized for this layer (device/dtype default to the weights')."""
        w = self.kv_b_proj.weight
        return MLACache(self.kv_lora_rank, self.qk_rope_head_dim).allocate(
            num_pages, page_size, batch, device if device is not None else w.device,
            dtype if dtype is not None else w.dtype)

    # ------------------------------------------------------------------ pieces
    def _queries(self, h: torch.Tensor) -> torch.Tensor:
        """The query projection (..., H * (qk_nope + qk_rope)), before RoPE, as the last linear layer returns it."""
        if self.q_lora_rank is None:
            return self.q_proj(h)
        return self.q_b_proj(self.q_a_layernorm(self.q_a_proj(h)))

    def _latents(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        ckv = self.kv_a_proj_with_mqa(h)
        c, k_pe = ckv.split([self.kv_lora_rank, self.qk_rope_head_dim], dim=-1)
        return self.kv_a_layernorm(c), k_pe

    def _attend(self, q, c, k_pe, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None, max_seqlen_k=None,
                deterministic: bool = False) -> torch.Tensor:
        """Causal (bottom-right) attention of the roped query q (..., H, qk_nope + qk_rope) over the latent c
        (..., r) and the roped shared key k_pe (..., d_rope): dense (B, S, ...) or, with cu_seqlens, packed (T, ...).
        The latent's up-projection kv (..., H, qk_nope + v) goes to mla_attention_packed whole, as q does, so the
        backward hands both projections their gradients whole. Returns (..., H, Dv)."""
        kv = self.kv_b_proj(c).view(*c.shape[:-1], self.num_heads, self.qk_nope_head_dim + self.v_head_dim)
        k_pe = k_pe.unsqueeze(-2)  # one head, shared by all
        F_ = _api()
        if cu_seqlens_q is not None:
            return F_.mla_attention_packed_varlen(q, kv, k_pe, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                                  causal=True, causal_align="bottom_right",
                                                  softmax_scale=self.softmax_scale, deterministic=deterministic)
        return F_.mla_attention_packed(q, kv, k_pe, causal=True, causal_align="bottom_right",
                                       softmax_scale=self.softmax_scale, deterministic=deterministic)

    @staticmethod
    def _varlen_positions(cu_seqlens: torch.Tensor, total: int) -> torch.Tensor:
        """Positions restarting at 0 for each packed sequence, computed on the device (no sync)."""
        cu = cu_seqlens.to(torch.long)
        lens = cu[1:] - cu[:-1]
        seq = torch.repeat_interleave(torch.arange(lens.numel(), device=cu.device), lens, output_size=total)
        return torch.arange(total, device=cu.device) - cu[seq]

    def absorbed_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(W_UK (H, qk_nope, r), W_UV^T (H, r, v)) from kv_b_proj, cached until the weight changes."""
        w = self.kv_b_proj.weight
        try:
            version = w._version
        except RuntimeError:  # inference tensor: no version counter
            version = None
        key = (version, w.data_ptr(), w.dtype, w.device, tuple(w.shape))
        if self._absorbed is None or self._absorbed_key != key:
            with torch.no_grad():
                wv = w.detach().view(self.num_heads, self.qk_nope_head_dim + self.v_head_dim, self.kv_lora_rank)
                w_uk = wv[:, : self.qk_nope_head_dim, :].contiguous()
                w_uv_t = wv[:, self.qk_nope_head_dim:, :].transpose(1, 2).contiguous()
            self._absorbed = (w_uk, w_uv_t)
            self._absorbed_key = key
        return self._absorbed

    def invalidate_absorbed(self) -> None:
        """Forget the cached absorbed weights (needed only after writing kv_b_proj.weight.data)."""
        self._absorbed = None
        self._absorbed_key = None

    def _apply(self, fn, *args, **kwargs):
        self.invalidate_absorbed()
        self._rope_tables.clear()
        return super()._apply(fn, *args, **kwargs)

    # ------------------------------------------------------------------ forward
    def forward(self, hidden_states: torch.Tensor, position_ids: torch.Tensor | None = None,
                cu_seqlens: torch.Tensor | None = None, max_seqlen: int | None = None,
                cache: MLACache | None = None, *, deterministic: bool = False) -> torch.Tensor:
        """Causal MLA over hidden_states.

        Dense: hidden_states (B, S, hidden), position_ids (B, S) or (S,) (default 0..S-1, or
        continuing the cache). Packed varlen: hidden_states (T, hidden) with cu_seqlens int32 (B+1,)
        and max_seqlen; positions restart at 0 for every sequence (or continue its cached length).
        cu_seqlens may be on hidden_states' device or on the host (CPU): it is copied to the device
        without a sync. cache: an :class:`MLACache`; the new tokens are appended and attend to
        everything cached (inference only). The cache hands out pages on the host, so a packed cached
        call needs the per-sequence counts there: free from a CPU cu_seqlens, one copy (a sync) from
        one on the GPU. Returns (B, S, hidden) or (T, hidden).
        """
        packed = cu_seqlens is not None
        if packed:
            if hidden_states.dim() != 2:
                raise ValueError(f"with cu_seqlens, hidden_states must be packed (T, hidden), got "
                                 f"{tuple(hidden_states.shape)}")
            if max_seqlen is None:
                raise ValueError("max_seqlen is required with cu_seqlens")
        elif hidden_states.dim() != 3:
            raise ValueError(f"hidden_states must be (B, S, hidden) (or packed (T, hidden) with cu_seqlens), "
                             f"got {tuple(hidden_states.shape)}")
        if hidden_states.shape[-1] != self.hidden_size:
            raise ValueError(f"hidden_states last dim {hidden_states.shape[-1]} != hidden_size {self.hidden_size}")
        self._check_input(hidden_states, cache)
        if cache is not None:
            return self._forward_cached(hidden_states, position_ids, cu_seqlens, max_seqlen, cache)

        h = hidden_states
        cu = _to_device(cu_seqlens, h.device).to(torch.int32) if packed else None
        rope = None
        if position_ids is None:
            if packed:
                position_ids = self._varlen_positions(cu, h.shape[0])
            elif not torch.compiler.is_compiling():
                rope = self._default_rope(h.shape[1], h.device)
            else:
                position_ids = torch.arange(h.shape[1], device=h.device)
        q, c, k_pe = self._project(h, position_ids, rope)
        if packed:
            o = self._attend(q, c, k_pe, cu, cu, max_seqlen, max_seqlen, deterministic=deterministic)
        else:
            o = self._attend(q, c, k_pe, deterministic=deterministic)
        return self.o_proj(o.reshape(*o.shape[:-2], self.num_heads * self.v_head_dim))

    def _check_input(self, h: torch.Tensor, cache: MLACache | None) -> None:
        """hidden_states on the weights' device and, outside autocast, in their dtype (a raw matmul error
        otherwise); the cache on the same device."""
        w = self.kv_a_proj_with_mqa.weight
        if h.device != w.device:
            raise ValueError(f"hidden_states is on {h.device} but the layer's weights are on {w.device}: "
                             f"move one to the other (layer.to(device) or hidden_states.to(device))")
        if h.dtype != w.dtype and not torch.is_autocast_enabled(h.device.type):
            a, b = str(h.dtype).replace("torch.", ""), str(w.dtype).replace("torch.", "")
            raise TypeError(f"hidden_states has dtype {a} but the layer's weights are {b}: pass "
                            f"hidden_states.to(torch.{b}), convert the layer with layer.to(torch.{a}), or run "
                            f"under torch.autocast")
        if cache is not None and cache.buffer is not None and cache.device != h.device:
            raise ValueError(f"cache is on {cache.device} but hidden_states is on {h.device}")

    def _default_rope(self, seqlen: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin (seqlen, qk_rope / 2) float32 of positions 0..seqlen-1 on `device`, kept per (seqlen, device) (a
        few lengths): a training run at one length reuses them rather than issuing five small kernels, on a forward
        whose host time the GPU waits for. Made outside inference mode, so that they can be saved for a backward
        whichever mode first asked for them."""
        key = (seqlen, device)
        tables = self._rope_tables.get(key)
        if tables is None:
            if len(self._rope_tables) >= 8:
                self._rope_tables.clear()
            with torch.inference_mode(False), torch.no_grad():
                tables = self.rotary(torch.arange(seqlen, device=device))
            self._rope_tables[key] = tables
        return tables

    def _project(self, h, position_ids, rope=None):
        """Roped query, normalized latent and roped shared key for hidden states h.

        q (..., H, qk_nope + qk_rope) is the query projection with RoPE applied to each head's last qk_rope
        columns: on CUDA rotated in place in the projection's output, one Triton launch that leaves the nope
        columns where they are (`RotaryEmbedding.rotate_heads`; its backward rotates the rope columns of the
        query's gradient in place too), elsewhere one new tensor. Its gradient comes back whole from
        mla_attention_packed. k_pe (..., qk_rope) is the rotated slice of the latent projection, c (...,
        kv_lora_rank). rope: (cos, sin) to use instead of those of position_ids."""
        q = self._queries(h)
        c, k_pe = self._latents(h)
        # (..., d/2), broadcast over the batch when (S,); rope: the tables of positions 0..S-1 (_default_rope)
        cos, sin = rope if rope is not None else self.rotary(position_ids)
        # grad_in_place: q's only consumer is the attention, whose backward hands q's gradient over as a new tensor
        q = self.rotary.rotate_heads(q, cos.unsqueeze(-2), sin.unsqueeze(-2), self.num_heads,
                                     keep=self.qk_nope_head_dim, grad_in_place=True)
        k_pe = self.rotary.rotate(k_pe, cos, sin)
        return q, c, k_pe

    def _forward_cached(self, h, position_ids, cu_seqlens, max_seqlen, cache: MLACache) -> torch.Tensor:
        if torch.is_grad_enabled() and (h.requires_grad or any(p.requires_grad for p in self.parameters())):
            raise RuntimeError("MultiHeadLatentAttention: the cached (decode) path is inference only; "
                               "call it under torch.no_grad() or torch.inference_mode()")
        if cache.kv_lora_rank != self.kv_lora_rank or cache.qk_rope_head_dim != self.qk_rope_head_dim:
            raise ValueError(f"cache dims ({cache.kv_lora_rank}, {cache.qk_rope_head_dim}) != layer dims "
                             f"({self.kv_lora_rank}, {self.qk_rope_head_dim})")
        packed = cu_seqlens is not None
        empty = cache.is_empty()
        counts = None
        if packed:
            cu = _to_device(cu_seqlens, h.device).to(torch.int32)
            # the cache hands out pages on the host: the new tokens per sequence are needed there (free for a
            # CPU cu_seqlens; one copy, a sync, for one on the GPU)
            counts = torch.diff(cu_seqlens.cpu().long()).tolist()
            if position_ids is None:
                start = cache.seqlens.to(h.device, torch.long)
                pos = self._varlen_positions(cu, h.shape[0])
                seq = torch.repeat_interleave(torch.arange(len(counts), device=h.device), (cu[1:] - cu[:-1]).long(),
                                              output_size=h.shape[0])
                position_ids = pos + start[seq]
        else:
            if h.shape[0] != cache.batch:
                raise ValueError(f"batch {h.shape[0]} != cache batch {cache.batch}")
            if position_ids is None:
                position_ids = cache.positions(h.shape[1]).to(h.device)
        q, c, k_pe = self._project(h, position_ids)
        cache.append(c, k_pe, cu_seqlens=cu_seqlens if packed else None, new_lengths=counts)
        if empty:
            # Prefill into an empty cache: plain causal attention over the new tokens, expanded.
            o = self._attend(q, c, k_pe, *((cu, cu, max_seqlen, max_seqlen) if packed else ()))
            return self.o_proj(o.reshape(*o.shape[:-2], self.num_heads * self.v_head_dim))
        if not packed and h.shape[1] <= self.absorb_max_new_tokens:
            # Decode steps (and short chunks): weight-absorbed attention on the latent cache.
            q_nope, q_pe = q.split([self.qk_nope_head_dim, self.qk_rope_head_dim], dim=-1)
            o = self._absorbed_attention(q_nope, q_pe, cache)  # (B, S, H, v)
            return self.o_proj(o.reshape(*o.shape[:-2], self.num_heads * self.v_head_dim))
        # Longer chunks into a non-empty cache (chunked prefill), or packed continuations: expand the
        # whole cached latent of each sequence and run varlen attention, bottom-right causal.
        ckv_all, kpe_all, cu_k, max_k = cache.gather_all()
        if packed:
            q_cu, max_q = cu, max_seqlen
        else:
            B, S = q.shape[:2]
            q = q.flatten(0, 1)
            q_cu = torch.arange(0, B * S + 1, S, device=h.device, dtype=torch.int32)
            max_q = S
        o = self._attend(q, ckv_all.to(c.dtype), kpe_all.to(k_pe.dtype), q_cu, cu_k, max_q, max_k)
        if not packed:
            o = o.view(B, S, self.num_heads, self.v_head_dim)
        return self.o_proj(o.reshape(*o.shape[:-2], self.num_heads * self.v_head_dim))

    def _absorbed_attention(self, q_nope, q_pe, cache: MLACache) -> torch.Tensor:
        """q_nope (B, S, H, nope), q_pe (B, S, H, rope) over the cache -> (B, S, H, v)."""
        B, S, H, _ = q_nope.shape
        w_uk, w_uv_t = self.absorbed_weights()
        # W_UK folded into the query: (H, B*S, nope) @ (H, nope, r) -> (B, S, H, r)
        qn = q_nope.to(w_uk.dtype).permute(2, 0, 1, 3).reshape(H, B * S, self.qk_nope_head_dim)
        q_lat = torch.bmm(qn, w_uk).view(H, B, S, self.kv_lora_rank).permute(1, 2, 0, 3)
        cd = cache.dtype
        o_lat = _api().decode(q_lat.to(cd).contiguous(), q_pe.to(cd).contiguous(), cache.ckv, cache.kpe,
                              cache.block_table, cache.seqlens, softmax_scale=self.softmax_scale, causal=True,
                              check_values=False)  # MLACache keeps them valid; no host sync per step
        # W_UV after attention: (H, B*S, r) @ (H, r, v) -> (B, S, H, v)
        ol = o_lat.to(w_uv_t.dtype).permute(2, 0, 1, 3).reshape(H, B * S, self.kv_lora_rank)
        o = torch.bmm(ol, w_uv_t).view(H, B, S, self.v_head_dim).permute(1, 2, 0, 3)
        return o.to(q_nope.dtype)
