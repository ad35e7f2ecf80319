"""The reference path against the naive dense softmax(QK^T)V (plain autograd), incl. chunking."""
import pytest
import torch
from hypothesis import given, settings, strategies as st

import mla_autograd as M
from mla_autograd import reference as R
from mla_autograd import testing as T
from mla_autograd.testing import naive_attention


def _grads(fn, inputs, dout):
    out = fn(*inputs)
    return out, torch.autograd.grad(out, inputs, dout, allow_unused=True)


@settings(max_examples=40, deadline=None)
@given(B=st.integers(1, 2), Sq=st.integers(0, 9), Sk=st.integers(0, 9), Hkv=st.sampled_from([1, 2]),
       G=st.sampled_from([1, 3]), dims=st.sampled_from([(8, 8), (12, 4), (5, 7)]), causal=st.booleans(),
       bottom_right=st.booleans())
def test_reference_matches_naive_dense(B, Sq, Sk, Hkv, G, dims, causal, bottom_right):
    Dqk, Dv = dims
    q = torch.randn(B, Sq, Hkv * G, Dqk, dtype=torch.float64, requires_grad=True)
    k = torch.randn(B, Sk, Hkv, Dqk, dtype=torch.float64, requires_grad=True)
    v = torch.randn(B, Sk, Hkv, Dv, dtype=torch.float64, requires_grad=True)
    kw = dict(softmax_scale=0.37, causal=causal, bottom_right=bottom_right)
    out, lse = R.attention_forward(q, k, v, **kw)
    ref = naive_attention(q, k, v, **kw)
    torch.testing.assert_close(out, ref)
    do = torch.randn_like(ref)
    if ref.numel() and Sk:
        g_naive = torch.autograd.grad(ref, (q, k, v), do)
    else:
        g_naive = (torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v))
    g_ref = R.attention_backward(do, q, k, v, out, lse, **kw)
    for a, b in zip(g_ref, g_naive):
        torch.testing.assert_close(a, b)


def test_lse_is_logsumexp_and_empty_rows():
    q = torch.randn(1, 4, 2, 8, dtype=torch.float64)
    k = torch.randn(1, 2, 2, 8, dtype=torch.float64)
    v = torch.randn(1, 2, 2, 8, dtype=torch.float64)
    out, lse = R.attention_forward(q, k, v, softmax_scale=0.5, causal=True, bottom_right=True)
    # bottom-right with Sq=4 > Sk=2: rows 0 and 1 see no key
    assert torch.isneginf(lse[0, :, :2]).all()
    assert (out[0, :2] == 0).all()
    s = torch.einsum("bihd,bjhd->bhij", q, k) * 0.5
    mask = torch.tril(torch.ones(4, 2, dtype=torch.bool), diagonal=-2)
    expect = torch.logsumexp(s.masked_fill(~mask, float("-inf")), dim=-1)
    torch.testing.assert_close(lse[0, :, 2:], expect[0, :, 2:])


def test_chunking_is_exact(monkeypatch):
    q = torch.randn(2, 37, 4, 16, dtype=torch.float64)
    k = torch.randn(2, 29, 2, 16, dtype=torch.float64)
    v = torch.randn(2, 29, 2, 8, dtype=torch.float64)
    do = torch.randn(2, 37, 4, 8, dtype=torch.float64)
    kw = dict(softmax_scale=0.25, causal=True, bottom_right=False)
    full = R.attention_forward(q, k, v, **kw)
    gfull = R.attention_backward(do, q, k, v, *full, **kw)
    monkeypatch.setattr(R, "_CHUNK_ELEMS", 2 * 4 * 29 * 3)  # 3 query rows per chunk
    chunked = R.attention_forward(q, k, v, **kw)
    gchunk = R.attention_backward(do, q, k, v, *chunked, **kw)
    for a, b in zip(full + gfull, chunked + gchunk):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-12)


def test_varlen_equals_per_sequence_dense():
    lens_q, lens_k = [3, 0, 5, 1], [4, 2, 0, 6]
    cu_q = torch.tensor([0] + torch.tensor(lens_q).cumsum(0).tolist(), dtype=torch.int32)
    cu_k = torch.tensor([0] + torch.tensor(lens_k).cumsum(0).tolist(), dtype=torch.int32)
    q = torch.randn(sum(lens_q), 4, 8, dtype=torch.float64)
    k = torch.randn(sum(lens_k), 2, 8, dtype=torch.float64)
    v = torch.randn(sum(lens_k), 2, 6, dtype=torch.float64)
    kw = dict(softmax_scale=0.3, causal=True, bottom_right=True)
    out, lse = R.attention_forward(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=5,
                                   max_seqlen_k=6, **kw)
    for b in range(4):
        qs, qe, ks, ke = cu_q[b], cu_q[b + 1], cu_k[b], cu_k[b + 1]
        o, l = R.attention_forward(q[None, qs:qe], k[None, ks:ke], v[None, ks:ke], **kw)
        torch.testing.assert_close(out[qs:qe], o[0])
        torch.testing.assert_close(lse[:, qs:qe], l[0])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_low_precision_inputs_computed_in_float32(dtype):
    q = torch.randn(1, 9, 2, 16).to(dtype)
    k = torch.randn(1, 11, 2, 16).to(dtype)
    v = torch.randn(1, 11, 2, 16).to(dtype)
    out, lse = R.attention_forward(q, k, v, softmax_scale=0.25, causal=False, bottom_right=True)
    assert out.dtype == dtype and lse.dtype == torch.float32
    ref, _ = R.attention_forward(q.double(), k.double(), v.double(), softmax_scale=0.25, causal=False,
                                 bottom_right=True)
    torch.testing.assert_close(out.double(), ref, atol=2e-2 if dtype == torch.bfloat16 else 2e-3, rtol=0)


# ---- values that break the rules: the reference path is the spec the kernels follow (testing.BAD_*) ----

@pytest.mark.parametrize("case", T.BAD_VARLEN_CASES, ids=lambda c: c.name)
@pytest.mark.parametrize("causal", [False, True])
def test_varlen_bad_values_take_the_clamped_ranges(case, causal):
    g = torch.Generator().manual_seed(3)
    tq, tk = T.BAD_VARLEN_ROWS
    q = torch.randn(tq, 4, 8, generator=g, dtype=torch.float64, requires_grad=True)
    k = torch.randn(tk, 2, 8, generator=g, dtype=torch.float64, requires_grad=True)
    v = torch.randn(tk, 2, 6, generator=g, dtype=torch.float64, requires_grad=True)
    dout = torch.randn(tq, 4, 6, generator=g, dtype=torch.float64)
    cq, ck = (torch.tensor(c, dtype=torch.int32) for c in (case.cu_q, case.cu_k))
    out, lse = M.attention_varlen(q, k, v, cq, ck, case.max_q, case.max_k, causal=causal, return_lse=True)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    if case.overlapping:
        return  # races where the ranges overlap: only that it runs
    want = T.varlen_expected(q, k, v, dout, case.ranges_q, case.ranges_k, softmax_scale=8 ** -0.5, causal=causal,
                             bottom_right=True)
    covered = ~torch.isnan(want[0][:, 0, 0])
    torch.testing.assert_close(out[covered], want[0][covered])
    torch.testing.assert_close(lse[:, covered], want[1][:, covered])
    for got, w in zip(grads, want[2:]):
        torch.testing.assert_close(got, w)  # rows no range covers: 0


@pytest.mark.parametrize("seqlen_q", [1, 2])
def test_decode_bad_values_compute_the_repaired_problem(seqlen_q):
    bad, valid = T.bad_decode_case(seqlen_q=seqlen_q, num_heads=2, page_size=4, dim_ckv=16, dim_kpe=8,
                                   dtype=torch.float64, generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        got = M.decode(**bad, softmax_scale=0.2, return_lse=True)
        want = M.decode(**valid, softmax_scale=0.2, return_lse=True)
    torch.testing.assert_close(got, want)
    assert torch.all(got[0][0] == 0) and torch.all(got[1][0] == float("-inf"))  # negative length: idle
    if seqlen_q == 2:  # a request of seqlen_q - 1 tokens: its first new token sees nothing
        assert torch.all(got[0][5, 0] == 0) and torch.all(got[1][5, :, 0] == float("-inf"))
