"""Every bad input gets an error that names the argument, before anything is computed."""
import pytest
import torch

import mla_autograd as M
from mla_autograd.testing import random_paged_cache


def qkv(B=2, Sq=5, Sk=6, Hq=4, Hkv=2, D=8, Dv=8, dtype=torch.float32):
    return torch.randn(B, Sq, Hq, D, dtype=dtype), torch.randn(B, Sk, Hkv, D, dtype=dtype), \
        torch.randn(B, Sk, Hkv, Dv, dtype=dtype)


def cu(lens):
    return torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32)


@pytest.mark.parametrize("mutate,exc,match", [
    (lambda q, k, v: (q.int(), k, v), TypeError, "q must be bfloat16"),
    (lambda q, k, v: (q, k.double(), v), TypeError, "k has dtype float64 but q"),
    (lambda q, k, v: (q, k, v.half()), TypeError, "v has dtype float16"),
    (lambda q, k, v: (q[0], k, v), ValueError, "q must have 4 dimensions"),
    (lambda q, k, v: (q, k[..., :4], v), ValueError, "k head dim 4 must equal q head dim 8"),
    (lambda q, k, v: (q, k, v[:, :3]), ValueError, "v shape"),
    (lambda q, k, v: (q[:, :, :3], k, v), ValueError, r"query heads \(3\) must be a multiple"),
    (lambda q, k, v: (q, k[:1], v[:1]), ValueError, "k batch size 1 must equal q batch size 2"),
    (lambda q, k, v: (q.transpose(-1, -2).contiguous().transpose(-1, -2), k, v), ValueError,
     "q must have stride 1 in its last dimension"),
    (lambda q, k, v: (q.tolist(), k, v), TypeError, "q must be a torch.Tensor"),
])
def test_attention_argument_errors(mutate, exc, match):
    with pytest.raises(exc, match=match):
        M.attention(*mutate(*qkv()))


def test_attention_keyword_errors():
    q, k, v = qkv()
    with pytest.raises(ValueError, match="causal_align must be 'top_left' or 'bottom_right'"):
        M.attention(q, k, v, causal=True, causal_align="upper")
    for bad in (float("nan"), float("inf"), 0.0, -0.125):
        with pytest.raises(ValueError, match="softmax_scale must be a finite number > 0"):
            M.attention(q, k, v, softmax_scale=bad)
    for bad in (0.0, -1.0):  # the same rule on every entry point (each kernel's host layer checks it too)
        with pytest.raises(ValueError, match="softmax_scale must be a finite number > 0"):
            M.decode(torch.randn(1, 1, 8, 16), torch.randn(1, 1, 8, 4), torch.randn(2, 4, 16), torch.randn(2, 4, 4),
                     torch.zeros(1, 2, dtype=torch.int32), torch.ones(1, dtype=torch.int32), softmax_scale=bad)
    with pytest.raises(TypeError, match="softmax_scale must be a Python float"):
        M.attention(q, k, v, softmax_scale=torch.tensor(0.1))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs two devices (cpu + cuda)")
def test_attention_device_mismatch():
    q, k, v = qkv()
    with pytest.raises(ValueError, match="k is on cuda"):
        M.attention(q, k.cuda(), v)


def test_varlen_errors():
    q, k, v = torch.randn(7, 4, 8), torch.randn(9, 2, 8), torch.randn(9, 2, 8)
    cq, ck = cu([3, 4]), cu([4, 5])
    ok = dict(max_seqlen_q=4, max_seqlen_k=5)
    M.attention_varlen(q, k, v, cq, ck, **ok)
    cases = [
        ((q, k, v, cq.long(), ck), ok, TypeError, "cu_seqlens_q must be int32"),
        ((q, k, v, cq, ck[None]), ok, ValueError, "cu_seqlens_k must have 1 dimensions"),
        ((q, k, v, cq, cu([4])), ok, ValueError, "cu_seqlens_q .* and cu_seqlens_k .* must both have length"),
        ((q, k, v, torch.tensor([1, 3, 7], dtype=torch.int32), ck), ok, ValueError, r"cu_seqlens_q\[0\] must be 0"),
        ((q, k, v, torch.tensor([0, 5, 4], dtype=torch.int32), ck), ok, ValueError, "cu_seqlens_q must be non-decreasing"),
        ((q, k, v, cq, torch.tensor([0, 4, 8], dtype=torch.int32)), ok, ValueError,
         r"cu_seqlens_k\[-1\] = 8 must equal the number of packed tokens \(9\)"),
        ((q, k, v, cq, ck), dict(max_seqlen_q=3, max_seqlen_k=5), ValueError, "max_seqlen_q = 3 is smaller"),
        ((q, k, v, cq, ck), dict(max_seqlen_q=4, max_seqlen_k=-1), ValueError, "max_seqlen_k must be a non-negative int"),
        ((q[None], k, v, cq, ck), ok, ValueError, "q must have 3 dimensions"),
    ]
    for args, kw, exc, match in cases:
        with pytest.raises(exc, match=match):
            M.attention_varlen(*args, **kw, check_values=True)


def test_varlen_value_checks_can_be_disabled(monkeypatch):
    q, k, v = torch.randn(7, 4, 8), torch.randn(9, 2, 8), torch.randn(9, 2, 8)
    monkeypatch.setenv("MLA_AUTOGRAD_CHECK_VALUES", "0")
    # max_seqlen too small is not detected without value checks; shapes are still checked
    M.attention_varlen(q, k, v, cu([3, 4]), cu([4, 5]), 4, 5)
    with pytest.raises(TypeError, match="cu_seqlens_q must be int32"):
        M.attention_varlen(q, k, v, cu([3, 4]).long(), cu([4, 5]), 4, 5)


def _decode_args(B=2, Sq=1, H=4, page=4, lens=(5, 3)):
    lens_t = torch.tensor(lens, dtype=torch.int32)
    ckv, kpe, table = random_paged_cache(lens_t, page_size=page, dim_ckv=16, dim_kpe=8, dtype=torch.float32)
    return dict(q_nope=torch.randn(B, Sq, H, 16), q_pe=torch.randn(B, Sq, H, 8), ckv_cache=ckv, kpe_cache=kpe,
                block_table=table, cache_seqlens=lens_t)


@pytest.mark.parametrize("change,exc,match", [
    (dict(q_nope=torch.randn(2, 1, 4, 16).int()), TypeError, "q_nope must be bfloat16"),
    (dict(q_pe=torch.randn(2, 1, 4, 8).double()), TypeError, "q_pe has dtype float64 but q_nope"),
    (dict(q_pe=torch.randn(2, 1, 3, 8)), ValueError, r"q_pe shape .* must match q_nope"),
    (dict(q_nope=torch.randn(2, 4, 16)), ValueError, "q_nope must have 4 dimensions"),
    (dict(kpe_cache=torch.randn(6, 4, 4)), ValueError, "kpe_cache last dim 4 must equal q_pe head dim 8"),
    (dict(ckv_cache=torch.randn(6, 4, 12)), ValueError, "ckv_cache last dim 12 must equal q_nope head dim 16"),
    (dict(ckv_cache=torch.randn(6, 2, 16)), ValueError, "must agree in"),
    (dict(block_table=torch.zeros(2, 3, dtype=torch.int64)), TypeError, "block_table must be int32"),
    (dict(block_table=torch.zeros(3, 3, dtype=torch.int32)), ValueError, "block_table has 3 rows"),
    (dict(cache_seqlens=torch.tensor([5, 3])), TypeError, "cache_seqlens must be int32"),
    (dict(cache_seqlens=torch.tensor([5], dtype=torch.int32)), ValueError, "cache_seqlens has length 1"),
    (dict(cache_seqlens=torch.tensor([5, 99], dtype=torch.int32)), ValueError, r"cache_seqlens\[1\] = 99 must be 0"),
    (dict(cache_seqlens=torch.tensor([-1, 3], dtype=torch.int32)), ValueError, r"cache_seqlens\[0\] = -1"),
    (dict(block_table=torch.full((2, 2), 1000, dtype=torch.int32)), ValueError, r"block_table\[0, 0\] = 1000 is not a page"),
])
def test_decode_errors(change, exc, match):
    args = _decode_args()
    args.update(change)
    with torch.no_grad(), pytest.raises(exc, match=match):
        M.decode(**args, softmax_scale=0.1, check_values=True)


def test_decode_new_tokens_exceed_length():
    args = _decode_args(Sq=4, lens=(5, 3))
    with torch.no_grad(), pytest.raises(ValueError, match=r"cache_seqlens\[1\] = 3 must be 0 .* the 4 new tokens"):
        M.decode(**args, softmax_scale=0.1, check_values=True)


def test_decode_requires_scale():
    with torch.no_grad(), pytest.raises(ValueError, match="softmax_scale is required"):
        M.decode(**_decode_args(), softmax_scale=None)


def test_errors_write_nothing():
    # A failing call must not touch caches or inputs: compare bytes before and after.
    args = _decode_args()
    before = {k: v.clone() for k, v in args.items()}
    args["cache_seqlens"] = torch.tensor([5, 99], dtype=torch.int32)
    with torch.no_grad(), pytest.raises(ValueError):
        M.decode(**args, softmax_scale=0.1, check_values=True)
    for k in ("ckv_cache", "kpe_cache", "block_table", "q_nope"):
        assert torch.equal(torch.nan_to_num(args[k]), torch.nan_to_num(before[k]))


def _error_of(fn):
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - the test compares whatever is raised
        return type(e), str(e)
    return None


@pytest.mark.parametrize("mutate", [
    lambda q, k, v: (q.int(), k, v),
    lambda q, k, v: (q[:, :, :3], k, v),   # 3 query heads over 2
    lambda q, k, v: (torch.randn(2, 5, 4, 8), torch.randn(2, 6, 3, 8), torch.randn(2, 6, 3, 8)),  # 4 over 3
    lambda q, k, v: (q, k.double(), v),
    lambda q, k, v: (q, k[..., :4], v),
    lambda q, k, v: (q, k[:1], v[:1]),
    lambda q, k, v: (q[0], k, v),
])
def test_explain_raises_what_attention_raises(mutate):
    q, k, v = mutate(*qkv())
    want = _error_of(lambda: M.attention(q, k, v))
    assert want is not None
    assert _error_of(lambda: M.explain(q, k, v)) == want
    assert _error_of(lambda: M.explain(q, k, v, causal=True, deterministic=True)) == want


def test_explain_varlen_raises_what_attention_varlen_raises():
    cq = cu([3, 4])
    for q, k, v in [(torch.randn(7, 4, 8).int(), torch.randn(7, 2, 8), torch.randn(7, 2, 8)),
                    (torch.randn(7, 4, 8), torch.randn(7, 3, 8), torch.randn(7, 3, 8)),
                    (torch.randn(1, 7, 4, 8), torch.randn(7, 2, 8), torch.randn(7, 2, 8))]:
        want = _error_of(lambda: M.attention_varlen(q, k, v, cq, cq, 4, 4))
        assert want is not None and _error_of(lambda: M.explain(q, k, v, varlen=True)) == want
    q, k, v = torch.randn(7, 4, 8), torch.randn(7, 2, 8), torch.randn(7, 2, 8)
    assert M.explain(q, k, v, varlen=True).forward.backend == "reference"


@pytest.mark.parametrize("change", [
    dict(q_nope=torch.randn(2, 1, 4, 16).int()),
    dict(q_pe=torch.randn(2, 1, 4, 8).double()),
    dict(q_pe=torch.randn(2, 1, 3, 8)),
    dict(q_nope=torch.randn(2, 4, 16)),
    dict(ckv_cache=torch.randn(6, 4, 12)),
    dict(ckv_cache=torch.randn(6, 0, 16)),
])
def test_explain_decode_raises_what_decode_raises(change):
    args = _decode_args()
    args.update(change)
    with torch.no_grad():
        want = _error_of(lambda: M.decode(**args, softmax_scale=0.1))
    assert want is not None
    assert _error_of(lambda: M.explain_decode(args["q_nope"], args["q_pe"], args["ckv_cache"])) == want


def test_varlen_value_checks_read_one_value_on_the_host(host_reads, monkeypatch):
    """Computed on the inputs' device; one int64 crosses to the host (a sync on a GPU), only more when a
    check fails and the error needs the bad entry's value."""
    q, k, v = torch.randn(7, 4, 8), torch.randn(9, 2, 8), torch.randn(9, 2, 8)
    cq, ck = cu([3, 4]), cu([4, 5])
    from mla_autograd import _validate

    monkeypatch.delenv("MLA_AUTOGRAD_CHECK_VALUES", raising=False)
    host_reads.clear()
    _validate.check_attention_varlen(q, k, v, cq, ck, 4, 5)  # the default: no value read
    assert host_reads == []
    _validate.check_attention_varlen(q, k, v, cq, ck, 4, 5, check_values=True)
    assert host_reads == [("item", ())]
    host_reads.clear()
    monkeypatch.setenv("MLA_AUTOGRAD_CHECK_VALUES", "0")
    _validate.check_attention_varlen(q, k, v, cq, ck, 4, 5, check_values=True)
    assert host_reads == []
    monkeypatch.setenv("MLA_AUTOGRAD_CHECK_VALUES", "1")
    _validate.check_attention_varlen(q, k, v, cq, ck, 4, 5)
    assert host_reads == [("item", ())]


@pytest.mark.parametrize("cq,ck,mx,match", [
    ([0, 3, 7], [0, 4, 9], (4, 5), None),
    ([0, 3, 2, 7], [0, 4, 9, 9], (4, 5), r"cu_seqlens_q must be non-decreasing: cu_seqlens_q\[2\] = 2 < cu_seqlens_q\[1\] = 3"),
    ([0, 3, 7], [0, 9, 4], (4, 9), r"cu_seqlens_k must be non-decreasing: cu_seqlens_k\[2\] = 4 < cu_seqlens_k\[1\] = 9"),
    ([0, 3, 7], [2, 4, 9], (4, 5), r"cu_seqlens_k\[0\] must be 0, got 2"),
    ([0, 3, 7], [0, 4, 9], (4, 4), r"max_seqlen_k = 4 is smaller than the longest sequence \(5\)"),
    ([0, 3, 6], [0, 4, 9], (4, 5), r"cu_seqlens_q\[-1\] = 6 must equal the number of packed tokens \(7\)"),
    # several faults: cu_seqlens_q is reported before cu_seqlens_k, [0] before monotonicity before [-1]
    ([1, 0, 7], [5, 4, 9], (1, 1), r"cu_seqlens_q\[0\] must be 0, got 1"),
    ([0, 5, 3, 6], [7, 4, 9, 9], (1, 1), r"cu_seqlens_q must be non-decreasing: cu_seqlens_q\[2\] = 3"),
    ([0, 3, 7], [0, -2147483648, 9], (4, 5), r"cu_seqlens_k\[1\] = -2147483648 < cu_seqlens_k\[0\] = 0"),
])
def test_varlen_value_errors_name_the_entry(cq, ck, mx, match):
    q, k, v = torch.randn(7, 4, 8), torch.randn(9, 2, 8), torch.randn(9, 2, 8)
    cq, ck = torch.tensor(cq, dtype=torch.int32), torch.tensor(ck, dtype=torch.int32)
    if match is None:
        M.attention_varlen(q, k, v, cq, ck, *mx, check_values=True)
        return
    with pytest.raises(ValueError, match=match):
        M.attention_varlen(q, k, v, cq, ck, *mx, check_values=True)


@pytest.mark.parametrize("lens,table,match", [
    ((5, 3), None, None),
    ((0, 3), None, None),                                        # idle slot
    ((5, 12), None, r"cache_seqlens\[1\] = 12 must be 0 .* capacity 8 \(2 pages x page_size 4\)"),
    ((5, 3), [[0, 1], [6, 9]], r"block_table\[1, 0\] = 6 is not a page index in \[0, 6\)"),  # num_pages
    ((5, 3), [[0, -3], [2, 9]], r"block_table\[0, 1\] = -3 is not a page index"),
    ((4, 3), [[0, -3], [2, 9]], None),                           # unused entries are not read
    ((0, 0), [[99, 99], [99, 99]], None),
    ((-1, 3), [[99, 99], [99, 99]], r"cache_seqlens\[0\] = -1"),  # lengths reported before the table
])
def test_decode_value_errors_name_the_entry(lens, table, match):
    args = _decode_args(lens=(5, 3))
    args["cache_seqlens"] = torch.tensor(lens, dtype=torch.int32)
    assert args["block_table"].shape == (2, 2) and args["ckv_cache"].shape[0] == 6
    if table is not None:
        args["block_table"] = torch.tensor(table, dtype=torch.int32)
    with torch.no_grad():
        if match is None:
            M.decode(**args, softmax_scale=0.1, check_values=True)
            return
        with pytest.raises(ValueError, match=match):
            M.decode(**args, softmax_scale=0.1, check_values=True)


def _mla_parts():
    return [torch.randn(2, 5, 4, 8), torch.randn(2, 5, 4, 4), torch.randn(2, 6, 2, 8), torch.randn(2, 6, 1, 4),
            torch.randn(2, 6, 2, 6)]


@pytest.mark.parametrize("i,fn", [
    (0, lambda t: t.int()),
    (2, lambda t: torch.randn(2, 6, 3, 8)),          # 4 query heads over 3 kv heads
    (3, lambda t: torch.randn(2, 6, 2, 5)),
    (1, lambda t: t.double()),
    (4, lambda t: t[:, :3]),
])
def test_explain_mla_raises_what_mla_attention_raises(i, fn):
    parts = _mla_parts()
    if i == 2:
        parts[4] = torch.randn(2, 6, 3, 6)
    parts[i] = fn(parts[i])
    want = _error_of(lambda: M.mla_attention(*parts))
    assert want is not None
    assert _error_of(lambda: M.explain_mla(*parts)) == want
    packed = [p[0] for p in parts]
    cq = cu([packed[0].shape[0]])
    ck = cu([packed[2].shape[0]])
    want = _error_of(lambda: M.mla_attention_varlen(*packed, cq, ck, 5, 6))
    assert want is not None and _error_of(lambda: M.explain_mla(*packed, varlen=True)) == want
