"""Hugging Face transformers models on mla_autograd's attention, with one argument.

    from mla_autograd.integrations.transformers import register
    name = register()                                    # "mla_autograd"
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation=name)   # or from_pretrained(...)

`register` adds two functions to transformers under one name: an attention function
(``AttentionInterface``) that every attention layer of the model calls instead of SDPA / eager, and
a mask function (``AttentionMaskInterface``) that the model's ``create_causal_mask`` calls once per
forward pass to describe the mask to it. Without a mask function of its own, transformers would hand
an unknown implementation no mask at all (it assumes a TGI/vLLM-style backend), so padding and
packing would be silently dropped.

What the attention function receives (transformers' layout): query (B, Hq, Sq, Dqk), key (B, Hkv, Sk,
Dqk), value (B, Hkv, Sk, Dv), all possibly non-contiguous views; ``scaling``; ``dropout``; and the
model's keyword arguments (``position_ids``, ``cu_seq_lens_q/k``, ``max_length_q/k``, ``is_causal``,
``sliding_window``, ``softcap``, ...). It returns (out (B, Sq, Hq, Dv), None): transformers then
reshapes out to (B, Sq, Hq * Dv). Value keeps its own head dim (128 for DeepSeek), which is why the
name must not contain "flash": transformers gives implementations so named FlashAttention's
treatment (value padded to the query head dim, flash-attn packages imported and checked).

How the mask reaches the attention function (``attention_mask`` argument), decided once per forward
by `mask_function`:
  - None: plain causal attention (no padding, no packing; a decode step or a prefill with a
    DynamicCache included). -> `mla_autograd.attention(..., causal=True, causal_align="bottom_right")`:
    the Sq queries are the last Sq of the Sk key positions.
  - a (B, L) bool padding mask (True = real token; L = the cache's filled length, <= Sk): padded batches.
    -> each row is reordered (real tokens first, by a stable sort: no host sync, static shapes) and
    the batch runs as `attention_varlen` over 2B segments (each row's real tokens, then its padding),
    bottom-right causal per segment, which is exactly the causal-and-padding mask for any padding
    pattern; padded query rows return 0 (as FlashAttention's padded path does).
  - a `PackedSequences` (documents packed into rows, found by transformers from position_ids that
    restart per document, which it looks for only without a cache): cu_seqlens and the longest document
    are computed once in the mask function (one device-to-host copy of two integers per forward) ->
    `attention_varlen`, causal per document. With a cache (the config's default use_cache=True, in
    training too) transformers does not look; then, as flash implementations do, a single row's
    position_ids are read by the first layer (once per forward, reused by the others).
  - a 4D mask (a custom mask passed by the caller, or a mask function this module does not recognise:
    sliding window, chunked, bidirectional, or/and overlays): the call runs on the plain-PyTorch
    explicit-mask path below, with one warning (an error with MLA_AUTOGRAD_STRICT=1).
If the caller passes ``cu_seq_lens_q/k`` (and ``max_length_q/k``), as DataCollatorWithFlattening(
return_flash_attn_kwargs=True) does, those are used directly: no host sync at all.

Settings no kernel serves (sliding_window, softcap, attention dropout while training) run on the
explicit-mask path with the package's one warning per reason, or raise NotImplementedError naming the
setting when MLA_AUTOGRAD_STRICT=1 (as the dispatch table does for shapes without a kernel, which the
ops themselves report: head dims, dtypes, devices). Attention sinks (``s_aux``) and ``position_bias``
always raise.
"""
from __future__ import annotations

import os
import warnings
import weakref

import torch
import torch.nn.functional as F
from torch import Tensor

import transformers
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface, causal_mask_function, sdpa_mask

from .. import functional as _functional

__all__ = ["register", "attention_forward", "mask_function", "PackedSequences", "DEFAULT_NAME"]

DEFAULT_NAME = "mla_autograd"

# Substrings of an implementation name that make transformers treat it as one of its own families.
_RESERVED_SUBSTRINGS = {
    "flash": "transformers treats every implementation whose name contains 'flash' as FlashAttention "
             "(pads value to the query head dim, imports and checks flash-attn kernels)",
    "sdpa": "transformers runs its SDPA availability checks on names containing 'sdpa'",
    "flex_attention": "transformers runs its FlexAttention checks on names containing 'flex_attention'",
    "paged|": "transformers strips or special-cases the 'paged|' prefix",
}


def register(name: str = DEFAULT_NAME) -> str:
    """Register mla_autograd's attention with transformers under ``name`` and return the name.

    Afterwards ``AutoModelForCausalLM.from_config(cfg, attn_implementation=name)`` (or
    ``from_pretrained(..., attn_implementation=name)``, or ``model.set_attn_implementation(name)``)
    runs every attention layer on `mla_autograd.attention` / `attention_varlen`. Registering the same
    name again is a no-op.

    Args:
        name: the implementation name (str). It must not contain "flash", "sdpa", "flex_attention" or
            "paged|", nor "/" or ":" (hub kernel names), and must not be "eager": transformers gives
            those names its own treatment.

    Raises:
        TypeError / ValueError naming ``name`` when it is unusable.
    """
    if not isinstance(name, str):
        raise TypeError(f"name must be a str, got {type(name).__name__}")
    if not name or name != name.strip():
        raise ValueError(f"name must be a non-empty string without surrounding spaces, got {name!r}")
    low = name.lower()
    for sub, why in _RESERVED_SUBSTRINGS.items():
        if sub in low:
            raise ValueError(f"name {name!r} contains {sub!r}: {why}; pick another name (default {DEFAULT_NAME!r})")
    if "/" in name or ":" in name:
        raise ValueError(f"name {name!r} contains '/' or ':', which transformers reads as a Hub kernel repository")
    if name == "eager":
        raise ValueError("name 'eager' is transformers' built-in eager attention; pick another name")
    existing = AttentionInterface._global_mapping.get(name)
    if existing is not None and existing is not attention_forward:
        raise ValueError(f"name {name!r} is already registered in transformers' AttentionInterface by another "
                         f"implementation ({getattr(existing, '__module__', '?')}); pick another name")
    AttentionInterface.register(name, attention_forward)
    AttentionMaskInterface.register(name, mask_function)
    return name


# --------------------------------------------------------------------------- mask function

class PackedSequences:
    """Documents packed into the rows of a batch, as `mask_function` hands them to `attention_forward`.

    Attributes:
        cu_seqlens: int32 (N + 1,) on the model's device: document boundaries in the flattened (B * S)
            token order, starting at 0 and ending at B * S (N documents over all rows); None when the
            position_ids were read and every row holds one document (plain causal attention).
        max_seqlen: Python int, the longest document (0 with cu_seqlens None).
        doc_ids: (B, S) integer document index of every token (restarting per row); used only by the
            explicit-mask path.
    """

    __slots__ = ("cu_seqlens", "max_seqlen", "doc_ids")

    def __init__(self, cu_seqlens: Tensor | None, max_seqlen: int, doc_ids: Tensor):
        self.cu_seqlens, self.max_seqlen, self.doc_ids = cu_seqlens, max_seqlen, doc_ids

    def __repr__(self) -> str:
        if self.cu_seqlens is None:
            return "PackedSequences(one document per row)"
        return f"PackedSequences(documents={self.cu_seqlens.numel() - 1}, max_seqlen={self.max_seqlen})"


def _free_vars(fn) -> dict:
    code, cells = getattr(fn, "__code__", None), getattr(fn, "__closure__", None)
    if code is None or not cells:
        return {}
    return {n: c.cell_contents for n, c in zip(code.co_freevars, cells)}


def _leaves(fn) -> list:
    # and_masks(f, g, ...) returns a closure "and_mask" over its functions: flatten it to the functions it
    # intersects. Closures are told apart by their code name and free variables (what dynamo can read too).
    code = getattr(fn, "__code__", None)
    if code is not None and code.co_name == "and_mask":
        out = []
        for f in _free_vars(fn).get("mask_functions", ()):
            out.extend(_leaves(f))
        return out
    return [fn]


def _classify(mask_fn):
    """("causal", None), ("packed", doc_ids (B, S)) or (None, None) for anything else.

    create_causal_mask builds the packed mask as and_masks(remap_positions_for_packed_sequence(causal,
    position_ids), packed_sequence_mask_function(doc_ids)); anything else (sliding windows, chunks,
    or/and overlays, bidirectional) is not recognised and gets an explicit mask.
    """
    if mask_fn is causal_mask_function:
        return "causal", None
    leaves = _leaves(mask_fn)
    if len(leaves) != 2:
        return None, None
    doc_ids, remapped_causal = None, False
    for f in leaves:
        fv = _free_vars(f)
        if set(fv) == {"packed_sequence_mask"} and isinstance(fv["packed_sequence_mask"], Tensor):
            doc_ids = fv["packed_sequence_mask"]
        elif set(fv) == {"mask_function", "position_ids"} and fv["mask_function"] is causal_mask_function:
            remapped_causal = True
    if doc_ids is not None and remapped_causal and doc_ids.dim() == 2:
        return "packed", doc_ids
    return None, None


def _tracing() -> bool:
    return torch.compiler.is_compiling() or torch.jit.is_tracing()


def _packed_from_doc_ids(doc_ids: Tensor) -> PackedSequences:
    """PackedSequences for (B, S) document ids (a new document wherever the id changes, and at every
    row start); its cu_seqlens is None when every row is one document.

    The boundaries are found on the device; the document count and the longest document come to the
    host in one copy (max_seqlen sizes the kernel grid, so it must be a Python int).
    """
    b, s = doc_ids.shape
    t = b * s
    starts = torch.ones_like(doc_ids, dtype=torch.bool)
    if s > 1:
        starts[:, 1:] = doc_ids[:, 1:] != doc_ids[:, :-1]
    flat = starts.reshape(-1)
    idx = torch.arange(t, device=doc_ids.device)
    # Start offsets in ascending order, then t for every non-start: the first n + 1 entries are cu_seqlens.
    bounds = torch.sort(torch.where(flat, idx, t)).values
    bounds = torch.cat([bounds, bounds.new_full((1,), t)])
    n, longest = torch.stack([flat.sum(), (bounds[1:] - bounds[:-1]).max()]).tolist()
    if n == b:
        return PackedSequences(None, 0, doc_ids)
    return PackedSequences(bounds[: n + 1].to(torch.int32), int(longest), doc_ids)


def _doc_ids_from_position_ids(position_ids: Tensor) -> Tensor:
    # transformers' convention (find_packed_sequence_indices): a document starts wherever the position
    # does not follow the previous one by 1.
    step = position_ids[:, 1:] - position_ids[:, :-1]
    return F.pad((step != 1).cumsum(-1), (1, 0))


_position_ids_seen: list = [None]  # (weakref to position_ids, its version, PackedSequences): the last forward's


def _packed_from_position_ids(position_ids: Tensor) -> PackedSequences:
    """PackedSequences from (1, S) position_ids, computed once per forward pass: every layer receives
    the same position_ids tensor, so the result (and its one host copy) is reused across layers. An
    inference tensor (made under torch.inference_mode) has no version counter that would tell an in-place
    change: each layer computes it again (one host copy per layer)."""
    if _tracing() or position_ids.is_inference():
        return _packed_from_doc_ids(_doc_ids_from_position_ids(position_ids))
    seen = _position_ids_seen[0]
    if seen is not None and seen[0]() is position_ids and seen[1] == position_ids._version:
        return seen[2]
    p = _packed_from_doc_ids(_doc_ids_from_position_ids(position_ids))
    _position_ids_seen[0] = (weakref.ref(position_ids), position_ids._version, p)
    return p


def mask_function(batch_size: int, q_length: int, kv_length: int, q_offset=0, kv_offset=0,
                  mask_function=causal_mask_function, attention_mask: Tensor | None = None, **kwargs):
    """The mask for `attention_forward`, called by transformers' create_causal_mask once per forward.

    Args (transformers' mask-interface signature):
        batch_size, q_length, kv_length: B, Sq and Sk of the attention calls.
        q_offset: the first query's position in the key sequence (the cache length; an int, or a
            0-dim tensor for static caches); kv_offset: the first key's position (0 for full attention).
        mask_function: transformers' description of the pattern (causal, or causal within packed
            documents, or anything else).
        attention_mask: (B, L) bool padding mask (True = real token), L = tokens seen so far, or None.
        kwargs: use_vmap, device, ... (forwarded to transformers' sdpa_mask when an explicit mask is built).

    Returns:
        None (plain causal), a (B, L) bool padding mask with L <= kv_length covering the tokens written
        so far (queries are its last q_length positions), a PackedSequences, or a (B, 1, Sq, Sk) bool
        mask for patterns the kernels cannot express (served by the explicit-mask path).
    """
    kind, doc_ids = _classify(mask_function)
    if kind is not None and isinstance(kv_offset, int) and kv_offset == 0:
        if kind == "packed":
            if attention_mask is None:
                return _packed_from_doc_ids(doc_ids)  # cu_seqlens None: looked, one document per row
        elif attention_mask is not None:
            if attention_mask.dim() == 2 and q_length <= attention_mask.shape[-1] <= kv_length:
                m = attention_mask.to(torch.bool)
                if m.shape[-1] == kv_length and not _tracing() and bool(m.all()):
                    return None  # nothing padded: plain causal
                return m
        elif isinstance(q_offset, int) and not isinstance(q_offset, bool) and q_offset + q_length == kv_length:
            return None
        elif not _tracing():
            # A static cache without a padding mask: the filled part of the cache is the padding-free mask.
            filled = int(q_offset) + q_length
            if q_length <= filled <= kv_length:
                return torch.ones(batch_size, filled, dtype=torch.bool, device=kwargs.get("device", "cpu"))
    return sdpa_mask(batch_size=batch_size, q_length=q_length, kv_length=kv_length, q_offset=q_offset,
                     kv_offset=kv_offset, mask_function=mask_function, attention_mask=attention_mask,
                     allow_is_causal_skip=False, use_vmap=kwargs.get("use_vmap", False),
                     device=kwargs.get("device", "cpu"))


# --------------------------------------------------------------------------- attention function

_warned: set[str] = set()


def _strict() -> bool:
    return os.environ.get("MLA_AUTOGRAD_STRICT", "0") not in ("", "0")


def _fallback(reason: str) -> None:
    """Announce (once per reason) that a call runs on the explicit-mask path; raise under strict mode."""
    msg = (f"mla_autograd transformers attention: {reason} is not served by mla_autograd's attention ops; "
           f"these calls run on a plain-PyTorch explicit-mask path (eager attention's numerics)")
    if _strict():
        raise NotImplementedError(msg + " (MLA_AUTOGRAD_STRICT=1 forbids the fallback)")
    if msg not in _warned:
        _warned.add(msg)
        warnings.warn(msg, stacklevel=3)


def _int_length(name: str, v) -> int:
    if isinstance(v, Tensor):
        v = v.item()  # the kernels size their grids with it: it must be a host value
    if isinstance(v, bool) or not isinstance(v, int):
        raise TypeError(f"{name} must be an int (or a one-element tensor), got {type(v).__name__}")
    return v


def attention_forward(module: torch.nn.Module, query: Tensor, key: Tensor, value: Tensor,
                      attention_mask, dropout: float = 0.0, scaling: float | None = None,
                      is_causal: bool | None = None, sliding_window: int | None = None,
                      softcap: float | None = None, **kwargs):
    """transformers attention function running on `mla_autograd.attention` / `attention_varlen`.

    Args:
        module: the calling attention layer (its ``is_causal`` and ``training`` are read).
        query: (B, Hq, Sq, Dqk); key: (B, Hkv, Sk, Dqk); value: (B, Hkv, Sk, Dv); one dtype and device;
            Hq a multiple of Hkv (GQA/MQA). Views are fine (last-dim stride 1 is all the ops need).
        attention_mask: what `mask_function` returned (None, (B, L) bool, PackedSequences, or a 4D
            (B, 1|Hq, Sq, Sk) bool/additive float mask).
        dropout: attention dropout probability (only applied while ``module.training``).
        scaling: softmax scale (default 1/sqrt(Dqk)).
        is_causal: overrides ``module.is_causal`` (default True).
        sliding_window, softcap: not served by the kernels (explicit-mask path, or an error under strict).
        kwargs: ``cu_seq_lens_q``/``cu_seq_lens_k`` (B'+1,) int and ``max_length_q``/``max_length_k``
            int for padding-free batches (B == 1 rows of flattened documents); ``s_aux`` and
            ``position_bias`` raise; ``position_ids`` and the rest are ignored (the mask function
            already turned them into the mask).

    Returns:
        (out (B, Sq, Hq, Dv) in query's dtype, None): attention weights are never materialised.
    """
    if kwargs.get("s_aux") is not None:
        raise NotImplementedError("mla_autograd transformers attention: attention sinks (s_aux) are not supported; "
                                  "use attn_implementation='eager' or a flash implementation that has them")
    if kwargs.get("position_bias") is not None:
        raise NotImplementedError("mla_autograd transformers attention: position_bias is not supported; "
                                  "use attn_implementation='eager' or 'sdpa'")
    if kwargs.get("output_attentions", False):
        msg = "mla_autograd transformers attention does not return attention weights (output_attentions=True)"
        if msg not in _warned:
            _warned.add(msg)
            warnings.warn(msg, stacklevel=2)
    causal = bool(is_causal if is_causal is not None else getattr(module, "is_causal", True))
    training = bool(getattr(module, "training", False))
    if not isinstance(query, Tensor) or query.dim() != 4:
        raise ValueError(f"query must be a (batch, heads, seq, head_dim) tensor, got "
                         f"{tuple(query.shape) if isinstance(query, Tensor) else type(query).__name__}")
    b, _, sq, _ = query.shape
    q, k, v = query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2)  # (B, S, H, D) views

    unsupported = []
    if sliding_window is not None:
        unsupported.append(f"sliding_window={sliding_window}")
    if softcap is not None:
        unsupported.append(f"softcap={softcap}")
    if dropout and training:
        unsupported.append(f"attention dropout {dropout} while training")

    cu_q, cu_k = kwargs.get("cu_seq_lens_q"), kwargs.get("cu_seq_lens_k")
    if cu_q is not None or cu_k is not None:
        if unsupported:
            raise NotImplementedError(f"mla_autograd transformers attention: {', '.join(unsupported)} with "
                                      f"cu_seq_lens_q/k (padding-free batches) is not supported")
        if attention_mask is not None and not isinstance(attention_mask, PackedSequences):
            raise ValueError("mla_autograd transformers attention: got both cu_seq_lens_q/k (a padding-free batch) "
                             "and a padding attention mask; pass one or the other")
        return _varlen_from_kwargs(q, k, v, cu_q, cu_k, kwargs, causal, scaling), None

    position_ids = kwargs.get("position_ids")
    if (attention_mask is None and b == 1 and sq > 1 and k.shape[1] == sq and isinstance(position_ids, Tensor)
            and position_ids.numel() == sq):
        # Padding-free packing as flash implementations take it: one row of documents whose
        # position_ids restart (transformers' own mask does not look for it when a cache is passed).
        attention_mask = _packed_from_position_ids(position_ids.reshape(1, sq))

    if isinstance(attention_mask, PackedSequences) and attention_mask.cu_seqlens is None:
        attention_mask = None  # position_ids were read: one document per row

    if unsupported:
        _fallback(", ".join(unsupported))
        return _explicit_attention(query, key, value, attention_mask, scaling, causal, dropout if training else 0.0,
                                   softcap, sliding_window), None

    if attention_mask is None:
        out = _functional.attention(q, k, v, causal=causal, causal_align="bottom_right", softmax_scale=scaling)
        return out, None

    if isinstance(attention_mask, PackedSequences):
        p = attention_mask
        if k.shape[1] != sq:
            raise ValueError(f"packed sequences need as many keys as queries (got Sq={sq}, Sk={k.shape[1]})")
        out = _functional.attention_varlen(_flat(q), _flat(k), _flat(v), p.cu_seqlens, p.cu_seqlens, p.max_seqlen,
                                           p.max_seqlen, causal=causal, causal_align="bottom_right",
                                           softmax_scale=scaling)
        return out.view(b, sq, *out.shape[1:]), None

    if isinstance(attention_mask, Tensor) and attention_mask.dim() == 2:
        return _padded_attention(q, k, v, attention_mask, causal, scaling), None

    if isinstance(attention_mask, Tensor) and attention_mask.dim() == 4:
        _fallback("a 4D attention mask (a custom mask, or a mask pattern other than causal with padding or packing)")
        return _explicit_attention(query, key, value, attention_mask, scaling, causal, 0.0, None, None), None

    got = tuple(attention_mask.shape) if isinstance(attention_mask, Tensor) else type(attention_mask).__name__
    raise ValueError(f"mla_autograd transformers attention: attention_mask must be None, a (batch, seq) padding mask, "
                     f"a 4D mask or PackedSequences, got {got}")


def _flat(x: Tensor) -> Tensor:
    return x.reshape(-1, *x.shape[2:])


def _varlen_from_kwargs(q, k, v, cu_q, cu_k, kwargs, causal, scaling):
    # Padding-free batch as DataCollatorWithFlattening(return_flash_attn_kwargs=True) passes it:
    # rows of flattened documents, boundaries in the flattened (B * S) token order.
    if cu_q is None or cu_k is None:
        raise ValueError("mla_autograd transformers attention: cu_seq_lens_q and cu_seq_lens_k must be given together")
    for n, cu in (("cu_seq_lens_q", cu_q), ("cu_seq_lens_k", cu_k)):
        if not isinstance(cu, Tensor) or cu.dim() != 1:
            raise ValueError(f"{n} must be a 1-D tensor of cumulative sequence lengths")
    cu_q = cu_q.to(device=q.device, dtype=torch.int32)
    cu_k = cu_k.to(device=q.device, dtype=torch.int32)
    mq, mk = kwargs.get("max_length_q"), kwargs.get("max_length_k")
    if mq is None or mk is None:
        # Not given: the longest sequence must be read on the host (one copy of two integers).
        lq, lk = torch.stack([(cu_q[1:] - cu_q[:-1]).max(), (cu_k[1:] - cu_k[:-1]).max()]).tolist()
        mq = lq if mq is None else mq
        mk = lk if mk is None else mk
    mq, mk = _int_length("max_length_q", mq), _int_length("max_length_k", mk)
    b, sq = q.shape[:2]
    out = _functional.attention_varlen(_flat(q), _flat(k), _flat(v), cu_q, cu_k, mq, mk, causal=causal,
                                       causal_align="bottom_right", softmax_scale=scaling)
    return out.view(b, sq, *out.shape[1:])


def _segments(real: Tensor):
    """For a (B, L) bool mask of real tokens: the per-row permutation (B, L) that moves the real tokens
    first, in order (a stable sort: static shapes, no host sync), and int32 cu_seqlens over 2B segments
    (each row's real tokens, then its padding)."""
    b, length = real.shape
    order = torch.sort((~real).to(torch.int8), dim=1, stable=True).indices
    n = real.sum(dim=1, dtype=torch.int32)
    lens = torch.stack([n, length - n], dim=1).reshape(-1)
    return order, F.pad(torch.cumsum(lens, 0, dtype=torch.int32), (1, 0))


def _gather_rows(x: Tensor, order: Tensor) -> Tensor:
    # x (B, L, H, D) -> (B * L, H, D), row b reordered by order[b]
    rows = torch.arange(x.shape[0], device=x.device)[:, None]
    return x[rows, order].reshape(-1, *x.shape[2:])


def _padded_attention(q, k, v, mask, causal, scaling):
    """Causal attention with a (B, L) padding mask, as varlen over each row's real tokens.

    Queries are the last Sq of the L key positions (L = tokens seen so far; a static cache's unused
    tail, beyond L, is cut off). After moving every row's real tokens first (order kept), a real query
    of rank r among the row's n_q real queries must see the real keys of rank <= r + n_k - n_q: that
    is bottom-right causal attention within the segment, for any padding pattern. The padding tokens
    form a segment of their own whose outputs are discarded (set to 0); it costs what the padding
    would cost in a dense call.
    """
    b, sq = q.shape[:2]
    length = mask.shape[-1]
    if mask.shape[0] != b or not sq <= length <= k.shape[1]:
        raise ValueError(f"attention_mask of shape {tuple(mask.shape)} does not fit queries (B={b}, Sq={sq}) and "
                         f"keys (Sk={k.shape[1]}): need (B, L) with Sq <= L <= Sk")
    real_k = mask.to(device=q.device, dtype=torch.bool)
    real_q = real_k[:, length - sq:]
    order_k, cu_k = _segments(real_k)
    order_q, cu_q = _segments(real_q)
    out = _functional.attention_varlen(_gather_rows(q, order_q), _gather_rows(k[:, :length], order_k),
                                       _gather_rows(v[:, :length], order_k), cu_q, cu_k, sq, length,
                                       causal=causal, causal_align="bottom_right", softmax_scale=scaling)
    inverse = torch.argsort(order_q, dim=1)
    out = _gather_rows(out.view(b, sq, *out.shape[1:]), inverse).view(b, sq, *out.shape[1:])
    return out.masked_fill(~real_q[:, :, None, None], 0)


def _explicit_attention(query, key, value, attention_mask, scaling, causal, dropout, softcap, sliding_window):
    """Plain-PyTorch attention with an explicit mask and eager attention's numerics, for settings the
    ops do not serve. query (B, Hq, Sq, D), key (B, Hkv, Sk, D), value (B, Hkv, Sk, Dv) -> (B, Sq, Hq, Dv)."""
    b, hq, sq, d = query.shape
    rep = hq // key.shape[1]
    if rep > 1:
        key, value = key.repeat_interleave(rep, dim=1), value.repeat_interleave(rep, dim=1)
    scale = (1.0 / d ** 0.5) if scaling is None else scaling
    sk = key.shape[2]
    additive = None
    visible = None
    if isinstance(attention_mask, PackedSequences):
        doc = attention_mask.doc_ids.to(query.device)
        visible = (doc[:, None, :, None] == doc[:, None, None, :])
    elif isinstance(attention_mask, Tensor) and attention_mask.dim() == 2:
        length = attention_mask.shape[-1]
        key, value, sk = key[:, :, :length], value[:, :, :length], length
        visible = attention_mask.to(device=query.device, dtype=torch.bool)[:, None, None, :]
    elif isinstance(attention_mask, Tensor) and attention_mask.dim() == 4:
        if attention_mask.dtype == torch.bool:
            visible = attention_mask
        else:
            additive = attention_mask[..., :sk]
        causal, sliding_window = False, None  # a 4D mask is the whole pattern
    i = torch.arange(sq, device=query.device)[:, None] + (sk - sq)  # bottom-right: queries are the last Sq
    j = torch.arange(sk, device=query.device)[None, :]
    pattern = torch.ones(sq, sk, dtype=torch.bool, device=query.device)
    if causal:
        pattern &= j <= i
    if sliding_window is not None:
        pattern &= j > i - sliding_window
    visible = pattern if visible is None else (visible & pattern)
    s = torch.matmul(query, key.transpose(2, 3)) * scale
    if softcap is not None:
        s = torch.tanh(s / softcap) * softcap
    if additive is not None:
        s = s + additive
    s = s.masked_fill(~visible, torch.finfo(s.dtype).min)
    # softmax in float32 as eager attention does (float64 stays float64)
    p = torch.softmax(s, dim=-1, dtype=torch.promote_types(s.dtype, torch.float32)).to(query.dtype)
    if dropout:
        p = F.dropout(p, p=dropout, training=True)
    return torch.matmul(p, value).transpose(1, 2).contiguous()


# transformers version this module was written against (its mask-interface and kwargs conventions).
TESTED_TRANSFORMERS = "5.24.0"
if transformers.__version__.split("+")[0] != TESTED_TRANSFORMERS:  # pragma: no cover
    warnings.warn(f"mla_autograd.integrations.transformers is tested with transformers {TESTED_TRANSFORMERS}, "
                  f"found {transformers.__version__}; mask patterns it does not recognise run on the explicit-mask "
                  f"path", stacklevel=2)
