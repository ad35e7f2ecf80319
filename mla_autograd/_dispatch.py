"""The one dispatch table: which backend serves which (arch, dtype, head dims, features).

Rows are tried in order; the first whose conditions all hold serves the call. The pure-PyTorch
reference is the last row of every op and accepts anything, except mla_fwd's and mla_bwd's (MLA's split query and
key read in place), whose last rows concatenate them and hand the call to attn_fwd's / attn_bwd's rows (HANDED_ON). What a kernel family serves (compute
capabilities, dtypes, head dims) is read from the family registry (``_kernels.FAMILIES``); a row adds
only the conditions specific to it. ``explain`` reports the chosen row and why every earlier row was
passed over, so a user can see which path will run and why.

Environment:
  MLA_AUTOGRAD_BACKEND=reference   always use the reference path.
  MLA_AUTOGRAD_STRICT=1            raise instead of falling back to the reference path.
"""
from __future__ import annotations

import dataclasses
import functools
import operator
import os
import sys
import threading
import warnings
from typing import Callable

import torch

from . import _build
from ._kernels import FAMILIES, MLA_OPS

__all__ = ["Call", "Route", "Decision", "TABLE", "ROUTE_FIELDS", "select", "explain_call"]

# The Call fields the rows of each op read: every kernel row (Route.rejects) reads device (through
# Call.capability / smem_per_block), dtype and dims; the rest are its check's. A decision is a function of
# these alone, so select's memo is keyed on them (Call.route_key) and does not grow with anything else a
# call carries. tests/test_dispatch.py fails if a row reads a field missing here, or if one here is unread.
_EVERY_KERNEL_ROW = ("device", "dtype", "dims")
ROUTE_FIELDS: dict[str, tuple[str, ...]] = {
    "attn_fwd": _EVERY_KERNEL_ROW + ("out_rows_over_int32",),
    "attn_bwd": _EVERY_KERNEL_ROW + ("deterministic", "causal", "bottom_right", "seqlens_equal"),
    "mla_fwd": _EVERY_KERNEL_ROW,
    "mla_bwd": _EVERY_KERNEL_ROW,
    "decode": _EVERY_KERNEL_ROW + ("num_heads", "seqlen_q", "page_size"),
}
_ROUTE_GETTERS = {op: operator.attrgetter(*fields) for op, fields in ROUTE_FIELDS.items()}
# Ops whose last row is no reference path but another op: a call no kernel row of "mla_fwd" ("mla_bwd") serves is
# concatenated and handed to attn_fwd's (attn_bwd's) rows, which choose (and announce a fallback) for it.
HANDED_ON: dict[str, str] = {"mla_fwd": "attn_fwd", "mla_bwd": "attn_bwd"}


@dataclasses.dataclass(frozen=True)
class Call:
    """What a dispatch decision is made from: metadata only (no tensor values are read). The rows of an op
    read the fields ROUTE_FIELDS names for it; the others describe the call (varlen names the kind of call
    in the fallback warning)."""

    op: str                       # "attn_fwd", "attn_bwd", "mla_fwd", "mla_bwd" or "decode"
    device: torch.device
    dtype: torch.dtype
    dims: tuple[int, ...]         # (Dqk, Dv) for attention; (Dn, Dr, Dv) for mla_fwd / mla_bwd; (Dc, Dr) for decode
    causal: bool = False
    bottom_right: bool = True     # attention: the causal alignment
    varlen: bool = False
    num_heads: int = 0            # query heads
    num_kv_heads: int = 0
    seqlen_q: int = 0             # decode only: new tokens per request
    page_size: int = 0            # decode only
    deterministic: bool = False
    # attention: every sequence has as many queries as keys, known from metadata alone (dense Sq == Sk, or
    # varlen with one cu_seqlens tensor for queries and keys); both causal alignments then coincide
    seqlens_equal: bool = True
    # attention: max_seqlen_q * Hq * Dv >= 2^31 (an int32 offset in the SM100 forward's epilogue overflows)
    out_rows_over_int32: bool = False

    def route_key(self) -> tuple:
        """The op and the fields its rows read (ROUTE_FIELDS): calls with equal keys get the same decision."""
        return self.op, _ROUTE_GETTERS[self.op](self)

    @property
    def capability(self) -> tuple[int, int] | None:
        if self.device.type != "cuda":
            return None
        index = self.device.index if self.device.index is not None else torch.cuda.current_device()
        return _capability(index)

    @property
    def smem_per_block(self) -> int:
        """The device's opt-in shared memory per block, in bytes (0 off CUDA)."""
        if self.device.type != "cuda":
            return 0
        index = self.device.index if self.device.index is not None else torch.cuda.current_device()
        return _smem_per_block(index)


@functools.lru_cache(maxsize=None)
def _capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


@functools.lru_cache(maxsize=None)
def _smem_per_block(index: int) -> int:
    return int(torch.cuda.get_device_properties(index).shared_memory_per_block_optin)


@dataclasses.dataclass(frozen=True)
class Route:
    """One row of the table.

    op: which op it serves; backend: short name; family: kernel family (None = the reference path, or for a
    HANDED_ON op the op it hands the call to).
    The compute capabilities, dtypes and head dims a family serves come from its registry entry: a
    capability is served exactly when the family's build has an image that loads there.
    check: further conditions, returning a reason string when the call is not served (else None).
    """

    op: str
    backend: str
    family: str | None
    check: Callable[[Call], str | None] | None = None
    note: str = ""

    def rejects(self, call: Call) -> str | None:
        """Why this row does not serve the call, or None if it does."""
        if self.family is None:
            return None
        fam = FAMILIES[self.family]
        cap = call.capability
        if cap is None:
            return f"tensors are on {call.device.type}, kernels need CUDA"
        if not fam.serves(cap):
            return (f"needs compute capability {fam.capability_text()}, device has {cap[0]}.{cap[1]} "
                    f"(its build: {', '.join(fam.targets)})")
        if call.dtype not in fam.dtypes:
            return f"dtype {str(call.dtype).replace('torch.', '')} (kernels take bfloat16/float16)"
        if call.dims not in fam.dims_for(call.op):
            what = "part head dims (Dn, Dr, Dv)" if call.op in MLA_OPS else "head dims"
            return f"{what} {call.dims} not in {sorted(fam.dims_for(call.op))}"
        if self.check is not None:
            why = self.check(call)
            if why:
                return why
        ok, why = _build.family_available(self.family)
        if not ok:
            return why
        return None


def _decode_check(call: Call) -> str | None:
    if call.num_heads not in (8, 16, 32, 64, 128):
        return f"num_heads {call.num_heads} not in (8, 16, 32, 64, 128)"
    if not 1 <= call.seqlen_q <= 8:
        return f"{call.seqlen_q} new tokens per request (kernel takes 1..8)"
    ps = call.page_size
    if ps < 1 or ps > 256 or ps & (ps - 1):
        return f"page_size {ps} is not a power of two in 1..256"
    rows = call.num_heads * call.seqlen_q
    need = decode_min_smem_bytes(rows)
    if call.smem_per_block < need:
        return (f"H x Sq = {rows} query rows need {need} B of shared memory per block for the kernel's "
                f"{_decode_m_tile(rows)}-row tile, the device offers {call.smem_per_block} B")
    return None


def _decode_m_tile(rows: int) -> int:
    return 16 if rows <= 16 else (32 if rows <= 32 else 64)


def decode_min_smem_bytes(rows: int) -> int:
    """Shared memory (bytes) the decode kernel needs at its fewest pipeline stages for H x Sq = rows: the
    all-warps kernel's TileConfig<m_tile>::smem_bytes(kMinStages) plus its static slot
    (csrc/sm80/mla_decode/mla_decode_sm80_config.h). 95,360 B for 16 rows, which every 8.x part offers; 32 and 64 rows
    need more than the 99 KB of 8.6/8.9/12.0 parts."""
    m_tile, row_bytes, bn, stages = _decode_m_tile(rows), 576 * 2, 32, 2
    qk_warp_cols = min(8 // (m_tile // 16), bn // 8)
    return (m_tile * row_bytes + stages * bn * row_bytes + m_tile * (bn + 8) * 2 + 2 * qk_warp_cols * m_tile * 4
            + 10 * bn * 4 + 128)


def _sm100_fwd_check(call: Call) -> str | None:
    if call.out_rows_over_int32:
        return ("max_seqlen_q x query heads x Dv >= 2^31: CUTLASS example 77's forward epilogue offsets the "
                "output pointer by that product in int32")
    return None


def _sm100_bwd_check(call: Call) -> str | None:
    if call.deterministic:
        return "deterministic=True (its dQ is reduced across key tiles in no fixed order)"
    if call.causal and not call.bottom_right and call.dims == (192, 128) and not call.seqlens_equal:
        # CUTLASS 4.2 example 77's MLA backward (64-row Q tiles, 128-key blocks) masks only the Q tile whose
        # index equals the key block's, so tiles 2j and 2j+1 of key block j go unmasked. Its bottom-right
        # masking is right, and equals top-left where every sequence has as many queries as keys.
        return ("causal_align='top_left' with Sq != Sk at head dims (192, 128): the SM100 MLA backward kernel's "
                "top-left diagonal masking is wrong, so it runs only where bottom-right masking is the same "
                "(Sq == Sk, or one cu_seqlens tensor for queries and keys)")
    return None


TABLE: tuple[Route, ...] = (
    Route("attn_fwd", "sm100", "fmha_fwd_sm100", _sm100_fwd_check,
          note="CUTLASS example-77 tcgen05/TMEM forward (compiled, never run on hardware)"),
    Route("attn_fwd", "sm90", "fmha_fwd_sm90", note="wgmma + TMA warp-specialized forward"),
    Route("attn_fwd", "reference", None, note="pure PyTorch"),
    Route("attn_bwd", "sm100", "fmha_bwd_sm100", _sm100_bwd_check,
          note="CUTLASS example-77 tcgen05/TMEM backward (compiled, never run on hardware)"),
    Route("attn_bwd", "sm90", "fmha_bwd_sm90", note="wgmma + TMA warp-specialized backward"),
    Route("attn_bwd", "reference", None, note="pure PyTorch (explicit FlashAttention backward)"),
    Route("mla_fwd", "sm90", "fmha_fwd_sm90",
          note="the 192/128 forward reading q_nope/q_pe and k_nope/k_pe in place (two TMA descriptors per Q and "
               "K tile)"),
    Route("mla_fwd", "concat", None,
          note="q and k concatenated at the boundary; attn_fwd's rows choose the backend for (Dn + Dr, Dv)"),
    Route("mla_bwd", "sm90", "fmha_bwd_sm90",
          note="the 192/128 backward reading q_nope/q_pe and k_nope/k_pe in place and storing dK as dk_nope and dk_pe "
               "(per kv head; a shared k_pe's summed over the heads)"),
    Route("mla_bwd", "concat", None,
          note="the saved parts concatenated for attn_bwd, whose rows choose the backend for (Dn + Dr, Dv); dq / dk "
               "split back"),
    Route("decode", "sm80_decode", "mla_decode_sm80", _decode_check,
          note="mma.sync paged MLA decode; H * Sq <= 32: warp-specialized kernel (QK/softmax warps + PV warps, "
               "1 CTA/SM) where 3 of its stages fit in smem; 64-row tiles: the row-group kernel (64 KV tokens per "
               "step, two 4-warp groups of 32 rows) where it fits (sm_90); otherwise the all-warps kernel"),
    Route("decode", "reference", None, note="pure PyTorch"),
)

for _row in TABLE:  # a row may send an op only to a family that implements it
    if _row.family is not None and _row.op not in FAMILIES[_row.family].ops:
        raise AssertionError(f"dispatch row {_row.backend}: {_row.family} does not implement {_row.op}")


@dataclasses.dataclass(frozen=True)
class Decision:
    op: str
    backend: str
    family: str | None
    passed_over: tuple[tuple[str, str], ...]  # (backend, reason) of the rows tried before

    @property
    def reason(self) -> str:
        if self.family is not None:
            return f"{self.backend} kernel ({self.family})"
        if os.environ.get("MLA_AUTOGRAD_BACKEND") == "reference":
            return "MLA_AUTOGRAD_BACKEND=reference"
        return "; ".join(f"{b}: {why}" for b, why in self.passed_over) or "no kernel row for this op"

    def __str__(self) -> str:
        lines = [f"{self.op}: {self.backend}" + (f" ({self.family})" if self.family else "")]
        for b, why in self.passed_over:
            lines.append(f"  not {b}: {why}")
        return "\n".join(lines)


def explain_call(call: Call) -> Decision:
    forced = os.environ.get("MLA_AUTOGRAD_BACKEND")
    passed: list[tuple[str, str]] = []
    for row in TABLE:
        if row.op != call.op:
            continue
        if forced and row.family is not None and row.backend != forced:
            passed.append((row.backend, f"MLA_AUTOGRAD_BACKEND={forced}"))
            continue
        why = row.rejects(call)
        if why is None:
            return Decision(call.op, row.backend, row.family, tuple(passed))
        passed.append((row.backend, why))
    raise AssertionError(f"dispatch table has no fallback row for {call.op}")  # pragma: no cover


# Reasons already announced (the set of row-rejection reasons, without the op, dtype or dims).
_warned: set[tuple[str, ...]] = set()
_decisions: dict = {}  # (call.route_key(), MLA_AUTOGRAD_BACKEND) -> (decision, its reason key, None for a kernel)

_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep
_TORCH_DIR = os.path.dirname(os.path.abspath(torch.__file__)) + os.sep
# The forward's call site while an attention backward runs (set by _autograd.FusedAttentionFunction).
_backward = threading.local()


def _internal(filename: str) -> bool:
    return filename.startswith(_PACKAGE_DIR) or filename.startswith(_TORCH_DIR)


def call_site(frame=None):
    """(filename, lineno, module globals) of the innermost frame outside mla_autograd and torch, starting
    at `frame` (default: the caller's); None when every frame is inside them (the autograd engine's
    device threads run backward functions with no Python caller)."""
    f = sys._getframe(1) if frame is None else frame
    while f is not None and _internal(f.f_code.co_filename):
        f = f.f_back
    return None if f is None else (f.f_code.co_filename, f.f_lineno, f.f_globals)


def set_backward_site(site) -> None:
    """Record (or clear, with None) the forward call site of the backward now running on this thread."""
    _backward.site = site


def _reason_key(d: Decision) -> tuple[str, ...]:
    if os.environ.get("MLA_AUTOGRAD_BACKEND") == "reference":
        return ("MLA_AUTOGRAD_BACKEND=reference",)
    return tuple(dict.fromkeys(why for _, why in d.passed_over)) or ("no kernel row for this op",)


def _fallback_message(call: Call, d: Decision) -> str:
    by_reason: dict[str, list[str]] = {}
    for backend, why in d.passed_over:
        by_reason.setdefault(why, []).append(backend)
    reason = "; ".join(f"{', '.join(b)}: {why}" for why, b in by_reason.items()) or d.reason
    return (f"mla_autograd: {call.op} on {call.device.type} ({str(call.dtype).replace('torch.', '')}, "
            f"dims {call.dims}) runs on the pure-PyTorch reference path: {reason}")


def _warn_fallback(call: Call, msg: str) -> None:
    """Issue the fallback warning at the user's line: the innermost frame outside mla_autograd and torch.
    A backward run by an autograd engine thread has no such frame: it is attributed to the forward's call
    site recorded by the autograd Function, else to the outermost frame there is."""
    msg += " (announced once per reason; mla_autograd.explain / explain_decode tell the route of a call)"
    here = sys._getframe(1)
    site = call_site(here)
    if call.op == "attn_bwd":
        kind = "varlen attention" if call.varlen else "attention"
        if site is not None:
            msg += f" (in the backward of an mla_autograd {kind} call)"
        else:
            site = getattr(_backward, "site", None)
            if site is not None:
                msg += f" (in the backward of the mla_autograd {kind} call on this line)"
            else:
                msg += (f" (in the backward of an mla_autograd {kind} call, run by the autograd engine without "
                        f"a Python caller)")
    if site is None:
        f = here
        while f.f_back is not None:
            f = f.f_back
        site = (f.f_code.co_filename, f.f_lineno, f.f_globals)
    filename, lineno, module_globals = site
    # what warnings.warn(stacklevel=...) does for a frame on the stack, for a frame found by walking
    warnings.warn_explicit(msg, UserWarning, filename, lineno, module=module_globals.get("__name__", "<string>"),
                           registry=module_globals.setdefault("__warningregistry__", {}),
                           module_globals=module_globals)


def select(call: Call) -> Decision:
    """Choose the backend for a call (memoised on Call.route_key: this runs on every op call); announce
    reference fallbacks (not the hand-over of a HANDED_ON op) once per reason (the reasons the kernel rows give, whatever the op, dtype or dims),
    at the caller's line outside mla_autograd and torch."""
    key = (call.route_key(), os.environ.get("MLA_AUTOGRAD_BACKEND"))
    entry = _decisions.get(key)
    if entry is None:
        d = explain_call(call)
        handed_on = d.family is None and call.op in HANDED_ON  # the next op's select announces any fallback
        entry = _decisions[key] = (d, None if d.family is not None or handed_on else _reason_key(d))
    d, reason = entry
    if reason is not None:
        if os.environ.get("MLA_AUTOGRAD_STRICT", "0") not in ("", "0"):
            raise RuntimeError(_fallback_message(call, d) + " (MLA_AUTOGRAD_STRICT=1 forbids the fallback)")
        if reason not in _warned:
            _warned.add(reason)
            _warn_fallback(call, _fallback_message(call, d))
    return d
