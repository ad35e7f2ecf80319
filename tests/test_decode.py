"""mla_autograd.decode on CPU (reference path): against explicit per-head attention over the cache."""
import pytest
import torch

import mla_autograd as M
from mla_autograd.testing import random_paged_cache


def _expected(q_nope, q_pe, ckv, kpe, table, lens, scale, causal):
    B, Sq, H, Dc = q_nope.shape
    out = torch.zeros(B, Sq, H, Dc, dtype=torch.float64)
    lse = torch.full((B, H, Sq), float("-inf"), dtype=torch.float64)
    ps = ckv.shape[1]
    for b in range(B):
        L = int(lens[b])
        if L == 0:
            continue
        rows = [(int(table[b, p // ps]), p % ps) for p in range(L)]
        K = torch.stack([torch.cat([ckv[pg, r], kpe[pg, r]]) for pg, r in rows]).double()
        Vv = K[:, :Dc]
        q = torch.cat([q_nope[b], q_pe[b]], -1).double()  # (Sq, H, 576)
        s = torch.einsum("ihd,jd->hij", q, K) * scale
        if causal:
            vis = torch.arange(L)[None, :] <= (L - Sq + torch.arange(Sq))[:, None]
            s = s.masked_fill(~vis, float("-inf"))
        l = torch.logsumexp(s, -1)
        p = torch.nan_to_num(torch.exp(s - l[..., None]), nan=0.0)
        out[b] = torch.einsum("hij,jd->ihd", p, Vv)
        lse[b] = l
    return out, lse


@pytest.mark.parametrize("page_size", [1, 4, 16])
@pytest.mark.parametrize("sq,causal", [(1, True), (3, True), (2, False)])
@pytest.mark.parametrize("fused", [True, False])
def test_decode_reference_paged(page_size, sq, causal, fused):
    lens = torch.tensor([0, 5, 17, 3, 40], dtype=torch.int32)
    lens = torch.where((lens > 0) & (lens < sq), torch.full_like(lens, sq), lens)
    ckv, kpe, table = random_paged_cache(lens, page_size=page_size, dim_ckv=32, dim_kpe=8,
                                         dtype=torch.float64, fused=fused)
    B, H = len(lens), 4
    q_nope = torch.randn(B, sq, H, 32, dtype=torch.float64)
    q_pe = torch.randn(B, sq, H, 8, dtype=torch.float64)
    out, lse = M.decode(q_nope, q_pe, ckv, kpe, table, lens, softmax_scale=0.2, causal=causal, return_lse=True)
    exp_out, exp_lse = _expected(q_nope, q_pe, ckv, kpe, table, lens, 0.2, causal)
    assert torch.isfinite(out).all(), "NaN from an unused page leaked into the output"
    torch.testing.assert_close(out, exp_out)
    torch.testing.assert_close(lse, exp_lse)
    assert (out[0] == 0).all() and torch.isneginf(lse[0]).all()  # idle slot


def test_decode_bf16_shapes():
    lens = torch.tensor([7, 1], dtype=torch.int32)
    ckv, kpe, table = random_paged_cache(lens, page_size=4, dtype=torch.bfloat16)
    q_nope, q_pe = torch.randn(2, 1, 8, 512).bfloat16(), torch.randn(2, 1, 8, 64).bfloat16()
    out, lse = M.decode(q_nope, q_pe, ckv, kpe, table, lens, softmax_scale=192 ** -0.5, return_lse=True)
    assert out.shape == (2, 1, 8, 512) and out.dtype == torch.bfloat16
    assert lse.shape == (2, 8, 1) and lse.dtype == torch.float32


def test_decode_is_inference_only():
    lens = torch.tensor([3], dtype=torch.int32)
    ckv, kpe, table = random_paged_cache(lens, page_size=4, dim_ckv=8, dim_kpe=4, dtype=torch.float32)
    q_nope = torch.randn(1, 1, 2, 8, requires_grad=True)
    q_pe = torch.randn(1, 1, 2, 4)
    with pytest.raises(RuntimeError, match="inference only"):
        M.decode(q_nope, q_pe, ckv, kpe, table, lens, softmax_scale=0.3)
    with torch.no_grad():
        M.decode(q_nope, q_pe, ckv, kpe, table, lens, softmax_scale=0.3)
    with torch.inference_mode():
        M.decode(q_nope, q_pe, ckv, kpe, table, lens, softmax_scale=0.3)


def test_decode_value_checks_read_one_value_on_the_host(host_reads, monkeypatch):
    """The value checks run on the inputs' device and copy one int64 to the host; check_values=False (the
    default) reads nothing there: on a GPU each host read is a device sync."""
    lens = torch.tensor([3, 9], dtype=torch.int32)
    ckv, kpe, table = random_paged_cache(lens, page_size=4, dim_ckv=32, dim_kpe=8, dtype=torch.float64)
    q_nope, q_pe = torch.randn(2, 1, 4, 32, dtype=torch.float64), torch.randn(2, 1, 4, 8, dtype=torch.float64)
    from mla_autograd import _validate

    monkeypatch.delenv("MLA_AUTOGRAD_CHECK_VALUES", raising=False)
    host_reads.clear()  # what making the inputs read
    _validate.check_decode(q_nope, q_pe, ckv, kpe, table, lens, 0.2, check_values=False)
    assert host_reads == []
    _validate.check_decode(q_nope, q_pe, ckv, kpe, table, lens, 0.2)  # the default: not checked
    assert host_reads == []
    _validate.check_decode(q_nope, q_pe, ckv, kpe, table, lens, 0.2, check_values=True)  # one 0-d read
    assert host_reads == [("item", ())]
    host_reads.clear()
    monkeypatch.setenv("MLA_AUTOGRAD_CHECK_VALUES", "1")  # forces the checks on, check_values=False too
    _validate.check_decode(q_nope, q_pe, ckv, kpe, table, lens, 0.2, check_values=False)
    assert host_reads == [("item", ())]
    host_reads.clear()
    monkeypatch.setenv("MLA_AUTOGRAD_CHECK_VALUES", "0")  # turns them off, check_values=True too
    _validate.check_decode(q_nope, q_pe, ckv, kpe, table, lens, 0.2, check_values=True)
    assert host_reads == []
    monkeypatch.undo()
    out = M.decode(q_nope, q_pe, ckv, kpe, table, lens, softmax_scale=0.2, check_values=False)
    exp_out, _ = _expected(q_nope, q_pe, ckv, kpe, table, lens, 0.2, True)
    torch.testing.assert_close(out, exp_out.to(out.dtype))


def test_decode_env_forces_checks_on_check_values_false(monkeypatch):
    lens = torch.tensor([5, 99], dtype=torch.int32)  # 99 > capacity
    ckv, kpe, table = random_paged_cache(torch.tensor([5, 3]), page_size=4, dim_ckv=16, dim_kpe=8,
                                         dtype=torch.float32)
    args = (torch.randn(2, 1, 4, 16), torch.randn(2, 1, 4, 8), ckv, kpe, table, lens)
    monkeypatch.setenv("MLA_AUTOGRAD_CHECK_VALUES", "1")
    with torch.no_grad(), pytest.raises(ValueError, match=r"cache_seqlens\[1\] = 99 must be 0"):
        M.decode(*args, softmax_scale=0.1, check_values=False)


# ---- decode_schedule: plan once per decode step, pass to every layer's decode ----

def _sched_case(B=3, Sq=1, H=4, lens=(5, 17, 0)):
    lens = torch.tensor(lens, dtype=torch.int32)
    ckv, kpe, table = random_paged_cache(lens, page_size=4, dim_ckv=32, dim_kpe=8, dtype=torch.float64)
    q_nope = torch.randn(B, Sq, H, 32, dtype=torch.float64)
    q_pe = torch.randn(B, Sq, H, 8, dtype=torch.float64)
    return q_nope, q_pe, ckv, kpe, table, lens


def test_decode_schedule_reference_path_identical():
    q_nope, q_pe, ckv, kpe, table, lens = _sched_case()
    s = M.decode_schedule(lens, seqlen_q=1, num_heads=4)
    assert isinstance(s, M.DecodeSchedule)
    assert (s.batch, s.seqlen_q, s.num_heads, s.device) == (3, 1, 4, lens.device)
    assert s.tensor.dtype == torch.int32 and s.tensor.numel() == 0  # the reference path needs none
    want, want_lse = M.decode(q_nope, q_pe, ckv, kpe, table, lens, softmax_scale=0.2, return_lse=True)
    for _ in range(3):  # one schedule, several "layers"
        got, got_lse = M.decode(q_nope, q_pe, ckv, kpe, table, lens, softmax_scale=0.2, return_lse=True, schedule=s)
        assert torch.equal(got, want) and torch.equal(got_lse, want_lse)


@pytest.mark.parametrize("change,match", [
    (dict(B=2, lens=(5, 17)), r"computed for \(batch, seqlen_q, num_heads\) = \(3, 1, 4\) but q_nope has \(B, Sq, H\) = \(2, 1, 4\)"),
    (dict(Sq=2), r"= \(3, 1, 4\) but q_nope has \(B, Sq, H\) = \(3, 2, 4\)"),
    (dict(H=8), r"= \(3, 1, 4\) but q_nope has \(B, Sq, H\) = \(3, 1, 8\)"),
])
def test_decode_schedule_wrong_shape(change, match):
    s = M.decode_schedule(torch.tensor([5, 17, 2], dtype=torch.int32), seqlen_q=1, num_heads=4)
    q_nope, q_pe, ckv, kpe, table, lens = _sched_case(**change)
    with torch.no_grad(), pytest.raises(ValueError, match=match):
        M.decode(q_nope, q_pe, ckv, kpe, table, lens, softmax_scale=0.2, schedule=s)


def test_decode_schedule_wrong_device_and_type():
    q_nope, q_pe, ckv, kpe, table, lens = _sched_case()
    s = M.DecodeSchedule(torch.empty(0, dtype=torch.int32, device="meta"), 3, 1, 4, torch.device("meta"), None, None)
    with pytest.raises(ValueError, match="schedule was computed on meta but q_nope is on cpu"):
        M.decode(q_nope, q_pe, ckv, kpe, table, lens, softmax_scale=0.2, schedule=s)
    with pytest.raises(TypeError, match="schedule must be a DecodeSchedule from mla_autograd.decode_schedule, got Tensor"):
        M.decode(q_nope, q_pe, ckv, kpe, table, lens, softmax_scale=0.2,
                 schedule=M.decode_schedule(lens, seqlen_q=1, num_heads=4).tensor)


def test_decode_schedule_stale():
    q_nope, q_pe, ckv, kpe, table, lens = _sched_case()
    s = M.decode_schedule(lens, seqlen_q=1, num_heads=4)
    M.decode(q_nope, q_pe, ckv, kpe, table, lens, softmax_scale=0.2, schedule=s)
    with pytest.raises(ValueError, match="schedule is stale: it was computed from a different cache_seqlens"):
        M.decode(q_nope, q_pe, ckv, kpe, table, lens.clone(), softmax_scale=0.2, schedule=s)
    lens += 1  # the next step's lengths, in place
    with pytest.raises(ValueError, match=r"schedule is stale: cache_seqlens was modified in place .*decode_schedule"):
        M.decode(q_nope, q_pe, ckv, kpe, table, lens, softmax_scale=0.2, schedule=s)
    s = M.decode_schedule(lens, seqlen_q=1, num_heads=4)  # recomputed: accepted again
    M.decode(q_nope, q_pe, ckv, kpe, table, lens, softmax_scale=0.2, schedule=s)


def test_decode_schedule_inference_tensor():
    # an inference tensor has no version counter: the schedule keeps only its identity
    q_nope, q_pe, ckv, kpe, table, lens = _sched_case()
    with torch.inference_mode():
        lens_i = lens.clone()
        s = M.decode_schedule(lens_i, seqlen_q=1, num_heads=4)
        assert s.seqlens_version is None and s.seqlens_ptr == lens_i.data_ptr()
        out = M.decode(q_nope, q_pe, ckv, kpe, table, lens_i, softmax_scale=0.2, schedule=s)
    assert torch.equal(out, M.decode(q_nope, q_pe, ckv, kpe, table, lens, softmax_scale=0.2))


def test_decode_schedule_inference_tensor_modified_in_place():
    """No version counter: the schedule's device copy of the lengths is compared while decode checks values
    (in the same single host copy); with check_values=False the edit cannot be seen (documented)."""
    q_nope, q_pe, ckv, kpe, table, lens = _sched_case()
    with torch.inference_mode():
        lens_i = lens.clone()
        s = M.decode_schedule(lens_i, seqlen_q=1, num_heads=4)
        assert s.seqlens_copy is not None and torch.equal(s.seqlens_copy, lens_i)
        assert s.seqlens_copy.device == lens_i.device and s.seqlens_copy.data_ptr() != lens_i.data_ptr()
        M.decode(q_nope, q_pe, ckv, kpe, table, lens_i, softmax_scale=0.2, schedule=s)
        lens_i[1] -= 3  # the next step's lengths written into the same inference tensor
        with pytest.raises(ValueError, match=r"schedule is stale: cache_seqlens\[1\] is 14 but was 17 when the "
                                             r"schedule was computed .*decode_schedule\(cache_seqlens, seqlen_q=1, "
                                             r"num_heads=4\)"):
            M.decode(q_nope, q_pe, ckv, kpe, table, lens_i, softmax_scale=0.2, schedule=s, check_values=True)
        M.decode(q_nope, q_pe, ckv, kpe, table, lens_i, softmax_scale=0.2, schedule=s)  # the default: unseen
        s = M.decode_schedule(lens_i, seqlen_q=1, num_heads=4)
        M.decode(q_nope, q_pe, ckv, kpe, table, lens_i, softmax_scale=0.2, schedule=s)
    # a normal tensor keeps no copy: its version counter tells
    assert M.decode_schedule(lens, seqlen_q=1, num_heads=4).seqlens_copy is None


def test_decode_schedule_metadata_errors_come_before_value_checks(host_reads):
    q_nope, q_pe, ckv, kpe, table, lens = _sched_case()
    s = M.decode_schedule(lens, seqlen_q=1, num_heads=4)
    bad = torch.tensor([5, 99, 0], dtype=torch.int32)  # also out of range, but another tensor: said first
    host_reads.clear()
    with torch.no_grad(), pytest.raises(ValueError, match="schedule is stale: it was computed from a different"):
        M.decode(q_nope, q_pe, ckv, kpe, table, bad, softmax_scale=0.2, schedule=s)
    assert host_reads == []


def test_schedule_module():
    from mla_autograd import functional, schedule
    assert M.DecodeSchedule is schedule.DecodeSchedule is functional.DecodeSchedule


@pytest.mark.parametrize("args,exc,match", [
    ((torch.tensor([3, 4]),), TypeError, "cache_seqlens must be int32, got int64"),
    ((torch.zeros(2, 2, dtype=torch.int32),), ValueError, "cache_seqlens must have 1 dimensions"),
    (([3, 4],), TypeError, "cache_seqlens must be a torch.Tensor"),
])
def test_decode_schedule_bad_seqlens(args, exc, match):
    with pytest.raises(exc, match=match):
        M.decode_schedule(*args, seqlen_q=1, num_heads=4)


@pytest.mark.parametrize("kw,match", [
    (dict(seqlen_q=-1, num_heads=4), "seqlen_q must be a non-negative int, got -1"),
    (dict(seqlen_q=1, num_heads=2.0), "num_heads must be a non-negative int, got 2.0"),
    (dict(seqlen_q=True, num_heads=4), "seqlen_q must be a non-negative int, got True"),
])
def test_decode_schedule_bad_counts(kw, match):
    with pytest.raises(ValueError, match=match):
        M.decode_schedule(torch.tensor([3], dtype=torch.int32), **kw)


def test_decode_schedule_opcheck_and_compile():
    q_nope, q_pe, ckv, kpe, table, lens = _sched_case(lens=(3, 6, 1))
    torch.library.opcheck(torch.ops.mla_autograd.mla_decode_schedule.default, (lens, 1, 4))
    sched = torch.ops.mla_autograd.mla_decode_schedule(lens, 1, 4)
    torch.library.opcheck(torch.ops.mla_autograd.mla_decode.default,
                          (q_nope, q_pe, ckv, kpe, table, lens, 0.2, True, sched))

    def step(qn, qp):
        s = M.decode_schedule(lens, seqlen_q=qn.shape[1], num_heads=qn.shape[2])
        return M.decode(qn, qp, ckv, kpe, table, lens, softmax_scale=0.2, schedule=s) * 2

    f = torch.compile(step, fullgraph=True, backend="aot_eager")
    with torch.no_grad():
        torch.testing.assert_close(f(q_nope, q_pe), step(q_nope, q_pe))
