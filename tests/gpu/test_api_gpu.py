"""The public API on a GPU: the dispatch table routes to the kernels, and a whole training step
through autograd matches the reference path's gradients (the rule: error <= 2x plain PyTorch's)."""
import itertools

import pytest
import torch

import mla_autograd as M
from mla_autograd import testing as T
from mla_autograd.testing import assert_error_within, naive_attention

pytestmark = pytest.mark.gpu

DIMS = [(192, 128), (128, 128), (64, 64)]


def _has_cap(major, minor=None):
    if not torch.cuda.is_available():
        return False
    cap = torch.cuda.get_device_capability()
    return cap[0] == major and (minor is None or cap[1] == minor)


@pytest.mark.skipif(not _has_cap(9, 0), reason="SM90 kernels need compute capability 9.0")
@pytest.mark.parametrize("dims", DIMS)
def test_dispatch_picks_sm90(dims):
    q = torch.randn(1, 8, 2, dims[0], device="cuda", dtype=torch.bfloat16)
    v = torch.randn(1, 8, 2, dims[1], device="cuda", dtype=torch.bfloat16)
    e = M.explain(q, q, v, causal=True)
    assert e.forward.backend == "sm90", str(e)
    assert e.backward.backend == "sm90", str(e)


@pytest.mark.parametrize("dims", DIMS)
@pytest.mark.parametrize("causal,align", [(False, "bottom_right"), (True, "top_left"), (True, "bottom_right")])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_training_step_matches_reference(dims, causal, align, dtype):
    """loss.backward through the public API (whatever backend serves it) vs the float32 reference."""
    B, Sq, Sk, Hq, Hkv = 2, 177, 241, 8, 2
    dqk, dv = dims
    g = torch.Generator(device="cuda").manual_seed(1)
    q = torch.randn(B, Sq, Hq, dqk, device="cuda", dtype=dtype, generator=g).requires_grad_()
    k = torch.randn(B, Sk, Hkv, dqk, device="cuda", dtype=dtype, generator=g).requires_grad_()
    v = torch.randn(B, Sk, Hkv, dv, device="cuda", dtype=dtype, generator=g).requires_grad_()
    w = torch.randn(B, Sq, Hq, dv, device="cuda", dtype=torch.float32, generator=g)
    br = align == "bottom_right"

    def loss_of(out):
        return (out.float() * w).sum()

    out = M.attention(q, k, v, causal=causal, causal_align=align)
    grads = torch.autograd.grad(loss_of(out), (q, k, v))

    qf, kf, vf = (t.detach().float().requires_grad_() for t in (q, k, v))
    ref = naive_attention(qf, kf, vf, causal=causal, bottom_right=br)
    ref_grads = torch.autograd.grad(loss_of(ref), (qf, kf, vf))
    low = naive_attention(q, k, v, causal=causal, bottom_right=br)
    low_grads = torch.autograd.grad(loss_of(low), (q, k, v))

    assert_error_within(out, ref, low, name="out")
    for name, a, r, b in zip(("dq", "dk", "dv"), grads, ref_grads, low_grads):
        assert_error_within(a, r, b, name=name, factor=2.0, eps=1e-4)


# ---- values that break the rules (no value checks, the default): the kernels follow the reference's rule ----

def _rows(ranges):
    return torch.cat([torch.arange(s, e) for s, e in ranges]) if ranges else torch.zeros(0, dtype=torch.long)


@pytest.mark.skipif(not _has_cap(9, 0), reason="SM90 kernels need compute capability 9.0")
@pytest.mark.parametrize("case", T.BAD_VARLEN_CASES, ids=lambda c: c.name)
@pytest.mark.parametrize("dims", [(192, 128), (64, 64)])
@pytest.mark.parametrize("causal", [False, True])
def test_varlen_bad_values_on_the_kernels(case, dims, causal, monkeypatch):
    """attention_varlen with bad cu_seqlens / max_seqlen: forward and backward on the SM90 kernels compute the
    sequences of the clamped ranges (testing.BAD_VARLEN_CASES), within 2x plain PyTorch's error on those
    sequences gathered into a valid packed batch; gradients of rows no range covers are 0. Overlapping
    ranges: no fault (the outputs race)."""
    monkeypatch.delenv("MLA_AUTOGRAD_CHECK_VALUES", raising=False)
    dqk, dv = dims
    tq, tk = T.BAD_VARLEN_ROWS
    g = torch.Generator(device="cuda").manual_seed(5)
    q = torch.randn(tq, 4, dqk, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_()
    k = torch.randn(tk, 2, dqk, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_()
    v = torch.randn(tk, 2, dv, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_()
    dout = torch.randn(tq, 4, dv, device="cuda", dtype=torch.bfloat16, generator=g)
    cq, ck = (torch.tensor(c, dtype=torch.int32, device="cuda") for c in (case.cu_q, case.cu_k))
    assert M.explain(q, k, v, causal=causal, varlen=True).forward.backend == "sm90"
    out = M.attention_varlen(q, k, v, cq, ck, case.max_q, case.max_k, causal=causal)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    torch.cuda.synchronize()
    if case.overlapping:
        return
    iq, ik = _rows(case.ranges_q).cuda(), _rows(case.ranges_k).cuda()
    cu_valid_q, cu_valid_k = (torch.tensor([0, *itertools.accumulate(e - s for s, e in r)], dtype=torch.int32,
                                           device="cuda") for r in (case.ranges_q, case.ranges_k))

    def gathered(dtype):
        qq, kk, vv = (t.detach()[i].to(dtype).requires_grad_() for t, i in ((q, iq), (k, ik), (v, ik)))
        o = naive_attention(qq, kk, vv, causal=causal, bottom_right=True, cu_seqlens_q=cu_valid_q,
                            cu_seqlens_k=cu_valid_k)
        return (o, *torch.autograd.grad(o, (qq, kk, vv), dout[iq].to(dtype)))

    ref, base = gathered(torch.float64), gathered(torch.bfloat16)
    mine = (out[iq], grads[0][iq], grads[1][ik], grads[2][ik])
    for n, a, r, b in zip(("out", "dq", "dk", "dv"), mine, ref, base):
        assert_error_within(a, r, b, name=f"{case.name} {n}")
    for n, grad, idx, rows in (("dq", grads[0], iq, tq), ("dk", grads[1], ik, tk), ("dv", grads[2], ik, tk)):
        uncovered = torch.ones(rows, dtype=torch.bool, device="cuda")
        uncovered[idx] = False
        assert torch.all(grad[uncovered] == 0), f"{case.name}: {n} of rows no sequence covers"


@pytest.mark.parametrize("seqlen_q,num_heads", [(1, 16), (2, 16), (1, 128), (2, 64)])
@pytest.mark.parametrize("planned", [False, True])
def test_decode_bad_values_on_the_kernel(seqlen_q, num_heads, planned, monkeypatch):
    """decode with bad cache_seqlens / block_table (testing.bad_decode_case; NaN-poisoned unused pages): the
    kernel computes the repaired problem (lengths clamped, bad pages read as zeros), with and without a
    schedule planned by decode_schedule (which has no block_table: the kernel clamps its ranges)."""
    monkeypatch.delenv("MLA_AUTOGRAD_CHECK_VALUES", raising=False)
    bad, valid = T.bad_decode_case(seqlen_q=seqlen_q, num_heads=num_heads, device="cuda",
                                   generator=torch.Generator().manual_seed(6))
    assert M.explain_decode(bad["q_nope"], bad["q_pe"], bad["ckv_cache"]).decode.backend != "reference"
    with torch.inference_mode():
        kw = {}
        if planned:
            kw["schedule"] = M.decode_schedule(bad["cache_seqlens"], seqlen_q=seqlen_q, num_heads=num_heads)
        out, lse = M.decode(**bad, softmax_scale=0.1, return_lse=True, **kw)
        want_out, want_lse = M.decode(**valid, softmax_scale=0.1, return_lse=True)
        torch.cuda.synchronize()
    torch.testing.assert_close(out, want_out, atol=2e-3, rtol=1e-2)
    torch.testing.assert_close(lse, want_lse, atol=1e-4, rtol=1e-4)
    assert torch.all(out[0] == 0) and torch.all(lse[0] == float("-inf"))
    assert not torch.isnan(out).any()


def _decode_inputs(B=3, Sq=1, H=16, page=64, max_pages=5, seed=0):
    g = torch.Generator().manual_seed(seed)
    P = B * max_pages + 2
    cache = torch.randn(P, page, 576, generator=g).to(device="cuda", dtype=torch.bfloat16)
    lens = torch.randint(Sq, max_pages * page + 1, (B,), generator=g).to(device="cuda", dtype=torch.int32)
    table = torch.randperm(P, generator=g)[: B * max_pages].view(B, max_pages).to(device="cuda", dtype=torch.int32)
    return dict(q_nope=torch.randn(B, Sq, H, 512, generator=g).to(device="cuda", dtype=torch.bfloat16),
                q_pe=torch.randn(B, Sq, H, 64, generator=g).to(device="cuda", dtype=torch.bfloat16),
                ckv_cache=cache[..., :512], kpe_cache=cache[..., 512:], block_table=table, cache_seqlens=lens)


@pytest.mark.parametrize("planned", [False, True])
def test_decode_fast_path_is_the_checked_path(planned, monkeypatch):
    """decode's eager fast path (a route taken before: straight to the kernel, which checks its arguments and
    allocates out/lse) gives bit-identical results to the checked path (value checks on) on the same inputs."""
    from mla_autograd import _ops
    monkeypatch.delenv("MLA_AUTOGRAD_CHECK_VALUES", raising=False)
    a = _decode_inputs(Sq=2 if planned else 1)
    with torch.inference_mode():
        kw = {"schedule": M.decode_schedule(a["cache_seqlens"], seqlen_q=a["q_nope"].shape[1],
                                            num_heads=16)} if planned else {}
        want, want_lse = M.decode(**a, softmax_scale=0.1, return_lse=True, check_values=True, **kw)
        assert _ops.decode_fast(*a.values(), 0.1, True, kw.get("schedule")) is not None, "route not memoised"
        got, got_lse = M.decode(**a, softmax_scale=0.1, return_lse=True, **kw)
    assert torch.equal(got, want) and torch.equal(got_lse, want_lse)
    assert got.shape == a["q_nope"].shape and got_lse.shape == (3, 16, a["q_nope"].shape[1])


def test_decode_fast_path_keeps_the_named_errors(monkeypatch):
    """With the route memoised, every argument the kernel refuses still gets the checked path's error naming
    it, and inputs the kernel cannot take as they are (a strided block_table, an odd q stride) are copied."""
    monkeypatch.delenv("MLA_AUTOGRAD_CHECK_VALUES", raising=False)
    a = _decode_inputs()
    with torch.inference_mode():
        want = M.decode(**a, softmax_scale=0.1)
        with pytest.raises(ValueError, match="block_table has 2 rows"):
            M.decode(**dict(a, block_table=a["block_table"][:2]), softmax_scale=0.1)
        with pytest.raises(ValueError, match="kpe_cache last dim"):
            M.decode(**dict(a, kpe_cache=a["ckv_cache"][..., :32]), softmax_scale=0.1)
        with pytest.raises(TypeError, match="cache_seqlens must be int32"):
            M.decode(**dict(a, cache_seqlens=a["cache_seqlens"].long()), softmax_scale=0.1)
        with pytest.raises(ValueError, match="softmax_scale"):
            M.decode(**a, softmax_scale=float("nan"))
        wide = torch.zeros(3, 10, dtype=torch.int32, device="cuda")
        wide[:, ::2] = a["block_table"]
        got = M.decode(**dict(a, block_table=wide[:, ::2]), softmax_scale=0.1)
        assert torch.equal(got, want)
        # head stride 516: not a multiple of 8 elements, which the kernel refuses (the checked path copies q_nope)
        qn = torch.empty(3, 1, 16, 520, dtype=torch.bfloat16, device="cuda")
        qn = qn.as_strided((3, 1, 16, 512), (qn.stride(0), qn.stride(1), 516, 1))
        qn.copy_(a["q_nope"])
        assert torch.equal(M.decode(**dict(a, q_nope=qn), softmax_scale=0.1), want)
    q = a["q_nope"].clone().requires_grad_()
    with pytest.raises(RuntimeError, match="inference only"):
        M.decode(**dict(a, q_nope=q), softmax_scale=0.1)
    with torch.inference_mode():
        s = M.decode_schedule(a["cache_seqlens"], seqlen_q=1, num_heads=16)
        with pytest.raises(ValueError, match="different cache_seqlens"):
            M.decode(**dict(a, cache_seqlens=a["cache_seqlens"].clone()), softmax_scale=0.1, schedule=s)
