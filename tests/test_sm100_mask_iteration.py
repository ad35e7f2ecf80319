"""The SM100 kernels' tile and mask iteration, transcribed on the host and checked against the mask's
definition for every (Sq, Sk) of a sweep: the backward kernels below, the forward at the end of the file.

The SM100 backward runs CUTLASS 4.2 example 77's kernels (kernel/sm100_fmha_bwd_kernel_tma_warpspecialized.hpp,
128x128 tiles, for (128, 128); kernel/sm100_fmha_bwd_mla_kernel_tma_warpspecialized.hpp, 64-row Q tiles and
128-key blocks, for (192, 128)). Each CTA owns one key block j and walks the Q tiles from `iter_start`;
a tile is masked element by element only when the kernel's predicate says so (leading causal masking,
trailing residual masking), otherwise every element of it counts. `_effective` below follows that code
line by line; the test then asserts that the mask each call is planned with gives exactly the visible
(query, key) pairs of the mask the caller asked for, and that the planner's substitution and refusals are
what the dispatch table and the C++ planner implement. No GPU and no compiler are needed.
"""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from mla_autograd import _dispatch
from mla_autograd._dispatch import Call

KERNELS = {"mha128": (128, 128), "mla": (64, 128)}  # (TileShapeQ, TileShapeK)
SIZES = [1, 5, 63, 64, 65, 127, 128, 129, 191, 192, 255, 256, 257, 300, 384, 385]


def _definition(mask: str, sq: int, sk: int) -> np.ndarray:
    """(sq, sk) bool: query i sees key j (docs/architecture.md's mask)."""
    i = np.arange(sq)[:, None]
    j = np.arange(sk)[None, :]
    if mask == "none":
        return np.ones((sq, sk), dtype=bool)
    offset = sk - sq if mask == "bottom_right" else 0
    return j <= i + offset


def _effective(kernel: str, mask: str, sq: int, sk: int) -> np.ndarray:
    """(sq, sk) bool: the pairs whose P the kernel keeps, following example 77's backward loop. Raises if an
    element outside the problem (i >= sq or j >= sk, rows or keys of the next packed sequence) is kept."""
    tq, tk = KERNELS[kernel]
    mla = kernel == "mla"
    keep = np.zeros((sq, sk), dtype=bool)
    offset = sk - sq
    for blk in range(math.ceil(sk / tk)):
        iter_end = math.ceil(sq / tq)
        if mask == "top_left":
            iter_start = (blk * tk) // tq
        elif mask == "bottom_right":
            iter_start = max(0, int((blk * tk - offset) / tq))  # C++ division truncates toward zero
        else:
            iter_start = 0
        # MLA kernel: "get<1>(blk_coord) * TileShapeK{} + TileShapeK{} >= K"; 128x128 kernel: "> K"
        is_residual_k = (blk * tk + tk >= sk) if mla else (blk * tk + tk > sk)
        for it in range(iter_start, iter_end):
            if mask == "top_left":
                # MLA kernel: "iter_index == get<1>(blk_coord)"; 128x128 kernel: "iter_index == iter_start"
                leading = (it == blk) if mla else (it == iter_start)
            elif mask == "bottom_right":
                kv_left, kv_right = blk * tk, blk * tk + tk - 1
                q_left = it * tq + offset
                q_right = q_left + tq - 1
                leading = not (q_left > kv_right or q_right < kv_left)
            else:
                leading = False
            trailing = it == iter_end - 1 or is_residual_k  # every backward mask derives from the residual one
            rows = np.arange(it * tq, it * tq + tq)[:, None]
            cols = np.arange(blk * tk, blk * tk + tk)[None, :]
            if leading or trailing:
                off = offset if mask == "bottom_right" else 0
                causal_hidden = (rows + off < cols) if mask != "none" else np.zeros((tq, tk), dtype=bool)
                kept = ~(causal_hidden | (rows >= sq) | (cols >= sk))
            else:
                kept = np.ones((tq, tk), dtype=bool)
            outside = kept & ((rows >= sq) | (cols >= sk))
            if outside.any():
                raise AssertionError(f"{kernel} {mask} Sq={sq} Sk={sk}: tile ({it}, {blk}) keeps elements outside "
                                     f"the problem")
            r0, c0 = it * tq, blk * tk
            keep[r0:min(r0 + tq, sq), c0:min(c0 + tk, sk)] |= kept[:min(tq, sq - r0), :min(tk, sk - c0)]
    return keep


def _planned_mask(kernel: str, mask: str, sq: int, sk: int) -> str | None:
    """What fmha_bwd_sm100's planner runs for a requested mask (None: refused, served elsewhere)."""
    if kernel == "mla" and mask == "top_left":
        return "bottom_right" if sq == sk else None
    return mask


@pytest.mark.parametrize("mask", ["none", "top_left", "bottom_right"])
@pytest.mark.parametrize("kernel", sorted(KERNELS))
def test_planned_mask_gives_the_requested_visibility(kernel, mask):
    for sq in SIZES:
        for sk in SIZES:
            planned = _planned_mask(kernel, mask, sq, sk)
            if planned is None:
                continue
            got = _effective(kernel, planned, sq, sk)
            want = _definition(mask, sq, sk)
            bad = np.argwhere(got != want)
            assert bad.size == 0, (f"{kernel} asked {mask}, runs {planned}, Sq={sq} Sk={sk}: first wrong (i, j) = "
                                   f"{tuple(bad[0])}, kernel keeps {got[tuple(bad[0])]}")


def test_the_transcription_sees_the_mla_top_left_defect():
    """Example 77's MLA backward run with its own top-left mask drops the diagonal masking of Q tiles 2j and
    2j+1 of key block j (except in the last tile/block): with Sq = Sk = 256, query 64 keeps keys 65..127."""
    got = _effective("mla", "top_left", 256, 256)
    want = _definition("top_left", 256, 256)
    assert got[64, 65] and not want[64, 65]
    assert (got != want).sum() > 0
    # and it is right where a single masked tile covers everything (one Q tile, one key block)
    assert (_effective("mla", "top_left", 64, 128) == _definition("top_left", 64, 128)).all()


def _route(sq: int, sk: int, dims, bottom_right: bool, monkeypatch) -> str:
    monkeypatch.setattr(Call, "capability", property(lambda self: (10, 0)))
    monkeypatch.setattr(_dispatch._build, "family_available", lambda name: (True, ""))
    c = Call(op="attn_bwd", device=torch.device("cuda", 0), dtype=torch.bfloat16, dims=dims, causal=True,
             bottom_right=bottom_right, num_heads=4, num_kv_heads=4, seqlens_equal=sq == sk)
    return _dispatch.explain_call(c).backend


@pytest.mark.parametrize("dims,kernel", [((192, 128), "mla"), ((128, 128), "mha128")])
@pytest.mark.parametrize("mask", ["top_left", "bottom_right"])
def test_dispatch_matches_the_planner(dims, kernel, mask, monkeypatch):
    """The dispatch table sends a call to the SM100 backward exactly when the planner runs it."""
    for sq in SIZES:
        for sk in SIZES:
            backend = _route(sq, sk, dims, mask == "bottom_right", monkeypatch)
            runs = _planned_mask(kernel, mask, sq, sk) is not None
            assert (backend == "sm100") == runs, (dims, mask, sq, sk, backend)


# ---------------------------------------------------------------- forward
# Both forward mainloops (collective/sm100_fmha_fwd_mainloop_tma_warpspecialized.hpp and the MLA one) give a
# CTA one 256-row Q tile (two 128-row softmax halves) and walk key blocks 0 .. trip_count - 1 of 128 keys;
# the last get_masked_trip_count of them are masked element by element (fmha_fusion.hpp's CausalMask /
# ResidualMask), the others count whole.
FWD_TQ, FWD_TK = 256, 128


def _fwd_trips(mask: str, b: int, sq: int, sk: int) -> tuple[int, int]:
    """(trip_count, masked_trip_count) of Q tile b, as fmha_fusion.hpp computes them."""
    n_k = math.ceil(sk / FWD_TK)
    if mask == "none":  # ResidualMask
        return n_k, 1 if sk % FWD_TK else 0
    if mask == "top_left":  # CausalMask<true>
        trip = min(n_k, math.ceil((b + 1) * FWD_TQ / FWD_TK))
        return trip, min(trip, math.ceil(FWD_TQ / FWD_TK))
    offset = sk - sq  # CausalMask<false>
    trip = min(n_k, math.ceil(((b + 1) * FWD_TQ + offset) / FWD_TK))
    corner = int(bool(sk % FWD_TK or sq % FWD_TQ))
    return trip, min(trip, math.ceil(FWD_TQ / FWD_TK) + corner)


def _effective_fwd(mask: str, sq: int, sk: int) -> np.ndarray:
    keep = np.zeros((sq, sk), dtype=bool)
    offset = sk - sq if mask == "bottom_right" else 0
    for b in range(math.ceil(sq / FWD_TQ)):
        trip, masked = _fwd_trips(mask, b, sq, sk)
        rows = np.arange(b * FWD_TQ, min(b * FWD_TQ + FWD_TQ, sq))[:, None]
        for blk in range(trip):
            cols = np.arange(blk * FWD_TK, blk * FWD_TK + FWD_TK)[None, :]
            if blk >= trip - masked:
                kept = cols < sk
                if mask != "none":
                    kept = kept & ~(rows + offset < cols)
            else:
                kept = np.ones((rows.shape[0], FWD_TK), dtype=bool)
                assert (cols < sk).all(), f"fwd {mask} Sq={sq} Sk={sk}: unmasked block {blk} reaches past Sk"
            c0 = blk * FWD_TK
            keep[rows[:, 0], c0:min(c0 + FWD_TK, sk)] |= kept[:, :min(FWD_TK, sk - c0)]
    return keep


def _fwd_planned(mask: str, sq: int, sk: int) -> np.ndarray:
    """What fmha_fwd_sm100 computes: bottom-right calls with Sq > Sk are split on the device (fwd_rewrite_cu)
    into the first Sq - Sk rows, which see no key (O = 0, LSE = -inf without a kernel pass over keys), and the
    other Sk rows, launched as an (Sk, Sk) problem; every other call is launched as it is."""
    if mask == "bottom_right" and sq > sk:
        keep = np.zeros((sq, sk), dtype=bool)
        keep[sq - sk:] = _effective_fwd(mask, sk, sk)
        return keep
    return _effective_fwd(mask, sq, sk)


FWD_SIZES = [1, 100, 127, 128, 129, 255, 256, 257, 383, 384, 511, 512, 513, 700]


@pytest.mark.parametrize("mask", ["none", "top_left", "bottom_right"])
def test_forward_iteration_gives_the_requested_visibility(mask):
    for sq in FWD_SIZES:
        for sk in FWD_SIZES:
            got, want = _fwd_planned(mask, sq, sk), _definition(mask, sq, sk)
            bad = np.argwhere(got != want)
            assert bad.size == 0, f"fwd {mask} Sq={sq} Sk={sk}: first wrong (i, j) = {tuple(bad[0])}"
