"""MLA's split query / key as the GPU tests of the MLA-native SM90 kernels make them (test_fmha_fwd_sm90_mla.py,
test_fmha_bwd_sm90_mla.py): the part head dims, random parts (alone or as views of a layer's projections), their
concatenation for the reference call, cu_seqlens (test_fmha_fwd_sm90.py's too), the parameter ids."""
from __future__ import annotations

import itertools

import torch

DEV = "cuda"
DN, DR, DV = 128, 64, 128
DTYPES = [torch.bfloat16, torch.float16]
MASKS = [(False, False), (True, False), (True, True)]  # (causal, bottom_right)
KPE = ["kpe1", "kpeH"]  # k_pe with one head (shared) or Hkv heads


def mask_id(m) -> str:
    return {(False, False): "nomask", (True, False): "causal_tl", (True, True): "causal_br"}[m]


def dtype_id(t) -> str:
    return str(t).split(".")[-1]


def rand(shape, dtype, g: torch.Generator) -> torch.Tensor:
    """Standard normal values drawn in float32 on the GPU, rounded to dtype."""
    return torch.randn(shape, device=DEV, dtype=torch.float32, generator=g).to(dtype)


def cat_parts(q_nope, q_pe, k_nope, k_pe) -> tuple[torch.Tensor, torch.Tensor]:
    """q = [q_nope | q_pe], k = [k_nope | k_pe] with a one-head k_pe broadcast over the kv heads."""
    k_pe = k_pe.expand(*k_nope.shape[:-1], k_pe.shape[-1])
    return torch.cat([q_nope, q_pe], -1), torch.cat([k_nope, k_pe], -1)


def make_parts(B, sq, sk, hq, hkv, kpe, dtype, g) -> tuple[torch.Tensor, ...]:
    """(q_nope, q_pe, k_nope, k_pe, v): dense (B, S, H, D), or packed (T, H, D) with B None; k_pe with one head for
    kpe == "kpe1", else Hkv."""
    lead_q = (sq,) if B is None else (B, sq)
    lead_k = (sk,) if B is None else (B, sk)
    return (rand((*lead_q, hq, DN), dtype, g), rand((*lead_q, hq, DR), dtype, g), rand((*lead_k, hkv, DN), dtype, g),
            rand((*lead_k, 1 if kpe == "kpe1" else hkv, DR), dtype, g), rand((*lead_k, hkv, DV), dtype, g))


def layer_views(B, sq, sk, hq, hkv, dtype, g) -> tuple[torch.Tensor, ...]:
    """(q_nope, q_pe, k_nope, k_pe, v) as an MLA layer makes them: q_nope / q_pe split from one (B, sq, hq, 192)
    projection, k_nope / v from one (B, sk, hkv, 256) projection, k_pe the last 64 columns of the (B, sk, 576)
    latent row viewed as (B, sk, 1, 64)."""
    q = rand((B, sq, hq, DN + DR), dtype, g)
    kv = rand((B, sk, hkv, DN + DV), dtype, g)
    latent = rand((B, sk, 512 + DR), dtype, g)
    q_nope, q_pe = q.split([DN, DR], -1)
    k_nope, v = kv.split([DN, DV], -1)
    return q_nope, q_pe, k_nope, latent[..., 512:].unsqueeze(2), v


def cu_seqlens(lengths) -> torch.Tensor:
    """The int32 cu_seqlens of a packed batch of these sequence lengths, on the GPU."""
    return torch.tensor([0, *itertools.accumulate(lengths)], device=DEV, dtype=torch.int32)
