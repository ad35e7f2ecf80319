"""GPU tests of the MLA-native SM90 forward (fmha_fwd_sm90's fwd_mla: q_nope / q_pe and k_nope / k_pe read in
place by two TMA descriptors per Q and K tile).

Reference: the same family's fwd on the concatenated q = [q_nope | q_pe], k = [k_nope | k_pe] (a one-head k_pe
broadcast over the kv heads). Both fill the same smem tiles and run the same arithmetic on them, so out and lse
must be bit-identical (torch.equal; NaN-poisoned before every call so unwritten elements fail). Through the
public API: mla_attention against attention on the concatenation, out and lse bit for bit, gradients bit for bit
under deterministic=True (the backward reads the saved parts in place, fmha_bwd_sm90's bwd_mla, whose kernel tests
are in test_fmha_bwd_sm90_mla.py) and close otherwise.
"""
from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu

_CAP_OK = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)
if not _CAP_OK:
    pytest.skip("fmha_fwd_sm90 needs an SM90 GPU (compute capability 9.0)", allow_module_level=True)

import mla_autograd as M  # noqa: E402
from mla_autograd._build import load_family  # noqa: E402

from mla_parts import (DEV, DN, DR, DTYPES, DV, KPE, MASKS, cat_parts, cu_seqlens, dtype_id, layer_views,  # noqa: E402
                       make_parts, mask_id, rand)

# (Sq, Sk, Hq, Hkv): odd lengths, Sq != Sk both ways, MHA / GQA / MQA, an empty key side
SHAPES = [(1, 1, 1, 1), (17, 113, 8, 2), (113, 17, 8, 1), (255, 257, 16, 16), (1, 1023, 8, 8), (1023, 1, 2, 1),
          (1000, 1000, 4, 4), (17, 0, 2, 1)]


@pytest.fixture(scope="module")
def ext():
    return load_family("fmha_fwd_sm90")








def _poisoned(q_nope, varlen):
    out = torch.full((*q_nope.shape[:-1], DV), float("nan"), device=DEV, dtype=q_nope.dtype)
    lse_shape = (q_nope.shape[1], q_nope.shape[0]) if varlen else (q_nope.shape[0], q_nope.shape[2], q_nope.shape[1])
    return out, torch.full(lse_shape, float("nan"), device=DEV, dtype=torch.float32)


def _check_bit_identical(ext, q_nope, q_pe, k_nope, k_pe, v, *, scale, causal, bottom_right, cu_q=None, cu_k=None,
                         msq=None, msk=None, options=None, name=""):
    """fwd_mla on the parts against fwd on their concatenation: out and lse bit for bit."""
    varlen = cu_q is not None
    out, lse = _poisoned(q_nope, varlen)
    args = (cu_q, cu_k, msq, msk, scale, causal, bottom_right)
    if options is None:
        ext.fwd_mla(q_nope, q_pe, k_nope, k_pe, v, out, lse, *args)
    else:
        ext.fwd_mla_with_options(q_nope, q_pe, k_nope, k_pe, v, out, lse, *args, options)
    q, k = cat_parts(q_nope, q_pe, k_nope, k_pe)
    ref, ref_lse = _poisoned(q_nope, varlen)
    ext.fwd(q, k, v, ref, ref_lse, *args)
    torch.cuda.synchronize()
    if varlen:  # rows no sequence covers are not written by either
        rows = torch.zeros(q_nope.shape[0], dtype=torch.bool, device=DEV)
        cq = cu_q.tolist()
        for b in range(len(cq) - 1):
            rows[cq[b]:cq[b + 1]] = True
        out, ref, lse, ref_lse = out[rows], ref[rows], lse[:, rows], ref_lse[:, rows]
    assert not out.isnan().any(), f"out {name}: unwritten elements"
    assert torch.equal(out, ref), f"out {name}: differs from the concatenated forward"
    assert torch.equal(lse, ref_lse), f"lse {name}: differs from the concatenated forward"




# ---------------------------------------------------------------- the kernel against fwd on the concatenation

@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("mask", MASKS, ids=mask_id)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("kpe", KPE)
def test_dense_bit_identical(ext, dtype, mask, shape, kpe):
    sq, sk, hq, hkv = shape
    g = torch.Generator(device=DEV).manual_seed(hash((sq, sk, hq, hkv, mask, kpe)) % (2**31))
    parts = make_parts(2, sq, sk, hq, hkv, kpe, dtype, g)
    _check_bit_identical(ext, *parts, scale=0.0721, causal=mask[0], bottom_right=mask[1],
                         name=f"{dtype} {mask} {shape} {kpe}")


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("mask", MASKS, ids=mask_id)
def test_part_views_of_projections(ext, dtype, mask):
    """As an MLA layer makes them: q_nope / q_pe split from one (B, S, Hq, 192) projection, k_nope / v from one
    (B, S, Hkv, 256) projection, k_pe sliced from the (B, S, 576) latent row and viewed as (B, S, 1, 64); k_nope
    also from batch-transposed storage."""
    g = torch.Generator(device=DEV).manual_seed(5)
    B, sq, sk, hq, hkv = 2, 301, 299, 8, 2
    q_nope, q_pe, k_nope, k_pe, v = layer_views(B, sq, sk, hq, hkv, dtype, g)
    assert k_pe.shape == (B, sk, 1, DR) and k_pe.stride() == (sk * 576, 576, DR, 1)
    kw = dict(scale=0.0721, causal=mask[0], bottom_right=mask[1])
    _check_bit_identical(ext, q_nope, q_pe, k_nope, k_pe, v, **kw, name=f"views {dtype} {mask}")
    k_nope_t = rand((sk, B, hkv, DN), dtype, g).transpose(0, 1)
    _check_bit_identical(ext, q_nope, q_pe, k_nope_t, k_pe, v, **kw, name=f"transposed k_nope {dtype} {mask}")


VARLEN_CASES = [
    ([0, 17, 1, 300, 0, 129], [5, 0, 1, 257, 3, 128]),
    ([128, 129, 127, 1], [128, 127, 129, 1000]),
    ([0, 0], [0, 0]),
]


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("mask", MASKS, ids=mask_id)
@pytest.mark.parametrize("case", range(len(VARLEN_CASES)))
@pytest.mark.parametrize("heads", [(8, 2), (4, 1), (2, 2)], ids=lambda h: f"h{h[0]}_{h[1]}")
@pytest.mark.parametrize("kpe", KPE)
def test_varlen_bit_identical(ext, dtype, mask, case, heads, kpe):
    hq, hkv = heads
    lq, lk = VARLEN_CASES[case]
    g = torch.Generator(device=DEV).manual_seed(200 + case)
    cu_q = cu_seqlens(lq)
    cu_k = cu_seqlens(lk)
    parts = make_parts(None, sum(lq), sum(lk), hq, hkv, kpe, dtype, g)
    _check_bit_identical(ext, *parts, scale=0.0721, causal=mask[0], bottom_right=mask[1], cu_q=cu_q, cu_k=cu_k,
                         msq=max(lq), msk=max(lk), name=f"varlen {dtype} {mask} {lq} {lk} {heads} {kpe}")


@pytest.mark.parametrize("options", [{"ctas": 1}, {"ctas": 3, "dynamic": False}, {"ctas": 5, "dynamic": True},
                                     {"l2_group": 1}], ids=str)
def test_persistent_grid_bit_identical(ext, options):
    """Many tiles per CTA: the K ring and the Q barrier carry over from tile to tile with the rope loads on them."""
    g = torch.Generator(device=DEV).manual_seed(9)
    parts = make_parts(3, 515, 389, 4, 2, "kpe1", torch.bfloat16, g)
    for causal in (False, True):
        _check_bit_identical(ext, *parts, scale=0.0721, causal=causal, bottom_right=True, options=options,
                             name=f"options {options} causal={causal}")


def test_rejects_bad_parts(ext):
    g = torch.Generator(device=DEV).manual_seed(3)
    qn, qp, kn, kp, v = make_parts(1, 64, 64, 4, 2, "kpe1", torch.bfloat16, g)
    out, lse = _poisoned(qn, False)
    args = (None, None, None, None, 0.1, False, False)
    unaligned = rand((1, 64, 1, DR + 8), torch.bfloat16, g)[..., 4:4 + DR]  # base 8 bytes off a 16-byte boundary
    with pytest.raises(RuntimeError, match="k_pe must be 16-byte aligned"):
        ext.fwd_mla(qn, qp, kn, unaligned, v, out, lse, *args)
    with pytest.raises(RuntimeError, match=r"\(Dn, Dr, Dv\) = \(128, 64, 128\)"):
        ext.fwd_mla(qn, qp[..., :32], kn, kp[..., :32], v, out, lse, *args)
    with pytest.raises(RuntimeError, match="k_pe must have 1 head or as many as k_nope"):
        ext.fwd_mla(qn, qp, kn, rand((1, 64, 3, DR), torch.bfloat16, g), v, out, lse, *args)
    with pytest.raises(RuntimeError, match="q_pe shape"):
        ext.fwd_mla(qn, qp[:, :32], kn, kp, v, out, lse, *args)
    with pytest.raises(RuntimeError, match="q_pe must have the dtype of q_nope"):
        ext.fwd_mla(qn, qp.half(), kn, kp, v, out, lse, *args)


# ---------------------------------------------------------------- the public API against attention on the concatenation

def _public_parts(B, sq, sk, hq, hkv, kpe, dtype, seed):
    g = torch.Generator(device=DEV).manual_seed(seed)
    return tuple(t.requires_grad_() for t in make_parts(B, sq, sk, hq, hkv, kpe, dtype, g))


def _grads(out, inputs, dout):
    return torch.autograd.grad(out, inputs, dout)


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("mask", MASKS, ids=mask_id)
@pytest.mark.parametrize("heads", [(8, 8), (16, 4), (8, 1)], ids=lambda h: f"h{h[0]}_{h[1]}")
@pytest.mark.parametrize("kpe", KPE)
@pytest.mark.parametrize("deterministic", [True, False], ids=["det", "nondet"])
def test_public_mla_attention_matches_concatenated(dtype, mask, heads, kpe, deterministic):
    hq, hkv = heads
    causal, br = mask
    align = "bottom_right" if br else "top_left"
    parts = _public_parts(2, 177, 241, hq, hkv, kpe, dtype, seed=hq * 10 + hkv)
    assert M.explain_mla(*parts, causal=causal, causal_align=align).path == "native"
    kw = dict(causal=causal, causal_align=align, deterministic=deterministic, return_lse=True)
    out, lse = M.mla_attention(*parts, **kw)
    q, k = cat_parts(*parts[:4])
    ref, ref_lse = M.attention(q, k, parts[4], **kw)
    assert torch.equal(out, ref) and torch.equal(lse, ref_lse)
    dout = torch.randn_like(out)
    g, gr = _grads(out, parts, dout), _grads(ref, parts, dout)
    for name, a, b, t in zip(("dq_nope", "dq_pe", "dk_nope", "dk_pe", "dv"), g, gr, parts):
        assert a.shape == t.shape, name
        if deterministic:
            assert torch.equal(a, b), name
        else:  # dQ is accumulated across key blocks in no fixed order
            torch.testing.assert_close(a, b, atol=2e-2, rtol=2e-2, msg=name)


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("mask", MASKS, ids=mask_id)
@pytest.mark.parametrize("kpe", KPE)
def test_public_varlen_empty_sequence_matches_concatenated(dtype, mask, kpe):
    lq, lk = [65, 0, 130, 17], [80, 33, 130, 0]
    cq = cu_seqlens(lq)
    ck = cu_seqlens(lk)
    causal, br = mask
    align = "bottom_right" if br else "top_left"
    parts = _public_parts(None, sum(lq), sum(lk), 8, 2, kpe, dtype, seed=17)
    kw = dict(causal=causal, causal_align=align, deterministic=True, return_lse=True)
    args = (cq, ck, max(lq), max(lk))
    out, lse = M.mla_attention_varlen(*parts, *args, **kw)
    q, k = cat_parts(*parts[:4])
    ref, ref_lse = M.attention_varlen(q, k, parts[4], *args, **kw)
    assert torch.equal(out, ref) and torch.equal(lse, ref_lse)
    # sequence 3 has no keys: zero output, lse -inf
    assert (out[195:] == 0).all() and torch.isneginf(lse[:, 195:]).all()
    dout = torch.randn_like(out)
    for name, a, b in zip(("dq_nope", "dq_pe", "dk_nope", "dk_pe", "dv"), _grads(out, parts, dout),
                          _grads(ref, parts, dout)):
        assert torch.equal(a, b), name


@pytest.mark.parametrize("offset", [0, 4], ids=["aligned", "unaligned"])
def test_public_strided_views(offset):
    """Views of the layer's projections (read in place); with offset 4, q_nope / q_pe views whose base and row
    stride are 8 bytes off TMA's 16-byte rule (each copied alone first, same results)."""
    B, S, hq = 2, 200, 8
    g = torch.Generator(device=DEV).manual_seed(23)
    q = rand((B, S, hq, DN + DR + offset), torch.bfloat16, g)[..., offset:].requires_grad_()
    kv = rand((B, S, 1, DN + DV), torch.bfloat16, g).requires_grad_()
    latent = rand((B, S, 512 + DR), torch.bfloat16, g).requires_grad_()
    q_nope, q_pe = q.split([DN, DR], -1)
    k_nope, v = kv.split([DN, DV], -1)
    k_pe = latent[..., 512:].unsqueeze(2)
    kw = dict(causal=True, deterministic=True, return_lse=True)
    out, lse = M.mla_attention(q_nope, q_pe, k_nope, k_pe, v, **kw)
    qc, kc = cat_parts(q_nope, q_pe, k_nope, k_pe)
    ref, ref_lse = M.attention(qc, kc, v, **kw)
    assert torch.equal(out, ref) and torch.equal(lse, ref_lse)
    dout = torch.randn_like(out)
    for a, b in zip(_grads(out, (q, kv, latent), dout), _grads(ref, (q, kv, latent), dout)):
        assert torch.equal(a, b)


def test_compile_fullgraph_and_opcheck():
    parts = _public_parts(2, 129, 130, 8, 2, "kpe1", torch.bfloat16, seed=31)

    def f(*p):
        out, lse = M.mla_attention(*p, causal=True, deterministic=True, return_lse=True)
        return out, lse

    out_c, lse_c = torch.compile(f, fullgraph=True)(*parts)
    out_e, lse_e = f(*parts)
    assert torch.equal(out_c, out_e) and torch.equal(lse_c, lse_e)
    dout = torch.randn_like(out_e)
    for a, b in zip(_grads(out_c, parts, dout), _grads(out_e, parts, dout)):
        assert torch.equal(a, b)
    op = torch.ops.mla_autograd.mla_attn_fwd.default
    torch.library.opcheck(op, (*parts, None, None, 129, 130, 0.0721, True, True, True))
    lq = [3, 0, 70]
    cu = cu_seqlens(lq)
    packed = _public_parts(None, sum(lq), sum(lq), 4, 4, "kpeH", torch.float16, seed=37)
    torch.library.opcheck(op, (*packed, cu, cu, 70, 70, 0.0721, False, True, True))
    # the backward op (what torch.compile's backward graph calls), on the forward's saved parts, out and lse
    bop = torch.ops.mla_autograd.mla_attn_bwd.default
    d = [t.detach() for t in parts]
    torch.library.opcheck(bop, (dout, *d, out_e.detach(), lse_e, None, None, 129, 130, 0.0721, True, True, True))
    out_p, lse_p = M.mla_attention_varlen(*packed, cu, cu, 70, 70, softmax_scale=0.0721, deterministic=True,
                                          return_lse=True)
    dp = [t.detach() for t in packed]
    torch.library.opcheck(bop, (torch.randn_like(out_p), *dp, out_p.detach(), lse_p, cu, cu, 70, 70, 0.0721, False,
                                True, True))
