"""torch.library wiring: opcheck on every op, torch.compile(fullgraph=True) without graph breaks."""
import dataclasses

import pytest
import torch

import mla_autograd as M
from mla_autograd.testing import random_paged_cache


def _cu(lens):
    return torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32)


def test_opcheck_attn_fwd_bwd_dense():
    q, k, v = torch.randn(2, 5, 4, 8), torch.randn(2, 7, 2, 8), torch.randn(2, 7, 2, 6)
    out, lse = torch.ops.mla_autograd.attn_fwd(q, k, v, None, None, 5, 7, 0.3, True, True)
    torch.library.opcheck(torch.ops.mla_autograd.attn_fwd.default, (q, k, v, None, None, 5, 7, 0.3, True, True))
    do = torch.randn_like(out)
    torch.library.opcheck(torch.ops.mla_autograd.attn_bwd.default,
                          (do, q, k, v, out, lse, None, None, 5, 7, 0.3, True, True, False))


def test_opcheck_attn_fwd_autograd():
    """attn_fwd's registered autograd, checked by opcheck with inputs that require grad (the backward runs
    eagerly and through AOTAutograd); deterministic is an argument of the op, for its backward."""
    q, k, v = (torch.randn(2, 5, 2, 8, requires_grad=True) for _ in range(3))
    torch.library.opcheck(torch.ops.mla_autograd.attn_fwd.default, (q, k, v, None, None, 5, 5, 0.3, True, True, True))
    cu = _cu([2, 3])
    q, k, v = (torch.randn(5, 2, 8, requires_grad=True) for _ in range(3))
    torch.library.opcheck(torch.ops.mla_autograd.attn_fwd.default, (q, k, v, cu, cu, 3, 3, 0.3, False, True))


def _attention_routes(q, k, v, **kw):
    """(out, dq, dk, dv) of M.attention eagerly (the eager autograd Function), through the op's registered
    autograd (a tensor subclass takes the op), and compiled (fullgraph)."""
    class Sub(torch.Tensor):
        pass

    def run(fn, *xs):
        xs = [x.detach().requires_grad_() for x in xs]
        out = fn(*xs)
        return (out.detach(), *torch.autograd.grad(out.square().sum(), xs))

    def sub(q, k, v):
        return M.attention(*(x.as_subclass(Sub) for x in (q, k, v)), **kw).as_subclass(torch.Tensor)

    compiled = torch.compile(lambda q, k, v: M.attention(q, k, v, **kw), fullgraph=True, backend="aot_eager")
    return [run(fn, q, k, v) for fn in (lambda q, k, v: M.attention(q, k, v, **kw), sub, compiled)]


def test_eager_function_op_and_compiled_give_identical_results():
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, s, h, d, generator=g) for s, h, d in ((6, 4, 8), (9, 2, 8), (9, 2, 4)))
    eager, op, compiled = _attention_routes(q, k, v, causal=True, causal_align="top_left")
    for a, b, c in zip(eager, op, compiled):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
        torch.testing.assert_close(a, c)


def test_backward_sees_deterministic_eager_and_compiled(monkeypatch):
    """deterministic= reaches the backward's dispatch call on every route (the op carries it to its backward)."""
    from mla_autograd import _ops
    seen = []
    real = _ops.select
    monkeypatch.setattr(_ops, "select", lambda call: (seen.append((call.op, call.deterministic)), real(call))[1])
    q = torch.randn(1, 4, 2, 8)
    for det in (False, True):
        seen.clear()
        _attention_routes(q, q, q, deterministic=det)
        assert [d for op, d in seen if op == "attn_bwd"] == [det] * 3, seen


def test_opcheck_attn_varlen():
    cq, ck = _cu([2, 0, 3]), _cu([3, 2, 1])
    q, k, v = torch.randn(5, 4, 8), torch.randn(6, 2, 8), torch.randn(6, 2, 8)
    args = (q, k, v, cq, ck, 3, 3, 0.3, False, True)
    torch.library.opcheck(torch.ops.mla_autograd.attn_fwd.default, args)


def test_opcheck_decode():
    lens = torch.tensor([3, 6], dtype=torch.int32)
    ckv, kpe, table = random_paged_cache(lens, page_size=4, dim_ckv=16, dim_kpe=8, dtype=torch.float32)
    args = (torch.randn(2, 1, 4, 16), torch.randn(2, 1, 4, 8), ckv, kpe, table, lens, 0.2, True)
    torch.library.opcheck(torch.ops.mla_autograd.mla_decode.default, args)


def test_compile_fullgraph_dense_fwd_bwd():
    q = torch.randn(2, 9, 4, 16, requires_grad=True)
    k = torch.randn(2, 11, 2, 16, requires_grad=True)
    v = torch.randn(2, 11, 2, 8, requires_grad=True)

    def f(q, k, v):
        out, lse = M.attention(q, k, v, causal=True, return_lse=True)
        return (out * 2).sum() + lse.sum().detach()

    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    loss = compiled(q, k, v)
    g = torch.autograd.grad(loss, (q, k, v))
    loss_e = f(q, k, v)
    ge = torch.autograd.grad(loss_e, (q, k, v))
    torch.testing.assert_close(loss, loss_e)
    for a, b in zip(g, ge):
        torch.testing.assert_close(a, b)


def test_compile_fullgraph_varlen_and_decode():
    cq, ck = _cu([3, 4]), _cu([5, 2])
    q, k, v = torch.randn(7, 4, 8), torch.randn(7, 2, 8), torch.randn(7, 2, 8)
    f = torch.compile(lambda q, k, v: M.attention_varlen(q, k, v, cq, ck, 4, 5, causal=True),
                      fullgraph=True, backend="aot_eager")
    torch.testing.assert_close(f(q, k, v), M.attention_varlen(q, k, v, cq, ck, 4, 5, causal=True))

    lens = torch.tensor([3, 6], dtype=torch.int32)
    ckv, kpe, table = random_paged_cache(lens, page_size=4, dim_ckv=16, dim_kpe=8, dtype=torch.float32)
    qn, qp = torch.randn(2, 1, 4, 16), torch.randn(2, 1, 4, 8)
    d = torch.compile(lambda a, b: M.decode(a, b, ckv, kpe, table, lens, softmax_scale=0.2), fullgraph=True,
                      backend="aot_eager")
    with torch.no_grad():
        torch.testing.assert_close(d(qn, qp), M.decode(qn, qp, ckv, kpe, table, lens, softmax_scale=0.2))


def test_compile_inductor():
    # Self-attention written with one tensor for q, k and v: the compiled call traces the custom op with its
    # registered autograd, which takes one tensor for several inputs (Dynamo refuses that of an
    # autograd.Function).
    q = torch.randn(1, 8, 2, 16, requires_grad=True)
    f = torch.compile(lambda q: M.attention(q, q, q, causal=True).sum(), fullgraph=True)
    f(q).backward()
    q2 = q.detach().clone().requires_grad_(True)
    M.attention(q2, q2, q2, causal=True).sum().backward()
    torch.testing.assert_close(q.grad, q2.grad)


def test_compile_aliased_inputs_varlen():
    cu = _cu([3, 4])
    x = torch.randn(7, 2, 8, requires_grad=True)
    f = torch.compile(lambda x: M.attention_varlen(x, x, x, cu, cu, 4, 4, causal=True).square().sum(),
                      fullgraph=True, backend="aot_eager")
    f(x).backward()
    x2 = x.detach().clone().requires_grad_(True)
    M.attention_varlen(x2, x2, x2, cu, cu, 4, 4, causal=True).square().sum().backward()
    torch.testing.assert_close(x.grad, x2.grad)


def test_sm100_forward_output_carries_its_own_padding():
    """fmha_fwd_sm100's output is a view max_rows_q rows into its own allocation, so CUTLASS example 77's
    varlen epilogue (whose descriptor starts that many rows before the output) writes it in place."""
    from mla_autograd._ops import _kernel_ready, _new_out
    q, v = torch.empty(7, 3, 192), torch.empty(9, 2, 128)
    out = _new_out(q, v, "fmha_fwd_sm100", 5)
    assert out.shape == (7, 3, 128) and out.is_contiguous()
    assert out.storage_offset() == 5 * 3 * 128
    assert out.untyped_storage().nbytes() == (5 + 7) * 3 * 128 * out.element_size()
    plain = _new_out(q, v, "fmha_fwd_sm90", 5)
    assert plain.shape == (7, 3, 128) and plain.storage_offset() == 0
    # expanded (stride-0) inputs are copied before any kernel sees them
    k = torch.randn(2, 1, 1, 64).expand(2, 16, 4, 64)
    assert k.stride()[1] == 0 and _kernel_ready(k).is_contiguous()
    dense = torch.randn(2, 16, 4, 64)
    assert _kernel_ready(dense) is dense


def test_value_checks_before_kernels_that_need_them(monkeypatch):
    """Varlen calls check cu_seqlens values (one host copy) only where the kernel needs it: families that
    read them unclamped (Family.guards_values false: none now; the SM100 host layer sanitises them on the
    device) and the deterministic backward; never for dense calls, never under MLA_AUTOGRAD_CHECK_VALUES=0;
    and a bad value then raises before the kernel."""
    from mla_autograd import _ops, _validate
    from mla_autograd._kernels import FAMILIES

    assert [n for n, f in FAMILIES.items() if not f.guards_values] == []
    monkeypatch.setitem(FAMILIES, "fmha_unguarded_test",  # a family without the guarantee, to test the rule
                        dataclasses.replace(FAMILIES["fmha_fwd_sm90"], name="fmha_unguarded_test", guards_values=False))
    q, k = torch.randn(7, 2, 8), torch.randn(9, 2, 8)
    cq, ck = torch.tensor([0, 3, 7], dtype=torch.int32), torch.tensor([0, 4, 9], dtype=torch.int32)
    seen = []
    real = _validate.check_varlen_values
    monkeypatch.setattr(_validate, "check_varlen_values", lambda *a: (seen.append(a[2:]), real(*a))[1])
    monkeypatch.delenv("MLA_AUTOGRAD_CHECK_VALUES", raising=False)

    def checked(family, cu_q=cq, cu_k=ck, deterministic=False, mq=4, mk=5):
        seen.clear()
        _ops._check_values_before_kernel(family, q, k, cu_q, cu_k, mq, mk, deterministic)
        return len(seen)

    assert checked("fmha_fwd_sm90") == 0 and checked("fmha_bwd_sm90") == 0
    assert checked("fmha_fwd_sm100") == 0 and checked("fmha_bwd_sm100") == 0  # no host sync on SM100
    assert checked("fmha_unguarded_test") == 1
    assert checked("fmha_bwd_sm90", deterministic=True) == 1
    assert checked("fmha_unguarded_test", cu_q=None, cu_k=None) == 0
    assert seen == [] and checked("fmha_unguarded_test") == 1 and seen == [(7, 9, 4, 5)]
    with pytest.raises(ValueError, match="max_seqlen_k = 4 is smaller"):
        checked("fmha_unguarded_test", mk=4)
    monkeypatch.setenv("MLA_AUTOGRAD_CHECK_VALUES", "0")
    assert checked("fmha_unguarded_test", mk=4) == 0


class _FakeDecodeKernel:
    """Stands in for a decode kernel family in decode's fast-path memo: records calls, returns a sentinel or
    raises as the C++ layer does on an argument it refuses."""

    def __init__(self, refuse=False):
        self.calls, self.refuse = [], refuse

    def decode(self, *args):
        self.calls.append(args)
        if self.refuse:
            raise RuntimeError("decode: refused")
        q_nope = args[0]
        B, Sq, H, Dc = q_nope.shape
        return torch.full_like(q_nope, 7.0), torch.zeros(B, H, Sq)


def _decode_case():
    lens = torch.tensor([5, 3], dtype=torch.int32)
    ckv, kpe, table = random_paged_cache(lens, page_size=4, dim_ckv=16, dim_kpe=8, dtype=torch.float32)
    g = torch.Generator().manual_seed(0)
    return (torch.randn(2, 1, 2, 16, generator=g), torch.randn(2, 1, 2, 8, generator=g), ckv, kpe, table, lens)


def test_decode_fast_route_key_reads_what_the_routes_read():
    """decode's fast path keys its memo on fields read off the tensors (no Call built, for host time): two calls
    share a fast key exactly when they share the dispatch's route key (ROUTE_FIELDS["decode"]), so a route taken
    for one call is never reused for a call the table could route elsewhere."""
    from mla_autograd import _ops
    from mla_autograd._dispatch import ROUTE_FIELDS
    assert set(ROUTE_FIELDS["decode"]) == {"device", "dtype", "dims", "num_heads", "seqlen_q", "page_size"}
    fast_to_route, route_to_fast = {}, {}
    for dtype in (torch.float32, torch.bfloat16):
        for sq, h, dc, dr, page in [(1, 2, 16, 8, 4), (2, 2, 16, 8, 4), (1, 4, 16, 8, 4), (1, 2, 32, 8, 4),
                                    (1, 2, 16, 4, 4), (1, 2, 16, 8, 8), (3, 16, 512, 64, 64)]:
            for batch, pages in ((2, 3), (5, 7)):  # what the route does not read may differ
                q_nope = torch.empty(batch, sq, h, dc, dtype=dtype)
                q_pe = torch.empty(batch, sq, h, dr, dtype=dtype)
                ckv = torch.empty(pages, page, dc, dtype=dtype)
                fast = _ops._decode_route_key(q_nope, q_pe, ckv)
                route = _ops.decode_call(q_nope, q_pe, ckv).route_key()
                assert fast_to_route.setdefault(fast, route) == route
                assert route_to_fast.setdefault(route, fast) == fast
    assert len(fast_to_route) == 14


def test_decode_fast_path_takes_only_memoised_routes_and_falls_back(monkeypatch):
    """decode's fast path runs a route's kernel only after the checked path took that route, never while values
    are checked or autograd records, and anything the kernel refuses goes the checked way (here the reference
    path, which the CPU route is)."""
    from mla_autograd import _ops
    monkeypatch.delenv("MLA_AUTOGRAD_CHECK_VALUES", raising=False)
    args = _decode_case()
    want = M.decode(*args, softmax_scale=0.3)  # the reference path: nothing memoised for it
    key = _ops._decode_route_key(args[0], args[1], args[2])
    assert key not in _ops._decode_kernels
    fake = _FakeDecodeKernel()
    monkeypatch.setitem(_ops._decode_kernels, key, fake)
    with torch.no_grad():
        assert torch.all(M.decode(*args, softmax_scale=0.3) == 7.0) and len(fake.calls) == 1
        assert fake.calls[0][6:] == (None, None, 0.3, True, None)  # out/lse allocated by the kernel's layer
        torch.testing.assert_close(M.decode(*args, softmax_scale=0.3, check_values=True), want)
        monkeypatch.setenv("MLA_AUTOGRAD_CHECK_VALUES", "0")
        torch.testing.assert_close(M.decode(*args, softmax_scale=0.3), want)
        monkeypatch.delenv("MLA_AUTOGRAD_CHECK_VALUES")
        assert len(fake.calls) == 1
    q = args[0].clone().requires_grad_()
    with pytest.raises(RuntimeError, match="inference only"):
        M.decode(q, *args[1:], softmax_scale=0.3)
    # a schedule for this cache_seqlens (the reference path needs none, so its tensor is empty: give it one)
    sched = M.decode_schedule(args[5], seqlen_q=1, num_heads=2)
    sched.tensor = torch.zeros(4, dtype=torch.int32)
    with torch.no_grad():
        assert torch.all(M.decode(*args, softmax_scale=0.3, schedule=sched) == 7.0) and len(fake.calls) == 2
        assert fake.calls[1][-1] is sched.tensor
        args[5].add_(0)  # modified in place since the schedule: the checked path says it is stale
        with pytest.raises(ValueError, match="modified in place"):
            M.decode(*args, softmax_scale=0.3, schedule=sched)
        with pytest.raises(ValueError, match="different cache_seqlens"):
            M.decode(*args[:5], args[5].clone(), softmax_scale=0.3, schedule=sched)
    assert len(fake.calls) == 2
    refusing = _FakeDecodeKernel(refuse=True)
    monkeypatch.setitem(_ops._decode_kernels, key, refusing)
    with torch.no_grad():
        torch.testing.assert_close(M.decode(*args, softmax_scale=0.3), want)
        with pytest.raises(ValueError, match="softmax_scale"):
            M.decode(*args, softmax_scale=-1.0)
    assert len(refusing.calls) == 2
