"""GPU tests of the fmha_fwd_sm100 / fmha_bwd_sm100 kernel families (CUTLASS 4.2 example-77 Blackwell
FMHA wrapped by csrc/sm100/fmha). They need an SM100 GPU (compute capability 10.x) and skip elsewhere:
the kernels are compiled for sm_100a only and cannot run on SM90 or older parts.

NOTE: at the time of writing these tests have never run (no SM100 GPU was available to the project);
they are written to the same rules as the SM90 tests.

Reference: mla_autograd.reference in float32 on the same 16-bit inputs. Tolerance: FlashAttention's
rule (kernel error <= 2 x the error of plain PyTorch in the same dtype + eps). out/lse/dq/dk/dv are
NaN-poisoned before every call so unwritten elements fail; rows that see no key must give out 0 and
lse -inf (never NaN).
"""
from __future__ import annotations

import itertools
import math

import pytest
import torch

from mla_autograd import _kernels

pytestmark = pytest.mark.gpu

_CAP_OK = torch.cuda.is_available() and _kernels.FAMILIES["fmha_fwd_sm100"].serves(torch.cuda.get_device_capability())
if not _CAP_OK:
    pytest.skip("fmha_fwd_sm100/fmha_bwd_sm100 need an SM100 GPU (compute capability "
                f"{_kernels.FAMILIES['fmha_fwd_sm100'].capability_text()}, built for sm_100f)", allow_module_level=True)

from mla_autograd import reference  # noqa: E402
from mla_autograd._build import load_family  # noqa: E402
from mla_autograd.testing import assert_error_within, naive_attention  # noqa: E402

DEV = "cuda"
DIMS = [(192, 128), (128, 128)]
DTYPES = [torch.bfloat16, torch.float16]
MASKS = [(False, False), (True, False), (True, True)]  # (causal, bottom_right)
# (Sq, Sk, Hq, Hkv): odd lengths, Sq != Sk both ways (bottom-right rows with no key), GQA 1/2/4
SHAPES = [(1, 1, 1, 1), (17, 113, 2, 1), (113, 17, 8, 2), (300, 300, 4, 4), (113, 555, 2, 2), (555, 17, 8, 2),
          (1, 555, 4, 1), (300, 1, 2, 1)]
EPS = 1e-4
LSE_ATOL = 2e-3


@pytest.fixture(scope="module")
def fwd_ext():
    return load_family("fmha_fwd_sm100")


@pytest.fixture(scope="module")
def bwd_ext():
    return load_family("fmha_bwd_sm100")


def _mask_id(m):
    return "nomask" if not m[0] else ("causal_br" if m[1] else "causal_tl")


def _inputs(shape_q, shape_k, shape_v, dtype, seed):
    g = torch.Generator(device=DEV).manual_seed(seed)
    return tuple(torch.randn(s, device=DEV, dtype=torch.float32, generator=g).to(dtype)
                 for s in (shape_q, shape_k, shape_v))


def _check_fwd(fwd_ext, q, k, v, *, scale, causal, bottom_right, cu_q=None, cu_k=None, msq=None, msk=None):
    kw = dict(cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=msq, max_seqlen_k=msk,
              softmax_scale=scale, causal=causal, bottom_right=bottom_right)
    out_ref, lse_ref = reference.attention_forward(q.float(), k.float(), v.float(), **kw)
    base = naive_attention(q, k, v, softmax_scale=scale, causal=causal, bottom_right=bottom_right,
                           cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)
    out = torch.full(q.shape[:-1] + (v.shape[-1],), float("nan"), device=DEV, dtype=q.dtype)
    lse = torch.full(lse_ref.shape, float("nan"), device=DEV, dtype=torch.float32)
    fwd_ext.fwd(q, k, v, out, lse, cu_q, cu_k, msq, msk, scale, causal, bottom_right)
    torch.cuda.synchronize()
    assert not torch.isnan(out).any(), "out: NaN (unwritten or NaN rows)"
    assert not torch.isnan(lse).any(), "lse: NaN"
    assert_error_within(out, out_ref, base, factor=2.0, eps=EPS, name="out")
    fin = torch.isfinite(lse_ref)
    assert torch.equal(torch.isfinite(lse), fin), "lse: -inf rows differ from the reference"
    assert (lse[~fin] == float("-inf")).all()
    if fin.any():
        assert (lse[fin] - lse_ref[fin]).abs().max().item() <= LSE_ATOL
    return out, lse


def _check_bwd(bwd_ext, q, k, v, *, scale, causal, bottom_right, cu_q=None, cu_k=None, msq=None, msk=None, seed=0):
    kw = dict(cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=msq, max_seqlen_k=msk,
              softmax_scale=scale, causal=causal, bottom_right=bottom_right)
    out32, lse = reference.attention_forward(q.float(), k.float(), v.float(), **kw)
    out = out32.to(q.dtype)
    g = torch.Generator(device=DEV).manual_seed(seed + 1)
    dout = torch.randn(out.shape, device=DEV, dtype=torch.float32, generator=g).to(q.dtype)
    dq_ref, dk_ref, dv_ref = reference.attention_backward(dout.float(), q.float(), k.float(), v.float(), out32,
                                                          lse.float(), **kw)
    qb, kb, vb = (t.detach().clone().requires_grad_(True) for t in (q, k, v))
    ob = naive_attention(qb, kb, vb, softmax_scale=scale, causal=causal, bottom_right=bottom_right,
                         cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)
    ob.backward(dout)
    dq, dk, dv = (torch.full_like(t, float("nan")) for t in (q, k, v))
    bwd_ext.bwd(dout, q, k, v, out, lse.contiguous(), dq, dk, dv, cu_q, cu_k, msq, msk, scale, causal,
                bottom_right, False)
    torch.cuda.synchronize()
    for name, a, r, b in (("dq", dq, dq_ref, qb.grad), ("dk", dk, dk_ref, kb.grad), ("dv", dv, dv_ref, vb.grad)):
        assert torch.isfinite(a).all(), f"{name}: non-finite values"
        assert_error_within(a, r, b, factor=2.0, eps=EPS, name=name)


@pytest.mark.parametrize("heads", [(s[2], s[3]) for s in SHAPES[:1]] + [(8, 2)], ids=lambda h: f"h{h[0]}x{h[1]}")
@pytest.mark.parametrize("sq_sk", [(s[0], s[1]) for s in SHAPES], ids=lambda s: f"sq{s[0]}_sk{s[1]}")
@pytest.mark.parametrize("mask", MASKS, ids=_mask_id)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("dims", DIMS, ids=lambda d: f"d{d[0]}_{d[1]}")
def test_dense(fwd_ext, bwd_ext, dims, dtype, mask, sq_sk, heads):
    d, dvo = dims
    sq, sk = sq_sk
    hq, hkv = heads
    q, k, v = _inputs((2, sq, hq, d), (2, sk, hkv, d), (2, sk, hkv, dvo), dtype, seed=sq * 7 + sk + hq)
    kw = dict(scale=1.0 / math.sqrt(d), causal=mask[0], bottom_right=mask[1])
    _check_fwd(fwd_ext, q, k, v, **kw)
    _check_bwd(bwd_ext, q, k, v, **kw)


@pytest.mark.parametrize("mask", MASKS, ids=_mask_id)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("dims", DIMS, ids=lambda d: f"d{d[0]}_{d[1]}")
def test_varlen(fwd_ext, bwd_ext, dims, dtype, mask):
    d, dvo = dims
    # zero-length queries/keys, len_q > len_k (bottom-right rows with no key) and the reverse
    lens_q = [0, 17, 1, 113, 0, 300, 64, 65, 257]
    lens_k = [5, 0, 17, 200, 0, 113, 64, 1, 256]
    hq, hkv = 8, 2
    cu_q = torch.tensor([0] + list(itertools.accumulate(lens_q)), dtype=torch.int32, device=DEV)
    cu_k = torch.tensor([0] + list(itertools.accumulate(lens_k)), dtype=torch.int32, device=DEV)
    q, k, v = _inputs((sum(lens_q), hq, d), (sum(lens_k), hkv, d), (sum(lens_k), hkv, dvo), dtype, seed=3)
    kw = dict(scale=1.0 / math.sqrt(d), causal=mask[0], bottom_right=mask[1], cu_q=cu_q, cu_k=cu_k,
              msq=max(lens_q), msk=max(lens_k))
    _check_fwd(fwd_ext, q, k, v, **kw)
    _check_bwd(bwd_ext, q, k, v, **kw)


@pytest.mark.parametrize("dims", DIMS, ids=lambda d: f"d{d[0]}_{d[1]}")
def test_strided_inputs(fwd_ext, bwd_ext, dims):
    """Non-contiguous q/k/v (padded heads, packed kv buffer, (B,H,S,D) transposed) with unit last stride."""
    d, dvo = dims
    B, sq, sk, hq, hkv = 2, 113, 77, 4, 2
    big_q = torch.randn(B, sq, hq + 1, d + 16, device=DEV).to(torch.bfloat16)
    kv = torch.randn(B, sk, hkv, d + dvo + 8, device=DEV).to(torch.bfloat16)
    q = big_q[:, :, 1:, 8:8 + d]
    k = kv[..., :d]
    v = torch.randn(B, hkv, sk, dvo, device=DEV).to(torch.bfloat16).transpose(1, 2)  # not mergeable: copied
    kw = dict(scale=0.1, causal=True, bottom_right=True)
    _check_fwd(fwd_ext, q, k, v, **kw)
    _check_bwd(bwd_ext, q, k, v, **kw)


def test_padded_out_in_place(fwd_ext):
    """out given with out_pad_rows rows of its own storage in front: written in place (no staging)."""
    d, dvo, hq = 192, 128, 4
    lens = [100, 300, 7]
    cu = torch.tensor([0] + list(itertools.accumulate(lens)), dtype=torch.int32, device=DEV)
    T, ms = sum(lens), max(lens)
    q, k, v = _inputs((T, hq, d), (T, hq, d), (T, hq, dvo), torch.bfloat16, seed=5)
    pad = fwd_ext.out_pad_rows(ms)
    buf = torch.full((pad + T, hq, dvo), float("nan"), device=DEV, dtype=torch.bfloat16)
    out = buf[pad:]
    plan = fwd_ext.plan_fwd(q, k, v, out, torch.empty(hq, T, device=DEV), cu, cu, ms, ms, 0.1, True, False)
    assert plan["out_staging"] is False
    lse = torch.full((hq, T), float("nan"), device=DEV)
    fwd_ext.fwd(q, k, v, out, lse, cu, cu, ms, ms, 0.1, True, False)
    torch.cuda.synchronize()
    assert torch.isnan(buf[:pad]).all(), "the padding rows in front of out must never be written"
    ref, _ = reference.attention_forward(q.float(), k.float(), v.float(), cu_seqlens_q=cu, cu_seqlens_k=cu,
                                         max_seqlen_q=ms, max_seqlen_k=ms, softmax_scale=0.1, causal=True,
                                         bottom_right=False)
    base = naive_attention(q, k, v, softmax_scale=0.1, causal=True, bottom_right=False, cu_seqlens_q=cu,
                           cu_seqlens_k=cu)
    assert_error_within(out, ref, base, name="out")


def test_empty_and_errors(fwd_ext, bwd_ext):
    q, k, v = _inputs((2, 7, 2, 128), (2, 0, 2, 128), (2, 0, 2, 128), torch.bfloat16, seed=1)
    out = torch.full((2, 7, 2, 128), float("nan"), device=DEV, dtype=torch.bfloat16)
    lse = torch.full((2, 2, 7), float("nan"), device=DEV)
    fwd_ext.fwd(q, k, v, out, lse, None, None, None, None, 0.1, True, True)
    assert (out == 0).all() and (lse == float("-inf")).all()
    with pytest.raises(RuntimeError, match="deterministic"):
        bwd_ext.bwd(out, q, k, v, out, lse, torch.empty_like(q), torch.empty_like(k), torch.empty_like(v),
                    None, None, None, None, 0.1, False, False, True)
    with pytest.raises(RuntimeError, match="head dims"):
        q2 = torch.zeros(1, 8, 2, 64, device=DEV, dtype=torch.bfloat16)
        fwd_ext.fwd(q2, q2, q2, torch.empty_like(q2), torch.empty(1, 2, 8, device=DEV), None, None, None, None,
                    0.1, False, False)
