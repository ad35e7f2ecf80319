"""mla_attention / mla_attention_varlen: MLA's split query/key through the public API.

On CPU (reference path): float64 gradcheck, bit-equality with the concatenated `attention` call, property
tests against an independent float64 softmax(q_nope.k_nope + q_pe.k_pe)V that never concatenates, compile,
opcheck of mla_attn_fwd, explain_mla, every validation error, and the native path's wiring (what reaches the
kernel module's fwd_mla: parts in place, misaligned parts copied alone) with a stand-in module on a faked SM90.
On a GPU: bf16 through the kernels at DeepSeek's (128 + 64, 128); the native forward's bit-equality with the
concatenated one is tests/gpu/test_fmha_fwd_sm90_mla.py's.
"""
import math

import pytest
import torch
from hypothesis import given, settings, strategies as st

import mla_autograd as M
from mla_autograd import _build, _dispatch, reference
from mla_autograd._dispatch import Call
from mla_autograd._ops import concat_mla_parts
from mla_autograd.testing import assert_error_within, dense_mask, naive_attention

ALIGN = ["top_left", "bottom_right"]
MASKS = [(False, "bottom_right"), (True, "top_left"), (True, "bottom_right")]


def _rand(*shape, dtype=torch.float64, device=None, grad=True):
    return torch.randn(*shape, dtype=dtype, device=device).requires_grad_(grad)


def _cu(lens, device=None):
    return torch.tensor([0] + torch.tensor(lens, dtype=torch.int64).cumsum(0).tolist(), dtype=torch.int32,
                        device=device)


def _parts(B, Sq, Sk, Hq, Hkv, dn, dr, dv, *, shared, dtype=torch.float64, device=None, grad=True):
    """Dense parts (B given) or packed ones (B None), k_pe with 1 head (shared) or Hkv heads."""
    lead_q = (Sq,) if B is None else (B, Sq)
    lead_k = (Sk,) if B is None else (B, Sk)
    shapes = [(*lead_q, Hq, dn), (*lead_q, Hq, dr), (*lead_k, Hkv, dn), (*lead_k, 1 if shared else Hkv, dr),
              (*lead_k, Hkv, dv)]
    return tuple(_rand(*s, dtype=dtype, device=device, grad=grad) for s in shapes)


def _naive_mla_dense(q_nope, q_pe, k_nope, k_pe, v, scale, causal, bottom_right):
    """softmax(scale * (q_nope.k_nope + q_pe.k_pe)) V written from the parts (no concatenation); a one-head
    k_pe enters every head's rope score directly. Returns (out, lse), differentiable by autograd."""
    g = q_nope.shape[2] // k_nope.shape[2]
    kn, vv = k_nope.repeat_interleave(g, 2), v.repeat_interleave(g, 2)
    s = torch.einsum("bihd,bjhd->bhij", q_nope, kn)
    if k_pe.shape[2] == 1:
        s = s + torch.einsum("bihd,bjd->bhij", q_pe, k_pe[:, :, 0])
    else:
        s = s + torch.einsum("bihd,bjhd->bhij", q_pe, k_pe.repeat_interleave(g, 2))
    s = s * scale
    vis = dense_mask(q_nope.shape[1], k_nope.shape[1], causal=causal, bottom_right=bottom_right,
                     device=q_nope.device)
    s = s.masked_fill(~vis, float("-inf"))
    lse = torch.logsumexp(s, -1)
    p = torch.nan_to_num(torch.softmax(s, -1), nan=0.0)  # rows that see no key: output 0
    return torch.einsum("bhij,bjhd->bihd", p, vv), lse


def _naive_mla(q_nope, q_pe, k_nope, k_pe, v, *, scale=None, causal=False, bottom_right=True, cu_q=None,
               cu_k=None):
    """Dense (B, S, H, D) or, with cu_q / cu_k, packed (T, H, D) parts -> (out, lse)."""
    if scale is None:
        scale = 1.0 / math.sqrt(q_nope.shape[-1] + q_pe.shape[-1])
    if cu_q is None:
        return _naive_mla_dense(q_nope, q_pe, k_nope, k_pe, v, scale, causal, bottom_right)
    cq, ck = cu_q.tolist(), cu_k.tolist()
    outs, lses = [], []
    for i in range(len(cq) - 1):
        sq, sk = slice(cq[i], cq[i + 1]), slice(ck[i], ck[i + 1])
        o, lse = _naive_mla_dense(q_nope[None, sq], q_pe[None, sq], k_nope[None, sk], k_pe[None, sk], v[None, sk],
                                  scale, causal, bottom_right)
        outs.append(o[0])
        lses.append(lse[0])
    return torch.cat(outs, 0), torch.cat(lses, -1)


def _concat_call(q_nope, q_pe, k_nope, k_pe, v, **kw):
    """The documented equivalent: attention on the concatenated q / k (shared rope key expanded)."""
    k_pe = k_pe.expand(*k_nope.shape[:-1], k_pe.shape[-1])
    return M.attention(torch.cat([q_nope, q_pe], -1), torch.cat([k_nope, k_pe], -1), v, **kw)


def _concat_call_varlen(q_nope, q_pe, k_nope, k_pe, v, *args, **kw):
    k_pe = k_pe.expand(*k_nope.shape[:-1], k_pe.shape[-1])
    return M.attention_varlen(torch.cat([q_nope, q_pe], -1), torch.cat([k_nope, k_pe], -1), v, *args, **kw)


def _grads(out, inputs, dout):
    g = torch.autograd.grad(out, inputs, dout, allow_unused=True)
    return [x if x is not None else torch.zeros_like(t) for x, t in zip(g, inputs)]


# ---------------------------------------------------------------- float64 gradcheck through the public API

@pytest.mark.parametrize("shared", [True, False], ids=["kpe1", "kpeH"])
@pytest.mark.parametrize("causal,align", MASKS)
@pytest.mark.parametrize("hq,hkv", [(2, 2), (4, 2), (3, 1)])
def test_gradcheck_dense(shared, causal, align, hq, hkv):
    parts = _parts(2, 3, 4, hq, hkv, 4, 2, 3, shared=shared)
    assert torch.autograd.gradcheck(
        lambda *p: M.mla_attention(*p, causal=causal, causal_align=align, softmax_scale=0.6), parts)


@pytest.mark.parametrize("shared", [True, False], ids=["kpe1", "kpeH"])
@pytest.mark.parametrize("causal,align", MASKS)
def test_gradcheck_varlen_empty_sequences(shared, causal, align):
    lq, lk = [3, 0, 2, 1], [2, 3, 4, 0]  # empty sequences on both sides, Sq > Sk and Sq < Sk
    parts = _parts(None, sum(lq), sum(lk), 4, 2, 4, 2, 3, shared=shared)
    cq, ck = _cu(lq), _cu(lk)
    assert torch.autograd.gradcheck(
        lambda *p: M.mla_attention_varlen(*p, cq, ck, max(lq), max(lk), causal=causal, causal_align=align), parts)


# ---------------------------------------------------------------- identical to the concatenated attention call

@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("shared", [True, False], ids=["kpe1", "kpeH"])
@pytest.mark.parametrize("causal,align", MASKS)
def test_equals_concatenated_attention(dtype, shared, causal, align):
    parts = _parts(2, 6, 9, 8, 2, 16, 8, 12, shared=shared, dtype=dtype)
    kw = dict(causal=causal, causal_align=align, return_lse=True)
    out, lse = M.mla_attention(*parts, **kw)
    ref, ref_lse = _concat_call(*parts, **kw)
    assert out.dtype == dtype and out.shape == (2, 6, 8, 12)
    assert lse.shape == (2, 8, 6) and not lse.requires_grad
    assert torch.equal(out, ref) and torch.equal(lse, ref_lse)
    dout = torch.randn_like(out)
    g, gr = _grads(out, parts, dout), _grads(ref, parts, dout)
    for name, a, b, t in zip(("dq_nope", "dq_pe", "dk_nope", "dk_pe", "dv"), g, gr, parts):
        assert a.shape == t.shape, name
        assert torch.equal(a, b), name
    # with one k_pe head its gradient is the sum over the heads that share it
    if shared:
        kn, kp = parts[2], parts[3]
        q, k = torch.cat(parts[:2], -1), torch.cat([kn, kp.expand(*kn.shape[:-1], kp.shape[-1])], -1).detach()
        k.requires_grad_(True)
        dk = torch.autograd.grad(M.attention(q, k, parts[4], causal=causal, causal_align=align), k, dout)[0]
        torch.testing.assert_close(g[3], dk[..., kn.shape[-1]:].sum(2, keepdim=True))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("shared", [True, False], ids=["kpe1", "kpeH"])
def test_varlen_equals_concatenated_attention_varlen(dtype, shared):
    lq, lk = [4, 0, 3, 5], [6, 2, 0, 5]
    cq, ck = _cu(lq), _cu(lk)
    parts = _parts(None, sum(lq), sum(lk), 6, 3, 8, 4, 8, shared=shared, dtype=dtype)
    kw = dict(causal=True, return_lse=True)
    out, lse = M.mla_attention_varlen(*parts, cq, ck, max(lq), max(lk), **kw)
    ref, ref_lse = _concat_call_varlen(*parts, cq, ck, max(lq), max(lk), **kw)
    assert out.shape == (sum(lq), 6, 8) and lse.shape == (6, sum(lq))
    assert torch.equal(out, ref) and torch.equal(lse, ref_lse)
    dout = torch.randn_like(out)
    for name, a, b in zip(("dq_nope", "dq_pe", "dk_nope", "dk_pe", "dv"), _grads(out, parts, dout),
                          _grads(ref, parts, dout)):
        assert torch.equal(a, b), name
    # sequence 2 has no keys: zero output, lse -inf
    assert (out[4:7] == 0).all() and torch.isneginf(lse[:, 4:7]).all()


def test_default_softmax_scale_is_over_both_parts():
    parts = _parts(1, 5, 7, 4, 4, 12, 4, 8, shared=True)
    _, lse = M.mla_attention(*parts, return_lse=True)
    _, ref_lse = _naive_mla(*parts, scale=1.0 / math.sqrt(12 + 4))
    torch.testing.assert_close(lse, ref_lse)
    _, lse_explicit = M.mla_attention(*parts, softmax_scale=0.1, return_lse=True)
    torch.testing.assert_close(lse_explicit, _naive_mla(*parts, scale=0.1)[1])


def test_strided_parts_as_the_layer_makes_them():
    """q_nope / q_pe split from one projection, k_nope / v split from another: strided views."""
    B, S, H, dn, dr, dv = 2, 7, 4, 16, 8, 12
    q = _rand(B, S, H, dn + dr)
    kv = _rand(B, S, H, dn + dv)
    kpe = _rand(B, S, 1, dr + 3)[..., 3:]  # offset view with unit last stride
    q_nope, q_pe = q.split([dn, dr], -1)
    k_nope, v = kv.split([dn, dv], -1)
    assert not q_nope.is_contiguous() and not v.is_contiguous() and not kpe.is_contiguous()
    out = M.mla_attention(q_nope, q_pe, k_nope, kpe, v, causal=True)
    torch.testing.assert_close(out, _naive_mla(q_nope, q_pe, k_nope, kpe, v, causal=True)[0])
    do = torch.randn_like(out)
    for a, b in zip(_grads(out, (q, kv, kpe), do),
                    _grads(_naive_mla(q_nope, q_pe, k_nope, kpe, v, causal=True)[0], (q, kv, kpe), do)):
        torch.testing.assert_close(a, b)


def test_deterministic_reproducible_and_double_backward_raises():
    parts = _parts(1, 6, 6, 4, 2, 8, 4, 8, shared=True)
    runs = [torch.autograd.grad(M.mla_attention(*parts, causal=True, deterministic=True).sum(), parts)
            for _ in range(2)]
    for a, b in zip(*runs):
        assert torch.equal(a, b)
    (gq,) = torch.autograd.grad(M.mla_attention(*parts).sum(), parts[0], create_graph=True)
    with pytest.raises(RuntimeError, match="double backward"):
        torch.autograd.grad(gq.sum(), parts[0])


# ---------------------------------------------------------------- property tests against the float64 naive MLA

def _assert_same_results(out, lse, ref, ref_lse, parts):
    """Outputs and lse equal, and the gradients of every part under one random dout."""
    torch.testing.assert_close(out, ref)
    torch.testing.assert_close(lse, ref_lse)
    if out.numel() == 0:
        return
    do = torch.randn_like(out)
    for a, b in zip(_grads(out, parts, do), _grads(ref, parts, do)):
        torch.testing.assert_close(a, b)


@settings(max_examples=25, deadline=None)
@given(B=st.integers(1, 2), Sq=st.integers(0, 7), Sk=st.integers(0, 7), Hkv=st.sampled_from([1, 2]),
       G=st.sampled_from([1, 2, 3]), dims=st.sampled_from([(8, 4, 8), (16, 8, 12), (4, 4, 4)]),
       shared=st.booleans(), causal=st.booleans(), align=st.sampled_from(ALIGN))
def test_property_dense_matches_naive(B, Sq, Sk, Hkv, G, dims, shared, causal, align):
    parts = _parts(B, Sq, Sk, Hkv * G, Hkv, *dims, shared=shared)
    kw = dict(causal=causal, bottom_right=align == "bottom_right")
    out, lse = M.mla_attention(*parts, causal=causal, causal_align=align, return_lse=True)
    ref, ref_lse = _naive_mla(*parts, **kw)
    _assert_same_results(out, lse, ref, ref_lse, parts)


@settings(max_examples=25, deadline=None)
@given(lens=st.lists(st.tuples(st.integers(0, 5), st.integers(0, 5)), min_size=1, max_size=4),
       Hkv=st.sampled_from([1, 2]), G=st.sampled_from([1, 2]), shared=st.booleans(), causal=st.booleans(),
       align=st.sampled_from(ALIGN))
def test_property_varlen_matches_naive(lens, Hkv, G, shared, causal, align):
    lq, lk = [a for a, _ in lens], [b for _, b in lens]
    cq, ck = _cu(lq), _cu(lk)
    parts = _parts(None, sum(lq), sum(lk), Hkv * G, Hkv, 8, 4, 6, shared=shared)
    out, lse = M.mla_attention_varlen(*parts, cq, ck, max(lq), max(lk), causal=causal, causal_align=align,
                                      return_lse=True)
    ref, ref_lse = _naive_mla(*parts, causal=causal, bottom_right=align == "bottom_right", cu_q=cq, cu_k=ck)
    _assert_same_results(out, lse, ref, ref_lse, parts)


# ---------------------------------------------------------------- torch.compile (a composition of the attention ops)

def test_compile_fullgraph_dense_fwd_bwd():
    parts = _parts(2, 5, 7, 4, 2, 8, 4, 6, shared=True, dtype=torch.float32)

    def f(*p):
        out, lse = M.mla_attention(*p, causal=True, return_lse=True)
        return (out * 2).sum() + lse.sum().detach()

    loss = torch.compile(f, fullgraph=True, backend="aot_eager")(*parts)
    g = torch.autograd.grad(loss, parts)
    loss_e = f(*parts)
    ge = torch.autograd.grad(loss_e, parts)
    torch.testing.assert_close(loss, loss_e)
    for a, b in zip(g, ge):
        torch.testing.assert_close(a, b)


def test_compile_fullgraph_varlen_one_cu_seqlens():
    # one cu_seqlens tensor for queries and keys: the dispatch point passes distinct views to the Function
    cu = _cu([3, 4])
    parts = _parts(None, 7, 7, 4, 2, 8, 4, 6, shared=True, dtype=torch.float32)
    f = torch.compile(lambda *p: M.mla_attention_varlen(*p, cu, cu, 4, 4, causal=True).square().sum(),
                      fullgraph=True, backend="aot_eager")
    g = torch.autograd.grad(f(*parts), parts)
    ge = torch.autograd.grad(M.mla_attention_varlen(*parts, cu, cu, 4, 4, causal=True).square().sum(), parts)
    for a, b in zip(g, ge):
        torch.testing.assert_close(a, b)


def test_opcheck_mla_attn_fwd():
    """The op's schema, fake impl, registered autograd and AOT dispatch (on CPU its body concatenates the parts
    for attn_fwd's reference path), dense and varlen, k_pe with one head and with Hkv."""
    op = torch.ops.mla_autograd.mla_attn_fwd.default
    for shared in (True, False):
        parts = _parts(2, 5, 7, 4, 2, 8, 4, 6, shared=shared, dtype=torch.float32)
        torch.library.opcheck(op, (*parts, None, None, 5, 7, 0.3, True, True, False))
        cu = _cu([3, 0, 4])
        packed = _parts(None, 7, 7, 4, 2, 8, 4, 6, shared=shared, dtype=torch.float32)
        torch.library.opcheck(op, (*packed, cu, cu, 4, 4, 0.3, True, False, True))
    out, lse = op(*_parts(1, 3, 3, 2, 1, 8, 4, 6, shared=True, dtype=torch.float32, grad=False), None, None, 3, 3,
                  0.3, False, True)
    assert out.shape == (1, 3, 2, 6) and lse.shape == (1, 2, 3)


def test_opcheck_mla_attn_bwd():
    """The backward op (what a compiled backward calls): schema, fake impl (dq whole, the other gradients in their
    parts' shapes, contiguous) and the real outputs, dense and varlen, k_pe with one head and with Hkv, parts given
    as strided views of one projection (the layer's layout)."""
    op = torch.ops.mla_autograd.mla_attn_bwd.default
    fwd = torch.ops.mla_autograd.mla_attn_fwd.default
    for shared in (True, False):
        for varlen in (False, True):
            cu = _cu([3, 0, 4]) if varlen else None
            parts = _parts(None if varlen else 2, 7 if varlen else 5, 7, 4, 2, 8, 4, 6, shared=shared,
                           dtype=torch.float32, grad=False)
            kv = torch.cat([parts[2], parts[4]], -1)  # k_nope / v as the halves of one projection
            parts = (parts[0], parts[1], kv[..., :8], parts[3], kv[..., 8:])
            seq = (cu, cu, 4, 4) if varlen else (None, None, 5, 7)
            out, lse = fwd(*parts, *seq, 0.3, True, True)
            dout = torch.randn_like(out)
            torch.library.opcheck(op, (dout, *parts, out, lse, *seq, 0.3, True, True, False))
            dq, dk_nope, dk_pe, dv = op(dout, *parts, out, lse, *seq, 0.3, True, True, False)
            assert dq.shape == (*parts[0].shape[:-1], 12) and dk_pe.shape == parts[3].shape
            assert all(t.is_contiguous() for t in (dq, dk_nope, dk_pe, dv))


# ---------------------------------------------------------------- the native path's wiring (stand-in kernel module)

class _StandInSm90:
    """The fmha_fwd_sm90 / fmha_bwd_sm90 modules' entries as the float32 reference on CPU: fwd_mla and bwd_mla record
    what they are given and compute fwd / bwd on the concatenation (bwd_mla writing dk as its two parts, dk_pe per kv
    head), so native and concatenated calls agree bit for bit here too."""

    def __init__(self):
        self.mla_calls = []
        self.mla_bwd_calls = []

    def fwd(self, q, k, v, out, lse, cu_q, cu_k, msq, msk, scale, causal, br):
        o, l = reference.attention_forward(q.float(), k.float(), v.float(), cu_seqlens_q=cu_q, cu_seqlens_k=cu_k,
                                           max_seqlen_q=msq, max_seqlen_k=msk, softmax_scale=scale, causal=causal,
                                           bottom_right=br)
        out.copy_(o)
        lse.copy_(l)

    def fwd_mla(self, q_nope, q_pe, k_nope, k_pe, v, out, lse, *args):
        self.mla_calls.append((q_nope, q_pe, k_nope, k_pe, v))
        self.fwd(*concat_mla_parts(q_nope, q_pe, k_nope, k_pe), v, out, lse, *args)

    def bwd(self, dout, q, k, v, out, lse, dq, dk, dv, cu_q, cu_k, msq, msk, scale, causal, br, det):
        grads = reference.attention_backward(dout.float(), q.float(), k.float(), v.float(), out.float(), lse,
                                             cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=msq,
                                             max_seqlen_k=msk, softmax_scale=scale, causal=causal, bottom_right=br)
        for dst, g in zip((dq, dk, dv), grads):
            dst.copy_(g)

    def bwd_mla(self, dout, q_nope, q_pe, k_nope, k_pe, v, out, lse, dq, dk_nope, dk_pe, dv, *args):
        self.mla_bwd_calls.append((q_nope, q_pe, k_nope, k_pe, v, dk_nope, dv, dq))
        q, k = concat_mla_parts(q_nope, q_pe, k_nope, k_pe)
        dk = torch.empty_like(k)
        self.bwd(dout, q, k, v, out, lse, dq, dk, dv, *args)
        dk_nope.copy_(dk[..., :k_nope.shape[-1]])
        dk_pe.copy_(dk[..., k_nope.shape[-1]:])


@pytest.fixture
def standin_sm90(monkeypatch):
    """A faked SM90 whose kernel families are _StandInSm90 (dispatch memo and warnings reset)."""
    ext = _StandInSm90()
    monkeypatch.setattr(Call, "capability", property(lambda self: (9, 0)))
    monkeypatch.setattr(_build, "family_available", lambda name: (True, ""))
    monkeypatch.setattr(_build, "load_family", lambda name, **kw: ext)
    monkeypatch.setattr(_dispatch, "_decisions", {})
    monkeypatch.delenv("MLA_AUTOGRAD_BACKEND", raising=False)
    return ext


def _layer_views(B, S, H, *, q_offset=0, dtype=torch.bfloat16):
    """q_nope / q_pe split from one (B, S, H, 192) projection (q_offset elements into a wider row), k_nope / v
    from one (B, S, H, 256) projection, k_pe the rope slice of a (B, S, 576) latent row: (bases, parts)."""
    g = torch.Generator().manual_seed(0)
    q = torch.randn(B, S, H, 192 + q_offset, generator=g).to(dtype)[..., q_offset:].requires_grad_()
    kv = torch.randn(B, S, H, 256, generator=g).to(dtype).requires_grad_()
    latent = torch.randn(B, S, 576, generator=g).to(dtype).requires_grad_()
    return (q, kv, latent), (*q.split([128, 64], -1), *kv.split([128, 128], -1)[:1], latent[..., 512:].unsqueeze(2),
                             kv[..., 128:])


def test_native_path_reads_aligned_views_in_place(standin_sm90):
    bases, parts = _layer_views(2, 9, 4)
    assert M.explain_mla(*parts).path == "native"
    out, lse = M.mla_attention(*parts, causal=True, deterministic=True, return_lse=True)
    (given,) = standin_sm90.mla_calls
    for name, a, b in zip(("q_nope", "q_pe", "k_nope", "k_pe", "v"), given, parts):
        assert a.data_ptr() == b.data_ptr() and a.shape == b.shape and a.stride() == b.stride(), name
    assert given[3].shape == (2, 9, 1, 64)  # the shared rope key, not expanded
    q, k = concat_mla_parts(*parts[:4])
    ref, ref_lse = M.attention(q, k, parts[4], causal=True, deterministic=True, return_lse=True)
    assert torch.equal(out, ref) and torch.equal(lse, ref_lse)
    dout = torch.randn_like(out)
    g, gr = _grads(out, bases, dout), _grads(ref, bases, dout)
    for a, b in zip(g, gr):
        assert torch.equal(a, b)
    # the backward read the same parts in place (the shared rope key not expanded)
    (bwd_given,) = standin_sm90.mla_bwd_calls
    for name, a, b in zip(("q_nope", "q_pe", "k_nope", "k_pe", "v"), bwd_given, parts):
        assert a.data_ptr() == b.data_ptr() and a.shape == b.shape and a.stride() == b.stride(), name
    assert M.explain_mla(*parts).backward.op == "mla_bwd"


def test_native_path_packed_writes_the_projections_gradients_whole(standin_sm90):
    """mla_attention_packed on the layer's tensors: the kernels get the same in-place views as mla_attention on
    the parts, and the backward writes dk_nope and dv into the two halves of one buffer, which leaves as kv's
    gradient itself (and dq as q's), with mla_attention's values."""
    (q, kv, latent), parts = _layer_views(2, 9, 4)
    out = M.mla_attention_packed(q, kv, latent[..., 512:].unsqueeze(2), causal=True, deterministic=True)
    (given,) = standin_sm90.mla_calls
    for name, a, b in zip(("q_nope", "q_pe", "k_nope", "k_pe", "v"), given, parts):
        assert a.data_ptr() == b.data_ptr() and a.shape == b.shape and a.stride() == b.stride(), name
    seen = {}
    q.register_hook(lambda g: seen.setdefault("q", g))
    kv.register_hook(lambda g: seen.setdefault("kv", g))
    dout = torch.randn_like(out)
    g = _grads(out, (q, kv, latent), dout)
    (bwd_given,) = standin_sm90.mla_bwd_calls
    dk_nope, dv, dq = bwd_given[5:]
    assert dv.data_ptr() == dk_nope.data_ptr() + 128 * dk_nope.element_size() and dk_nope.stride() == dv.stride()
    assert seen["kv"].data_ptr() == dk_nope.data_ptr() and seen["q"].data_ptr() == dq.data_ptr()
    ref = M.mla_attention(*parts, causal=True, deterministic=True)
    assert torch.equal(out, ref)
    for a, b in zip(g, _grads(ref, (q, kv, latent), dout)):
        assert torch.equal(a, b)


def test_native_path_copies_a_misaligned_part_alone(standin_sm90):
    bases, parts = _layer_views(1, 5, 2, q_offset=4)  # q_nope / q_pe 8 bytes off a 16-byte boundary
    out = M.mla_attention(*parts)
    (given,) = standin_sm90.mla_calls
    for name, a, b in zip(("q_nope", "q_pe", "k_nope", "k_pe", "v"), given, parts):
        assert torch.equal(a, b), name
        assert a.data_ptr() % 16 == 0 and all(s % 8 == 0 for s in a.stride()[:-1]), name
        assert (a.data_ptr() == b.data_ptr()) == (name not in ("q_nope", "q_pe")), name
    q, k = concat_mla_parts(*parts[:4])
    assert torch.equal(out, M.attention(q, k, parts[4]))


def test_native_path_varlen_and_saved_tensors(standin_sm90):
    """Varlen through fwd_mla; autograd saves the parts (never a concatenated q / k)."""
    cu = _cu([3, 0, 4])
    parts = _parts(None, 7, 7, 4, 2, 128, 64, 128, shared=True, dtype=torch.float16)
    out = M.mla_attention_varlen(*parts, cu, cu, 4, 4, causal=True)
    assert len(standin_sm90.mla_calls) == 1
    saved = {t.data_ptr() for t in out.grad_fn.saved_tensors if t is not None}
    assert {t.data_ptr() for t in parts} <= saved
    assert all(t.shape[-1] != 192 for t in out.grad_fn.saved_tensors if t is not None)
    ref = _concat_call_varlen(*parts, cu, cu, 4, 4, causal=True)
    assert torch.equal(out, ref)
    dout = torch.randn_like(out)
    for a, b in zip(_grads(out, parts, dout), _grads(ref, parts, dout)):
        assert torch.equal(a, b)


# ---------------------------------------------------------------- explain_mla

def test_explain_mla_cpu():
    parts = _parts(1, 3, 3, 4, 2, 8, 4, 8, shared=True, dtype=torch.float32, grad=False)
    e = M.explain_mla(*parts, causal=True)
    assert e.path == "concat" and e.native.backend == "concat"
    assert e.forward.backend == "reference" and e.backward.backend == "reference"
    text = str(e)
    assert text.startswith("mla inputs: concat") and "kernels need CUDA" in text
    assert "not sm90 in place: tensors are on cpu" in text


@pytest.mark.parametrize("dims,expect", [((128, 64, 128), "sm90"), ((64, 64, 128), "sm90"),
                                         ((96, 32, 64), "reference")])
def test_explain_mla_routes_concatenated_dims(monkeypatch, dims, expect):
    """The parts at (128, 64, 128) run in place forward and backward (mla_fwd / mla_bwd rows); anything else is
    asked for as (Dn + Dr, Dv): 64 + 64 -> (128, 128) is kernel dims."""
    monkeypatch.setattr(Call, "capability", property(lambda self: (9, 0)))
    monkeypatch.setattr(_build, "family_available", lambda name: (True, ""))
    dn, dr, dv = dims
    qn, qp = torch.empty(1, 4, 16, dn, dtype=torch.bfloat16), torch.empty(1, 4, 16, dr, dtype=torch.bfloat16)
    kn, kp = torch.empty(1, 4, 16, dn, dtype=torch.bfloat16), torch.empty(1, 4, 1, dr, dtype=torch.bfloat16)
    v = torch.empty(1, 4, 16, dv, dtype=torch.bfloat16)
    e = M.explain_mla(qn, qp, kn, kp, v, causal=True, deterministic=True)
    assert e.forward.backend == expect and e.backward.backend == expect, str(e)
    native = dims == (128, 64, 128)
    assert e.path == ("native" if native else "concat"), str(e)
    assert e.forward.op == ("mla_fwd" if native else "attn_fwd")
    assert e.backward.op == ("mla_bwd" if native else "attn_bwd")
    assert str(e).startswith(f"mla inputs: {e.path}")
    if not native:
        assert f"part head dims (Dn, Dr, Dv) {dims} not in [(128, 64, 128)]" in str(e)
    if expect == "reference":
        assert f"head dims ({dn + dr}, {dv}) not in" in str(e)


# ---------------------------------------------------------------- bad inputs name the argument

def _ok_parts():
    return [torch.randn(2, 5, 4, 8), torch.randn(2, 5, 4, 4), torch.randn(2, 6, 2, 8), torch.randn(2, 6, 1, 4),
            torch.randn(2, 6, 2, 6)]


def _with(i, fn):
    def mutate(parts):
        parts = list(parts)
        parts[i] = fn(parts[i])
        return parts
    return mutate


QN, QP, KN, KP, VV = range(5)


@pytest.mark.parametrize("mutate,exc,match", [
    (_with(QN, lambda t: t[0]), ValueError, "q_nope must have 4 dimensions"),
    (_with(QP, lambda t: t[0]), ValueError, "q_pe must have 4 dimensions"),
    (_with(KN, lambda t: t[None]), ValueError, "k_nope must have 4 dimensions"),
    (_with(KP, lambda t: t[:, :, 0]), ValueError, "k_pe must have 4 dimensions"),
    (_with(VV, lambda t: t[0]), ValueError, "v must have 4 dimensions"),
    (_with(QN, lambda t: t.tolist()), TypeError, "q_nope must be a torch.Tensor"),
    (_with(KP, lambda t: None), TypeError, "k_pe must be a torch.Tensor"),
    (_with(QN, lambda t: t.int()), TypeError, "q_nope must be bfloat16"),
    (_with(QP, lambda t: t.double()), TypeError, "q_pe has dtype float64 but q_nope has float32"),
    (_with(KN, lambda t: t.half()), TypeError, "k_nope has dtype float16"),
    (_with(KP, lambda t: t.bfloat16()), TypeError, "k_pe has dtype bfloat16"),
    (_with(VV, lambda t: t.double()), TypeError, "v has dtype float64"),
    (_with(KP, lambda t: t.to("meta")), ValueError, "k_pe is on meta but q_nope is on cpu"),
    (_with(QP, lambda t: t.transpose(-1, -2).contiguous().transpose(-1, -2)), ValueError,
     "q_pe must have stride 1 in its last dimension"),
    (_with(KP, lambda t: t.repeat_interleave(2, -1)[..., ::2]), ValueError,
     "k_pe must have stride 1 in its last dimension"),
    (_with(QP, lambda t: t[:, :4]), ValueError, r"q_pe shape \(2, 4, 4, 4\) must match q_nope .* in \(B, Sq, Hq\)"),
    (_with(QP, lambda t: t[:, :, :2]), ValueError, "q_pe shape .* must match q_nope"),
    (_with(VV, lambda t: t[:, :5]), ValueError, r"v shape .* must match k_nope .* in \(B, Sk, Hkv\)"),
    (_with(VV, lambda t: t[:, :, :1]), ValueError, "v shape .* must match k_nope"),
    (lambda p: [p[0], p[1], p[2][:1], p[3][:1], p[4][:1]], ValueError,
     "k_nope batch size 1 must equal q_nope batch size 2"),
    (lambda p: [p[0][:, :, :3], p[1][:, :, :3], *p[2:]], ValueError,
     r"query heads \(3, q_nope\) must be a multiple of the number of key/value heads \(2\) in k_nope and v"),
    (_with(KP, lambda t: t[:, :5]), ValueError, r"k_pe shape .* must match k_nope .* in \(B, Sk\)"),
    (_with(KP, lambda t: t.expand(2, 6, 3, 4)), ValueError, r"k_pe must have 1 head .* \(2\), got 3"),
    (_with(KN, lambda t: t[..., :6]), ValueError, "k_nope head dim 6 must equal q_nope head dim 8"),
    (_with(KP, lambda t: t[..., :2]), ValueError, "k_pe head dim 2 must equal q_pe head dim 4"),
    (lambda p: [p[0], p[1][..., :0], p[2], p[3][..., :0], p[4]], ValueError, "q_pe head dim must be positive"),
    (_with(VV, lambda t: t[..., :0]), ValueError, "v head dim must be positive"),
])
def test_dense_argument_errors(mutate, exc, match):
    with pytest.raises(exc, match=match):
        M.mla_attention(*mutate(_ok_parts()))


def test_keyword_errors():
    p = _ok_parts()
    M.mla_attention(*p)
    with pytest.raises(ValueError, match="causal_align must be 'top_left' or 'bottom_right'"):
        M.mla_attention(*p, causal=True, causal_align="upper")
    with pytest.raises(ValueError, match="softmax_scale must be a finite number > 0"):
        M.mla_attention(*p, softmax_scale=float("inf"))
    with pytest.raises(TypeError, match="softmax_scale must be a Python float"):
        M.mla_attention(*p, softmax_scale=torch.tensor(0.1))


def test_varlen_errors():
    qn, qp, kn, kp, v = (torch.randn(7, 4, 8), torch.randn(7, 4, 4), torch.randn(9, 2, 8), torch.randn(9, 1, 4),
                         torch.randn(9, 2, 6))
    cq, ck = _cu([3, 4]), _cu([4, 5])
    M.mla_attention_varlen(qn, qp, kn, kp, v, cq, ck, 4, 5)
    cases = [
        ((qn[None], qp, kn, kp, v, cq, ck, 4, 5), ValueError, "q_nope must have 3 dimensions"),
        ((qn, qp, kn, kp[:, 0], v, cq, ck, 4, 5), ValueError, "k_pe must have 3 dimensions"),
        ((qn, qp[:6], kn, kp, v, cq, ck, 4, 5), ValueError, r"q_pe shape .* in \(Tq, Hq\)"),
        ((qn, qp, kn, kp[:8], v, cq, ck, 4, 5), ValueError, r"k_pe shape .* in \(Tk,\)"),
        ((qn, qp, kn, kp.expand(9, 3, 4), v, cq, ck, 4, 5), ValueError, "k_pe must have 1 head"),
        ((qn, qp, kn, kp, v, cq.long(), ck, 4, 5), TypeError, "cu_seqlens_q must be int32"),
        ((qn, qp, kn, kp, v, cq, ck[None], 4, 5), ValueError, "cu_seqlens_k must have 1 dimensions"),
        ((qn, qp, kn, kp, v, cq, ck.to("meta"), 4, 5), ValueError, "cu_seqlens_k is on meta but q_nope is on cpu"),
        ((qn, qp, kn, kp, v, cq, _cu([9]), 4, 9), ValueError, "cu_seqlens_q .* and cu_seqlens_k .* must both have"),
        ((qn, qp, kn, kp, v, cq, ck, -1, 5), ValueError, "max_seqlen_q must be a non-negative int"),
        ((qn, qp, kn, kp, v, cq, ck, 4, 5.0), ValueError, "max_seqlen_k must be a non-negative int"),
        ((qn, qp, kn, kp, v, cq + 1, ck, 5, 5), ValueError, r"cu_seqlens_q\[0\] must be 0"),
        ((qn, qp, kn, kp, v, cq, _cu([6, 3]), 4, 5), ValueError,
         "max_seqlen_k = 5 is smaller than the longest sequence"),
        ((qn, qp, kn, kp, v, _cu([5, -1, 3]), _cu([4, 0, 5]), 5, 5), ValueError, "cu_seqlens_q must be non-decreasing"),
        ((qn, qp, kn, kp, v, cq, _cu([4, 4]), 4, 5), ValueError,
         r"cu_seqlens_k\[-1\] = 8 must equal the number of packed tokens \(9\)"),
    ]
    for args, exc, match in cases:
        with pytest.raises(exc, match=match):
            M.mla_attention_varlen(*args, check_values=True)


# ---------------------------------------------------------------- GPU: bf16 through the kernels

def _sm90():
    return torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


@pytest.mark.gpu
@pytest.mark.skipif(not _sm90(), reason="SM90 kernels need compute capability 9.0")
def test_gpu_explain_mla_picks_sm90():
    parts = _parts(1, 8, 8, 16, 16, 128, 64, 128, shared=True, dtype=torch.bfloat16, device="cuda", grad=False)
    e = M.explain_mla(*parts, causal=True)
    assert e.path == "native" and e.forward.backend == "sm90" and e.backward.backend == "sm90", str(e)
    assert e.forward.family == "fmha_fwd_sm90" and e.forward.op == "mla_fwd"


@pytest.mark.gpu
@pytest.mark.parametrize("shared", [True, False], ids=["kpe1", "kpeH"])
@pytest.mark.parametrize("causal,align", MASKS)
@pytest.mark.parametrize("hq,hkv", [(8, 8), (8, 2)])
def test_gpu_bf16_training_step_deepseek_dims(shared, causal, align, hq, hkv):
    """out and all five gradients at (128 + 64, 128), bf16, against a float32 naive MLA: error at most
    2x that of plain PyTorch attention in bf16 (FlashAttention's rule)."""
    B, Sq, Sk = 2, 177, 241
    g = torch.Generator(device="cuda").manual_seed(1)

    def r(*shape):
        return torch.randn(*shape, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_()

    parts = (r(B, Sq, hq, 128), r(B, Sq, hq, 64), r(B, Sk, hkv, 128), r(B, Sk, 1 if shared else hkv, 64),
             r(B, Sk, hkv, 128))
    w = torch.randn(B, Sq, hq, 128, device="cuda", dtype=torch.float32, generator=g)
    br = align == "bottom_right"

    def loss_of(out):
        return (out.float() * w).sum()

    out = M.mla_attention(*parts, causal=causal, causal_align=align)
    grads = torch.autograd.grad(loss_of(out), parts)

    pf = [t.detach().float().requires_grad_() for t in parts]
    ref = _naive_mla(*pf, causal=causal, bottom_right=br)[0]
    ref_grads = torch.autograd.grad(loss_of(ref), pf)
    low = _concat_naive_bf16(*parts, causal=causal, bottom_right=br)
    low_grads = torch.autograd.grad(loss_of(low), parts)

    assert_error_within(out, ref, low, name="out")
    for name, a, rg, b in zip(("dq_nope", "dq_pe", "dk_nope", "dk_pe", "dv"), grads, ref_grads, low_grads):
        assert_error_within(a, rg, b, name=name, factor=2.0, eps=1e-4)


def _concat_naive_bf16(q_nope, q_pe, k_nope, k_pe, v, *, causal, bottom_right, cu_q=None, cu_k=None):
    """Plain PyTorch attention in the inputs' dtype on the concatenated q / k (the rule's baseline)."""
    k = torch.cat([k_nope, k_pe.expand(*k_nope.shape[:-1], k_pe.shape[-1])], -1)
    return naive_attention(torch.cat([q_nope, q_pe], -1), k, v, causal=causal, bottom_right=bottom_right,
                           cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)


@pytest.mark.gpu
@pytest.mark.parametrize("causal,align", MASKS)
def test_gpu_bf16_varlen_deepseek_dims(causal, align):
    lq, lk = [65, 0, 130, 17], [80, 33, 130, 0]
    cq, ck = _cu(lq, "cuda"), _cu(lk, "cuda")
    parts = _parts(None, sum(lq), sum(lk), 8, 8, 128, 64, 128, shared=True, dtype=torch.bfloat16, device="cuda")
    br = align == "bottom_right"
    out = M.mla_attention_varlen(*parts, cq, ck, max(lq), max(lk), causal=causal, causal_align=align)
    do = torch.randn_like(out)
    grads = torch.autograd.grad(out, parts, do)
    pf = [t.detach().float().requires_grad_() for t in parts]
    ref = _naive_mla(*pf, causal=causal, bottom_right=br, cu_q=cq, cu_k=ck)[0]
    ref_grads = _grads(ref, pf, do.float())
    low = _concat_naive_bf16(*parts, causal=causal, bottom_right=br, cu_q=cq, cu_k=ck)
    low_grads = _grads(low, parts, do)
    assert_error_within(out, ref, low, name="out")
    for name, a, rg, b in zip(("dq_nope", "dq_pe", "dk_nope", "dk_pe", "dv"), grads, ref_grads, low_grads):
        assert_error_within(a, rg, b, name=name, factor=2.0, eps=1e-4)


# ---- parts that lie side by side: no concatenation where a split left them ----

def test_adjacent_parts_finds_the_tensor_a_split_left():
    from mla_autograd._ops import adjacent_parts
    x = torch.randn(2, 5, 3, 12)
    a, b = x.split([8, 4], dim=-1)
    whole = adjacent_parts(a, b)
    assert whole is not None and whole.data_ptr() == x.data_ptr() and whole.stride() == x.stride()
    assert torch.equal(whole, x)
    assert adjacent_parts(b, a) is None                                   # out of order
    assert adjacent_parts(a, b.clone()) is None                           # another storage
    y = torch.randn(2, 5, 3, 16)
    assert adjacent_parts(y[..., :8], y[..., 12:]) is None                # a gap between them
    assert adjacent_parts(y[..., :8], y[..., 8:12]) is not None           # a prefix of wider rows
    z = torch.randn(64)                                                   # rows of 4 holding parts 6 wide: overlap
    assert adjacent_parts(z.as_strided((4, 4), (4, 1)), z.as_strided((4, 2), (4, 1), 4)) is None
    assert adjacent_parts(a, b.to(torch.float64)) is None                 # dtypes differ
