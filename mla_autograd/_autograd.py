"""The autograd Function that pairs the fused forward with the fused backward."""
from __future__ import annotations

import torch

from . import _dispatch, _ops  # _ops registers torch.ops.mla_autograd.*

__all__ = ["FusedAttentionFunction", "distinct_inputs", "record_call_site"]


def _no_double_backward(ctx, *grads):
    raise RuntimeError("mla_autograd.attention does not support double backward (differentiating "
                       "gradients taken with create_graph=True through the attention op)")


# Backward-of-backward lands on attn_bwd: give it a formula that says so plainly.
torch.library.register_autograd("mla_autograd::attn_bwd", _no_double_backward,
                                setup_context=lambda ctx, inputs, output: None)


def distinct_inputs(*tensors):
    """Under torch.compile, Dynamo refuses an autograd.Function given the same tensor for several inputs
    (self-attention written attention(x, x, x), or one cu_seqlens for queries and keys); a view of it is a
    distinct input with the same data, and gradients flow back the same way. Outside compile, and for
    None, the inputs pass through unchanged."""
    if not torch.compiler.is_compiling():
        return tensors
    out = []
    for t in tensors:
        if t is not None and any(t is u for u in out):
            t = t.view_as(t)
        out.append(t)
    return tuple(out)


def record_call_site(q, k, v):
    """The caller's line outside mla_autograd and torch (one short walk up the stack), in eager mode when a
    backward can follow (grad enabled, an input requires grad); else None (nothing is walked)."""
    if torch.compiler.is_compiling() or not torch.is_grad_enabled():
        return None
    if not (q.requires_grad or k.requires_grad or v.requires_grad):
        return None
    return _dispatch.call_site()


class FusedAttentionFunction(torch.autograd.Function):
    """Dense or varlen attention: forward = mla_autograd::attn_fwd, backward = mla_autograd::attn_bwd.

    Saves q, k, v, out and the float32 LSE (never the attention matrix); the backward recomputes P.
    The LSE output is returned as non-differentiable, as in FlashAttention. Double backward is not
    supported and raises. call_site: where the public call was made (see record_call_site), kept for a
    reference-path warning of the backward, which the autograd engine may run on a thread with no Python
    caller.
    """

    @staticmethod
    def forward(ctx, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale,
                causal, bottom_right, deterministic, call_site=None):
        fwd = _ops._attn_fwd if _ops.eager_direct(q, k, v) else torch.ops.mla_autograd.attn_fwd
        out, lse = fwd(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal,
                       bottom_right)
        ctx.save_for_backward(q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k)
        ctx.args = (max_seqlen_q, max_seqlen_k, softmax_scale, causal, bottom_right, deterministic)
        ctx.mark_non_differentiable(lse)
        ctx.call_site = call_site
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        q, k, v, out, lse, cu_q, cu_k = ctx.saved_tensors
        max_q, max_k, scale, causal, bottom_right, deterministic = ctx.args
        # create_graph=True runs this with grad enabled: the op then raises (no double backward)
        direct = _ops.eager_direct(dout, q, k, v) and not torch.is_grad_enabled()
        bwd = _ops._attn_bwd if direct else torch.ops.mla_autograd.attn_bwd
        if torch.compiler.is_compiling():
            dq, dk, dv = bwd(dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, scale, causal, bottom_right,
                             deterministic)
        else:
            _dispatch.set_backward_site(ctx.call_site)  # where a fallback warning of this backward points
            try:
                dq, dk, dv = bwd(dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, scale, causal, bottom_right,
                                 deterministic)
            finally:
                _dispatch.set_backward_site(None)
        return dq, dk, dv, None, None, None, None, None, None, None, None, None
