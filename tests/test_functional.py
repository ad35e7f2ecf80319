"""The public API on CPU: float64 gradcheck, property tests against the naive version, semantics."""
import math

import pytest
import torch
from hypothesis import given, settings, strategies as st

import mla_autograd as M
from mla_autograd.testing import naive_attention


def _rand(*shape, dtype=torch.float64, grad=True):
    return torch.randn(*shape, dtype=dtype).requires_grad_(grad)


def _cu(lens):
    return torch.tensor([0] + torch.tensor(lens, dtype=torch.int64).cumsum(0).tolist(), dtype=torch.int32)


ALIGN = ["top_left", "bottom_right"]


@pytest.mark.parametrize("causal,align", [(False, "bottom_right"), (True, "top_left"), (True, "bottom_right")])
@pytest.mark.parametrize("sq,sk", [(5, 5), (3, 7), (7, 3)])
@pytest.mark.parametrize("hq,hkv", [(2, 2), (4, 2), (3, 1)])
def test_gradcheck_dense(causal, align, sq, sk, hq, hkv):
    q, k, v = _rand(2, sq, hq, 6), _rand(2, sk, hkv, 6), _rand(2, sk, hkv, 4)
    assert torch.autograd.gradcheck(
        lambda q, k, v: M.attention(q, k, v, causal=causal, causal_align=align, softmax_scale=0.7), (q, k, v))


@pytest.mark.parametrize("causal,align", [(False, "bottom_right"), (True, "top_left"), (True, "bottom_right")])
def test_gradcheck_varlen(causal, align):
    lq, lk = [3, 0, 4, 2], [2, 3, 5, 0]  # empty sequences both sides, Sq > Sk and Sq < Sk
    q, k, v = _rand(sum(lq), 4, 6), _rand(sum(lk), 2, 6), _rand(sum(lk), 2, 5)
    cq, ck = _cu(lq), _cu(lk)
    assert torch.autograd.gradcheck(
        lambda q, k, v: M.attention_varlen(q, k, v, cq, ck, max(lq), max(lk), causal=causal, causal_align=align),
        (q, k, v))


def test_gradcheck_rows_with_no_key():
    # bottom-right, Sq > Sk: the first Sq - Sk rows see nothing: zero output, zero gradient, no NaN
    q, k, v = _rand(1, 6, 2, 4), _rand(1, 2, 2, 4), _rand(1, 2, 2, 4)
    out, lse = M.attention(q, k, v, causal=True, return_lse=True)
    assert (out[:, :4] == 0).all() and torch.isneginf(lse[..., :4]).all()
    out.sum().backward()
    assert torch.isfinite(q.grad).all() and (q.grad[:, :4] == 0).all()
    q.grad = None
    assert torch.autograd.gradcheck(lambda q, k, v: M.attention(q, k, v, causal=True), (q, k, v))


@settings(max_examples=30, deadline=None)
@given(B=st.integers(1, 3), Sq=st.integers(0, 8), Sk=st.integers(0, 8), Hkv=st.sampled_from([1, 2]),
       G=st.sampled_from([1, 2, 4]), dims=st.sampled_from([(16, 16), (24, 16), (8, 8)]),
       causal=st.booleans(), align=st.sampled_from(ALIGN))
def test_property_dense_matches_naive(B, Sq, Sk, Hkv, G, dims, causal, align):
    q, k, v = _rand(B, Sq, Hkv * G, dims[0]), _rand(B, Sk, Hkv, dims[0]), _rand(B, Sk, Hkv, dims[1])
    out = M.attention(q, k, v, causal=causal, causal_align=align)
    ref = naive_attention(q, k, v, causal=causal, bottom_right=align == "bottom_right")
    torch.testing.assert_close(out, ref)
    if out.numel() == 0:
        return
    do = torch.randn_like(out)
    g = torch.autograd.grad(out, (q, k, v), do, allow_unused=True)
    gn = torch.autograd.grad(ref, (q, k, v), do, allow_unused=True)
    for a, b, t in zip(g, gn, (q, k, v)):
        torch.testing.assert_close(a if a is not None else torch.zeros_like(t),
                                   b if b is not None else torch.zeros_like(t))


@settings(max_examples=30, deadline=None)
@given(lens=st.lists(st.tuples(st.integers(0, 6), st.integers(0, 6)), min_size=1, max_size=4),
       Hkv=st.sampled_from([1, 2]), G=st.sampled_from([1, 3]), causal=st.booleans(), align=st.sampled_from(ALIGN))
def test_property_varlen_matches_naive(lens, Hkv, G, causal, align):
    lq, lk = [a for a, _ in lens], [b for _, b in lens]
    q, k, v = _rand(sum(lq), Hkv * G, 8), _rand(sum(lk), Hkv, 8), _rand(sum(lk), Hkv, 4)
    cq, ck = _cu(lq), _cu(lk)
    out, lse = M.attention_varlen(q, k, v, cq, ck, max(lq), max(lk), causal=causal, causal_align=align,
                                  return_lse=True)
    assert lse.shape == (Hkv * G, sum(lq))
    ref = naive_attention(q, k, v, causal=causal, bottom_right=align == "bottom_right", cu_seqlens_q=cq,
                          cu_seqlens_k=ck)
    torch.testing.assert_close(out, ref)
    if out.numel() == 0 or sum(lk) == 0:
        return
    do = torch.randn_like(out)
    g = torch.autograd.grad(out, (q, k, v), do, allow_unused=True)
    gn = torch.autograd.grad(ref, (q, k, v), do, allow_unused=True)
    for a, b, t in zip(g, gn, (q, k, v)):
        torch.testing.assert_close(a if a is not None else torch.zeros_like(t),
                                   b if b is not None else torch.zeros_like(t))


def test_return_lse_shapes_dtypes_and_default_scale():
    q, k, v = _rand(2, 5, 4, 12, dtype=torch.float32), _rand(2, 7, 2, 12, dtype=torch.float32), \
        _rand(2, 7, 2, 8, dtype=torch.float32)
    out, lse = M.attention(q, k, v, return_lse=True)
    assert out.shape == (2, 5, 4, 8) and out.dtype == torch.float32
    assert lse.shape == (2, 4, 5) and lse.dtype == torch.float32 and not lse.requires_grad
    s = torch.einsum("bihd,bjhd->bhij", q, k.repeat_interleave(2, 2)) / math.sqrt(12)
    torch.testing.assert_close(lse, torch.logsumexp(s, -1))


def test_non_contiguous_inputs():
    base = torch.randn(2, 6, 4, 3, 16, dtype=torch.float64)
    q = base[:, :, :, 0]          # strided heads/rows, unit last stride
    k = base[:, :, :2, 1]
    v = base[:, :, :2, 2, :8]
    assert not q.is_contiguous()
    out = M.attention(q, k, v, causal=True)
    torch.testing.assert_close(out, naive_attention(q, k, v, causal=True))


def test_double_backward_raises():
    q, k, v = _rand(1, 3, 2, 4), _rand(1, 3, 2, 4), _rand(1, 3, 2, 4)
    out = M.attention(q, k, v)
    (gq,) = torch.autograd.grad(out.sum(), q, create_graph=True)
    with pytest.raises(RuntimeError, match="double backward"):
        torch.autograd.grad(gq.sum(), q)


def test_deterministic_flag_reproducible():
    q, k, v = _rand(1, 9, 4, 8), _rand(1, 9, 2, 8), _rand(1, 9, 2, 8)
    grads = []
    for _ in range(3):
        out = M.attention(q, k, v, causal=True, deterministic=True)
        grads.append(torch.autograd.grad(out.sum(), (q, k, v)))
    for g in grads[1:]:
        for a, b in zip(g, grads[0]):
            assert torch.equal(a, b)


def test_bfloat16_cpu_training_step():
    q, k, v = (_rand(2, 16, 4, 32, dtype=torch.bfloat16), _rand(2, 16, 2, 32, dtype=torch.bfloat16),
               _rand(2, 16, 2, 32, dtype=torch.bfloat16))
    out = M.attention(q, k, v, causal=True)
    out.float().square().mean().backward()
    assert q.grad.dtype == torch.bfloat16 and torch.isfinite(q.grad.float()).all()
