"""mla_attention_packed / mla_attention_packed_varlen: MLA's query [q_nope | q_pe] and key/value [k_nope | v]
given whole, as MLA's projections produce them.

On CPU (reference path): bit-equality with mla_attention on the parts (outputs, lse, gradients), float64
gradcheck, the backward graph under torch.compile (no concatenation of the parts' gradients, where a split
before mla_attention has one), opcheck of both ops, every validation error. On an SM90 GPU: the same
bit-equality through the kernels, with dq and dkv leaving whole and contiguous.
"""
import math

import pytest
import torch

import mla_autograd as M
from mla_autograd.testing import assert_error_within, compiled_backward_graphs, graph_cats

DN, DR, DV = 8, 4, 6
MASKS = [(False, "bottom_right"), (True, "top_left"), (True, "bottom_right")]


def _cu(lens, device=None):
    return torch.tensor([0] + torch.tensor(lens, dtype=torch.int64).cumsum(0).tolist(), dtype=torch.int32,
                        device=device)


def _packed(lead_q, lead_k, hq, hkv, *, shared, dtype=torch.float64, device=None, grad=True, dims=(DN, DR, DV),
            generator=None):
    """q (*lead_q, hq, dn + dr), kv (*lead_k, hkv, dn + dv), k_pe (*lead_k, 1 or hkv, dr)."""
    dn, dr, dv = dims
    shapes = [(*lead_q, hq, dn + dr), (*lead_k, hkv, dn + dv), (*lead_k, 1 if shared else hkv, dr)]
    return tuple(torch.randn(*s, dtype=dtype, device=device, generator=generator).requires_grad_(grad)
                 for s in shapes)


def _parts_of(q, kv, k_pe, dn=DN):
    """mla_attention's five parts as separate leaf tensors holding q's, kv's and k_pe's values."""
    parts = (q[..., :dn], q[..., dn:], kv[..., :dn], k_pe, kv[..., dn:])
    return tuple(t.detach().clone().requires_grad_() for t in parts)


def _check_equal_to_parts(call_packed, call_parts, q, kv, k_pe, dn=DN):
    out, lse = call_packed(q, kv, k_pe)
    parts = _parts_of(q, kv, k_pe, dn)
    ref, ref_lse = call_parts(*parts)
    assert torch.equal(out, ref) and torch.equal(lse, ref_lse)
    dout = torch.randn_like(out)
    dq, dkv, dk_pe = torch.autograd.grad(out, (q, kv, k_pe), dout)
    g = torch.autograd.grad(ref, parts, dout)
    assert torch.equal(dq, torch.cat([g[0], g[1]], -1))
    assert torch.equal(dkv, torch.cat([g[2], g[4]], -1))
    assert torch.equal(dk_pe, g[3])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("shared", [True, False], ids=["kpe1", "kpeH"])
@pytest.mark.parametrize("causal,align", MASKS)
def test_equals_mla_attention_on_the_parts(dtype, shared, causal, align):
    q, kv, k_pe = _packed((2, 5), (2, 7), 4, 2, shared=shared, dtype=dtype)
    kw = dict(causal=causal, causal_align=align, return_lse=True)
    _check_equal_to_parts(lambda *t: M.mla_attention_packed(*t, **kw), lambda *p: M.mla_attention(*p, **kw),
                          q, kv, k_pe)


@pytest.mark.parametrize("shared", [True, False], ids=["kpe1", "kpeH"])
def test_varlen_equals_mla_attention_varlen_on_the_parts(shared):
    lq, lk = [3, 0, 5], [4, 2, 5]
    cq, ck = _cu(lq), _cu(lk)
    q, kv, k_pe = _packed((sum(lq),), (sum(lk),), 4, 2, shared=shared)
    kw = dict(causal=True, return_lse=True, check_values=True)
    _check_equal_to_parts(lambda *t: M.mla_attention_packed_varlen(*t, cq, ck, 5, 5, **kw),
                          lambda *p: M.mla_attention_varlen(*p, cq, ck, 5, 5, **kw), q, kv, k_pe)


def test_default_softmax_scale_and_strided_inputs():
    """The default scale is 1/sqrt(Dn + Dr); q and kv may be views with wider rows (unit last stride)."""
    wide_q = torch.randn(2, 5, 4, DN + DR + 3, dtype=torch.float64)
    wide_kv = torch.randn(2, 7, 2, DN + DV + 5, dtype=torch.float64)
    q, kv = wide_q[..., 3:], wide_kv[..., :DN + DV]
    k_pe = torch.randn(2, 7, 1, DR, dtype=torch.float64)
    out = M.mla_attention_packed(q, kv, k_pe, causal=True)
    assert torch.equal(out, M.mla_attention_packed(q, kv, k_pe, causal=True, softmax_scale=1.0 / math.sqrt(DN + DR)))
    torch.testing.assert_close(out, M.mla_attention_packed(q.contiguous(), kv.contiguous(), k_pe, causal=True))


@pytest.mark.parametrize("shared", [True, False], ids=["kpe1", "kpeH"])
@pytest.mark.parametrize("causal,align", MASKS)
def test_gradcheck(shared, causal, align):
    q, kv, k_pe = _packed((1, 3), (1, 4), 2, 1, shared=shared, dims=(4, 2, 3))
    torch.autograd.gradcheck(lambda *t: M.mla_attention_packed(*t, causal=causal, causal_align=align), (q, kv, k_pe))
    cu = _cu([2, 0, 3])
    q, kv, k_pe = _packed((5,), (5,), 2, 1, shared=shared, dims=(4, 2, 3))
    torch.autograd.gradcheck(lambda *t: M.mla_attention_packed_varlen(*t, cu, cu, 3, 3, causal=causal,
                                                                       causal_align=align), (q, kv, k_pe))


def test_compiled_backward_hands_on_gradients_whole():
    """Under torch.compile the backward of q.split / kv.split before mla_attention concatenates the parts'
    gradients (one copy of q and of kv); mla_attention_packed's backward op returns dq and dkv whole: no cat."""
    q, kv, k_pe = _packed((2, 5), (2, 5), 4, 2, shared=True, dtype=torch.float32)

    def split_call(q_, kv_, k_pe_):
        q_nope, q_pe = q_.split([DN, DR], -1)
        k_nope, v = kv_.split([DN, DV], -1)
        return M.mla_attention(q_nope, q_pe, k_nope, k_pe_, v, causal=True)

    cats = graph_cats(compiled_backward_graphs(lambda *t: split_call(*t).sum(), q, kv, k_pe))
    assert sorted(cats) == [(2, 5, 2, DN + DV), (2, 5, 4, DN + DR)]  # the split path's: dq and dkv, one copy each
    graphs = compiled_backward_graphs(lambda *t: M.mla_attention_packed(*t, causal=True).sum(), q, kv, k_pe)
    assert graphs and not graph_cats(graphs)
    assert any("mla_attn_packed_bwd" in str(n.target) for g in graphs for n in g.graph.nodes)
    # and the compiled call computes what the eager one does
    q.grad = kv.grad = k_pe.grad = None
    torch._dynamo.reset()
    f = torch.compile(lambda *t: M.mla_attention_packed(*t, causal=True).square().sum(), fullgraph=True,
                      backend="aot_eager")
    gc = torch.autograd.grad(f(q, kv, k_pe), (q, kv, k_pe))
    ge = torch.autograd.grad(M.mla_attention_packed(q, kv, k_pe, causal=True).square().sum(), (q, kv, k_pe))
    for a, b in zip(gc, ge):
        torch.testing.assert_close(a, b)


def test_opcheck_packed_ops():
    """Both ops' schemas, fake implementations (dq, dkv, dk_pe of their inputs' shapes), registered autograd and
    AOT dispatch, dense and varlen, k_pe with one head and with Hkv."""
    fwd = torch.ops.mla_autograd.mla_attn_packed_fwd.default
    bwd = torch.ops.mla_autograd.mla_attn_packed_bwd.default
    for shared in (True, False):
        for varlen in (False, True):
            cu = _cu([3, 0, 4]) if varlen else None
            lead_q, lead_k = ((7,), (7,)) if varlen else ((2, 5), (2, 7))
            seq = (cu, cu, 4, 4) if varlen else (None, None, 5, 7)
            q, kv, k_pe = _packed(lead_q, lead_k, 4, 2, shared=shared, dtype=torch.float32)
            torch.library.opcheck(fwd, (q, kv, k_pe, DN, *seq, 0.3, True, True, False))
            d = [t.detach() for t in (q, kv, k_pe)]
            out, lse = fwd(*d, DN, *seq, 0.3, True, True, False)
            args = (torch.randn_like(out), *d, out, lse, DN, *seq, 0.3, True, True, False)
            torch.library.opcheck(bwd, args)
            dq, dkv, dk_pe = bwd(*args)
            assert dq.shape == q.shape and dkv.shape == kv.shape and dk_pe.shape == k_pe.shape


def _ok():
    return [torch.randn(2, 5, 4, DN + DR), torch.randn(2, 6, 2, DN + DV), torch.randn(2, 6, 1, DR)]


@pytest.mark.parametrize("mutate,exc,match", [
    (lambda p: [p[0][0], *p[1:]], ValueError, "q must have 4 dimensions"),
    (lambda p: [p[0], p[1][None], p[2]], ValueError, "kv must have 4 dimensions"),
    (lambda p: [p[0], p[1], None], TypeError, "k_pe must be a torch.Tensor"),
    (lambda p: [p[0].int(), *p[1:]], TypeError, "q must be bfloat16"),
    (lambda p: [p[0], p[1].double(), p[2]], TypeError, "kv has dtype float64 but q has float32"),
    (lambda p: [p[0], p[1], p[2].to("meta")], ValueError, "k_pe is on meta but q is on cpu"),
    (lambda p: [p[0], p[1].transpose(-1, -2).contiguous().transpose(-1, -2), p[2]], ValueError,
     "kv must have stride 1 in its last dimension"),
    (lambda p: [p[0], p[1], p[2][..., :0]], ValueError, r"k_pe head dim \(0\) must be positive and smaller"),
    (lambda p: [p[0][..., :DR], p[1], p[2]], ValueError, r"k_pe head dim \(4\) must be positive and smaller than q's"),
    (lambda p: [p[0], p[1][..., :DN], p[2]], ValueError, r"kv head dim \(8\) must exceed the nope dim 8"),
    (lambda p: [p[0], p[1][:1], p[2][:1]], ValueError, "kv batch size 1 must equal q batch size 2"),
    (lambda p: [p[0][:, :, :3], *p[1:]], ValueError, r"query heads \(3, q\) must be a multiple of the number of key/value heads \(2\) in kv"),
    (lambda p: [p[0], p[1], p[2][:, :5]], ValueError, r"k_pe shape .* must match kv shape .* in \(B, Sk\)"),
    (lambda p: [p[0], p[1], p[2].expand(2, 6, 3, DR)], ValueError, r"k_pe must have 1 head .* \(2\), got 3"),
])
def test_argument_errors(mutate, exc, match):
    M.mla_attention_packed(*_ok())
    with pytest.raises(exc, match=match):
        M.mla_attention_packed(*mutate(_ok()))


def test_varlen_argument_errors():
    q, kv, k_pe = torch.randn(7, 4, DN + DR), torch.randn(9, 2, DN + DV), torch.randn(9, 1, DR)
    cq, ck = _cu([3, 4]), _cu([4, 5])
    M.mla_attention_packed_varlen(q, kv, k_pe, cq, ck, 4, 5)
    cases = [
        ((q[None], kv, k_pe, cq, ck, 4, 5), ValueError, "q must have 3 dimensions"),
        ((q, kv, k_pe[:8], cq, ck, 4, 5), ValueError, r"k_pe shape .* in \(Tk,\)"),
        ((q, kv, k_pe, cq.long(), ck, 4, 5), TypeError, "cu_seqlens_q must be int32"),
        ((q, kv, k_pe, cq, ck.to("meta"), 4, 5), ValueError, "cu_seqlens_k is on meta but q is on cpu"),
        ((q, kv, k_pe, cq, ck, -1, 5), ValueError, "max_seqlen_q must be a non-negative int"),
        ((q, kv, k_pe, cq, _cu([4, 4]), 4, 5), ValueError,
         r"cu_seqlens_k\[-1\] = 8 must equal the number of packed tokens \(9\)"),
    ]
    for args, exc, match in cases:
        with pytest.raises(exc, match=match):
            M.mla_attention_packed_varlen(*args, check_values=True)


# ---------------------------------------------------------------- GPU: bf16 through the SM90 kernels

def _sm90():
    return torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


@pytest.mark.gpu
@pytest.mark.skipif(not _sm90(), reason="SM90 kernels need compute capability 9.0")
@pytest.mark.parametrize("varlen", [False, True], ids=["dense", "varlen"])
@pytest.mark.parametrize("shared", [True, False], ids=["kpe1", "kpeH"])
def test_gpu_equals_mla_attention_on_the_parts(varlen, shared):
    """DeepSeek's dims in bf16: out, lse and every gradient equal, bit for bit, mla_attention's on the parts as
    separate tensors (deterministic backward); dq and dkv leave whole and contiguous, the kernel having written
    dk_nope and dv into dkv's halves; and the result is within FlashAttention's rule of float64 attention."""
    g = torch.Generator(device="cuda").manual_seed(3)
    lens = [77, 0, 130]
    lead = (sum(lens),) if varlen else (2, 97)
    q, kv, k_pe = _packed(lead, lead, 8, 2, shared=shared, dtype=torch.bfloat16, device="cuda",
                          dims=(128, 64, 128), generator=g)
    cu = _cu(lens, "cuda")
    kw = dict(causal=True, deterministic=True, return_lse=True)
    if varlen:
        call_packed = lambda *t: M.mla_attention_packed_varlen(*t, cu, cu, max(lens), max(lens), **kw)  # noqa: E731
        call_parts = lambda *p: M.mla_attention_varlen(*p, cu, cu, max(lens), max(lens), **kw)  # noqa: E731
    else:
        call_packed = lambda *t: M.mla_attention_packed(*t, **kw)  # noqa: E731
        call_parts = lambda *p: M.mla_attention(*p, **kw)  # noqa: E731
    _check_equal_to_parts(call_packed, call_parts, q, kv, k_pe, dn=128)
    out, _ = call_packed(q, kv, k_pe)
    dout = torch.randn(out.shape, device="cuda", dtype=torch.bfloat16, generator=g)
    dq, dkv, _ = torch.autograd.grad(out, (q, kv, k_pe), dout)
    assert dq.is_contiguous() and dkv.is_contiguous()
    ref, _ = (lambda *t: M.mla_attention_packed_varlen(*t, cu.cpu(), cu.cpu(), max(lens), max(lens), **kw)
              if varlen else M.mla_attention_packed(*t, **kw))(*(t.detach().double().cpu() for t in (q, kv, k_pe)))
    naive = _naive_bf16(_parts_of(q, kv, k_pe, 128), cu if varlen else None)
    assert_error_within(out, ref.to(out.device), naive, name="packed out")


def _naive_bf16(parts, cu):
    """Plain PyTorch attention in bf16 on the concatenated parts (the tolerance rule's baseline)."""
    from mla_autograd.testing import naive_attention
    q_nope, q_pe, k_nope, k_pe, v = (t.detach() for t in parts)
    k_pe = k_pe.expand(*k_nope.shape[:-1], k_pe.shape[-1])
    q, k = torch.cat([q_nope, q_pe], -1), torch.cat([k_nope, k_pe], -1)
    kw = dict(cu_seqlens_q=cu, cu_seqlens_k=cu) if cu is not None else {}
    return naive_attention(q, k, v, softmax_scale=q.shape[-1] ** -0.5, causal=True, bottom_right=True, **kw)
