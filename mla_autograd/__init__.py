"""mla_autograd: fused attention for DeepSeek-style Multi-head Latent Attention (MLA).

Public API:
    attention(q, k, v, *, causal, causal_align, softmax_scale, deterministic, return_lse)
    attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, ...)
    mla_attention(q_nope, q_pe, k_nope, k_pe, v, ...) / mla_attention_varlen(...): MLA's split query/key
    mla_attention_packed(q, kv, k_pe, ...) / mla_attention_packed_varlen(...): the same on [q_nope | q_pe] and
        [k_nope | v] as MLA's projections produce them (gradients come back whole)
    decode(q_nope, q_pe, ckv_cache, kpe_cache, block_table, cache_seqlens, *, softmax_scale, ..., schedule)
    decode_schedule(cache_seqlens, *, seqlen_q, num_heads) -> DecodeSchedule: plan once per decode step
    explain(q, k, v, ...) / explain_mla(...) / explain_decode(...): which backend serves a call, and why
    mla_autograd.nn.MultiHeadLatentAttention: the layer
    mla_autograd.reference: the pure-PyTorch path
    mla_autograd.distributed: context parallelism (ring attention over a sharded sequence)
"""
from . import _ops  # noqa: F401  (registers torch.ops.mla_autograd.*)
from . import reference
from .functional import (attention, attention_varlen, decode, decode_schedule, explain, explain_decode, explain_mla,
                         mla_attention, mla_attention_packed, mla_attention_packed_varlen, mla_attention_varlen)
from .schedule import DecodeSchedule

__version__ = "0.1.0"
__all__ = ["attention", "attention_varlen", "mla_attention", "mla_attention_varlen", "mla_attention_packed",
           "mla_attention_packed_varlen", "decode", "decode_schedule",
           "DecodeSchedule", "explain", "explain_mla", "explain_decode", "reference", "nn", "distributed"]


def __getattr__(name):
    if name in ("nn", "distributed"):  # imported lazily: they pull in more than the ops need
        import importlib
        return importlib.import_module("." + name, __name__)
    raise AttributeError(f"module 'mla_autograd' has no attribute {name!r}")
