"""GPU tests of the MLA-native SM90 backward (fmha_bwd_sm90's bwd_mla: q_nope / q_pe and k_nope / k_pe read in place
by two TMA descriptors per Q and K tile, dK stored as dk_nope and dk_pe).

Reference: the same family's bwd on the concatenated q = [q_nope | q_pe], k = [k_nope | k_pe] (a one-head k_pe
broadcast over the kv heads), given the same out / lse / dout. Both fill the same smem tiles and run the same
arithmetic on them, so dk_nope / dk_pe (the reference's dk split at column 128, per kv head) and dv must be bit-identical
in any mode, and dq too with deterministic=True (its fp32 adds across key blocks then happen in a fixed order).
Every output is NaN-poisoned before the call, so an element the kernel fails to write fails the test. Key blocks
inside their sequence leave by TMA store, the block that crosses a sequence's end from registers: the odd lengths
below take both. The public API's gradients against attention on the concatenation are in test_fmha_fwd_sm90_mla.py.
"""
from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu

_CAP_OK = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)
if not _CAP_OK:
    pytest.skip("fmha_bwd_sm90 needs an SM90 GPU (compute capability 9.0)", allow_module_level=True)

from mla_autograd._build import load_family  # noqa: E402

from mla_parts import (DEV, DN, DR, DTYPES, DV, KPE, MASKS, cat_parts, cu_seqlens, dtype_id, layer_views,  # noqa: E402
                       make_parts, mask_id, rand)

# (Sq, Sk, Hq, Hkv): odd lengths (a key block of 112 crossing the end), Sq != Sk both ways, MHA / GQA / MQA, one
# key, an empty key side
SHAPES = [(1, 1, 1, 1), (17, 113, 8, 2), (113, 17, 8, 1), (255, 257, 16, 16), (1023, 1, 2, 1), (300, 448, 4, 4),
          (17, 0, 2, 1)]
SCALE = 0.0721


@pytest.fixture(scope="module")
def bwd_ext():
    return load_family("fmha_bwd_sm90")


@pytest.fixture(scope="module")
def fwd_ext():
    return load_family("fmha_fwd_sm90")








def _nan(shape, dtype):
    return torch.full(shape, float("nan"), device=DEV, dtype=dtype)




def _covered_rows(cu, total):
    """Rows of a packed batch that some sequence covers (the kernels write no others; the host zeroes them)."""
    rows = torch.zeros(total, dtype=torch.bool, device=DEV)
    c = cu.tolist()
    for b in range(len(c) - 1):
        rows[c[b]:c[b + 1]] = True
    return rows


def _check(bwd_ext, fwd_ext, q_nope, q_pe, k_nope, k_pe, v, *, causal, bottom_right, deterministic=True, cu_q=None,
           cu_k=None, msq=None, msk=None, dkv=False, options=None, name=""):
    """bwd_mla on the parts against bwd on their concatenation (same out, lse and dout)."""
    varlen = cu_q is not None
    dtype = q_nope.dtype
    q, k = cat_parts(q_nope, q_pe, k_nope, k_pe)
    out = torch.empty((*q_nope.shape[:-1], DV), device=DEV, dtype=dtype)
    lse_shape = (q_nope.shape[1], q_nope.shape[0]) if varlen else (q_nope.shape[0], q_nope.shape[2], q_nope.shape[1])
    lse = torch.empty(lse_shape, device=DEV, dtype=torch.float32)
    seq = (cu_q, cu_k, msq, msk)
    fwd_ext.fwd(q, k, v, out, lse, *seq, SCALE, causal, bottom_right)
    if varlen:  # rows no sequence covers hold whatever the forward left: give them defined values
        rows = _covered_rows(cu_q, q.shape[0])
        out[~rows] = 0
        lse[:, ~rows] = 0
    dout = torch.randn_like(out)
    args = (*seq, SCALE, causal, bottom_right, deterministic)

    dq_r, dk_r, dv_r = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    bwd_ext.bwd(dout, q, k, v, out, lse, dq_r, dk_r, dv_r, *args)

    dq = _nan(q.shape, dtype)
    dk_pe = _nan((*k_nope.shape[:-1], DR), dtype)
    if dkv:  # dk_nope and dv as the two halves of one (.., Hkv, Dn + Dv) buffer, as the layer's backward passes them
        buf = _nan((*k_nope.shape[:-1], DN + DV), dtype)
        dk_nope, dv = buf[..., :DN], buf[..., DN:]
    else:
        dk_nope, dv = _nan(k_nope.shape, dtype), _nan(v.shape, dtype)
    if options is None:
        bwd_ext.bwd_mla(dout, q_nope, q_pe, k_nope, k_pe, v, out, lse, dq, dk_nope, dk_pe, dv, *args)
    else:
        bwd_ext.bwd_mla_with_options(dout, q_nope, q_pe, k_nope, k_pe, v, out, lse, dq, dk_nope, dk_pe, dv, *args,
                                     options)
    torch.cuda.synchronize()
    got = {"dq": dq, "dk_nope": dk_nope, "dk_pe": dk_pe, "dv": dv}
    want = {"dq": dq_r, "dk_nope": dk_r[..., :DN], "dk_pe": dk_r[..., DN:], "dv": dv_r}
    for key in got:
        a, b = got[key], want[key]
        assert not a.isnan().any(), f"{key} {name}: unwritten elements"
        if key == "dq" and not deterministic:  # fp32 adds across key blocks in no fixed order
            torch.testing.assert_close(a, b, atol=2e-2, rtol=2e-2, msg=f"dq {name}")
        else:
            assert torch.equal(a, b), f"{key} {name}: differs from the concatenated backward"


# ---------------------------------------------------------------- the kernel against bwd on the concatenation

@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("mask", MASKS, ids=mask_id)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("kpe", KPE)
def test_dense_bit_identical(bwd_ext, fwd_ext, dtype, mask, shape, kpe):
    sq, sk, hq, hkv = shape
    g = torch.Generator(device=DEV).manual_seed(hash((sq, sk, hq, hkv, mask, kpe)) % (2**31))
    parts = make_parts(2, sq, sk, hq, hkv, kpe, dtype, g)
    _check(bwd_ext, fwd_ext, *parts, causal=mask[0], bottom_right=mask[1], name=f"{dtype} {mask} {shape} {kpe}")


@pytest.mark.parametrize("mask", MASKS, ids=mask_id)
@pytest.mark.parametrize("dkv", [False, True], ids=["separate", "dkv_halves"])
def test_nondeterministic_and_strided_outputs(bwd_ext, fwd_ext, mask, dkv):
    g = torch.Generator(device=DEV).manual_seed(11)
    parts = make_parts(2, 333, 301, 8, 2, "kpe1", torch.bfloat16, g)
    _check(bwd_ext, fwd_ext, *parts, causal=mask[0], bottom_right=mask[1], deterministic=False, dkv=dkv,
           name=f"nondet {mask} dkv={dkv}")
    _check(bwd_ext, fwd_ext, *parts, causal=mask[0], bottom_right=mask[1], dkv=dkv, name=f"det {mask} dkv={dkv}")


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("mask", MASKS, ids=mask_id)
def test_part_views_of_projections(bwd_ext, fwd_ext, dtype, mask):
    """As an MLA layer makes them: q_nope / q_pe split from one (B, S, Hq, 192) projection, k_nope / v from one
    (B, S, Hkv, 256) projection (their gradients into the two halves of one buffer), k_pe sliced from the
    (B, S, 576) latent row and viewed as (B, S, 1, 64)."""
    g = torch.Generator(device=DEV).manual_seed(5)
    B, sq, sk, hq, hkv = 2, 301, 299, 8, 2
    q_nope, q_pe, k_nope, k_pe, v = layer_views(B, sq, sk, hq, hkv, dtype, g)
    _check(bwd_ext, fwd_ext, q_nope, q_pe, k_nope, k_pe, v, causal=mask[0], bottom_right=mask[1], dkv=True,
           name=f"views {dtype} {mask}")


VARLEN_CASES = [
    ([0, 17, 1, 300, 0, 129], [5, 0, 1, 257, 3, 128]),
    ([128, 129, 127, 1], [112, 113, 224, 1000]),
    ([0, 0], [0, 0]),
]


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("mask", MASKS, ids=mask_id)
@pytest.mark.parametrize("case", range(len(VARLEN_CASES)))
@pytest.mark.parametrize("heads", [(8, 2), (4, 1)], ids=lambda h: f"h{h[0]}_{h[1]}")
@pytest.mark.parametrize("kpe", KPE)
def test_varlen_bit_identical(bwd_ext, fwd_ext, dtype, mask, case, heads, kpe):
    hq, hkv = heads
    lq, lk = VARLEN_CASES[case]
    g = torch.Generator(device=DEV).manual_seed(200 + case)
    cu_q = cu_seqlens(lq)
    cu_k = cu_seqlens(lk)
    parts = make_parts(None, sum(lq), sum(lk), hq, hkv, kpe, dtype, g)
    _check(bwd_ext, fwd_ext, *parts, causal=mask[0], bottom_right=mask[1], cu_q=cu_q, cu_k=cu_k, msq=max(lq),
           msk=max(lk), name=f"varlen {dtype} {mask} {lq} {lk} {heads} {kpe}")


@pytest.mark.parametrize("options", [{"poison_workspace": True}, {"l2_group": 1}, {"l2_group": 0}], ids=str)
def test_launch_options_bit_identical(bwd_ext, fwd_ext, options):
    """A NaN-filled fp32 workspace (every row the kernels read is written first) and the launch groups."""
    g = torch.Generator(device=DEV).manual_seed(9)
    parts = make_parts(3, 515, 389, 4, 2, "kpe1", torch.bfloat16, g)
    for causal in (False, True):
        _check(bwd_ext, fwd_ext, *parts, causal=causal, bottom_right=True, options=options,
               name=f"options {options} causal={causal}")


def test_rejects_bad_parts(bwd_ext):
    g = torch.Generator(device=DEV).manual_seed(3)
    qn, qp, kn, kp, v = make_parts(1, 64, 64, 4, 2, "kpe1", torch.bfloat16, g)
    out, dout = torch.zeros(1, 64, 4, DV, device=DEV, dtype=torch.bfloat16), torch.zeros(1, 64, 4, DV, device=DEV,
                                                                                           dtype=torch.bfloat16)
    lse = torch.zeros(1, 4, 64, device=DEV)
    dq = torch.empty(1, 64, 4, DN + DR, device=DEV, dtype=torch.bfloat16)
    dkn, dkp, dv = torch.empty_like(kn), torch.empty(1, 64, 2, DR, device=DEV, dtype=torch.bfloat16), torch.empty_like(v)
    args = (None, None, None, None, 0.1, False, False, False)

    def call(**kw):
        a = dict(q_nope=qn, q_pe=qp, k_nope=kn, k_pe=kp, dq=dq, dk_nope=dkn, dk_pe=dkp)
        a.update(kw)
        bwd_ext.bwd_mla(dout, a["q_nope"], a["q_pe"], a["k_nope"], a["k_pe"], v, out, lse, a["dq"], a["dk_nope"],
                        a["dk_pe"], dv, *args)

    call()  # the valid call runs
    unaligned = rand((1, 64, 1, DR + 8), torch.bfloat16, g)[..., 4:4 + DR]  # base 8 bytes off a 16-byte boundary
    with pytest.raises(RuntimeError, match="k_pe must be 16-byte aligned"):
        call(k_pe=unaligned)
    with pytest.raises(RuntimeError, match=r"\(Dn, Dr, Dv\) = \(128, 64, 128\)"):
        call(q_pe=qp[..., :32], k_pe=kp[..., :32])
    with pytest.raises(RuntimeError, match="k_pe must have 1 head or as many as k_nope"):
        call(k_pe=rand((1, 64, 3, DR), torch.bfloat16, g))
    with pytest.raises(RuntimeError, match="dk_pe must have shape"):
        call(dk_pe=torch.empty(1, 64, 1, DR, device=DEV, dtype=torch.bfloat16))
    with pytest.raises(RuntimeError, match="dq must have shape"):
        call(dq=torch.empty(1, 64, 4, DN, device=DEV, dtype=torch.bfloat16))
    with pytest.raises(RuntimeError, match="q_pe must have the dtype of q"):
        call(q_pe=qp.half())
