"""GPU tests of the fmha_bwd_sm90 kernel family (SM90 fused attention backward: wgmma, TMA, warp
specialization).

Reference: mla_autograd.reference.attention_backward in float32 on the same 16-bit inputs (out and
lse from mla_autograd.reference.attention_forward, so these tests do not depend on any forward
kernel). Tolerance: FlashAttention's rule, kernel error <= 2 x the error of plain PyTorch autograd
in the same dtype (mla_autograd.testing.naive_attention) + eps. Gradients are NaN-poisoned before
the call so unwritten elements fail, and so is the kernel's fp32 workspace: the tests call the module's
test-only entry bwd_with_options(..., options) with options["poison_workspace"] (see `_bwd`), which also
forces the launch grouping (options["l2_group"]); bwd itself, what mla_autograd calls, is checked against it
bit for bit (test_bwd_entry). bench/bench_kernels.py bwd times the kernel beside cuDNN; tools/kernel_smoke.py
bwd runs small cases with a per-gradient error report.
"""
from __future__ import annotations

import hashlib
import itertools
import math

import pytest
import torch

pytestmark = pytest.mark.gpu

_CAP_OK = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)
if not _CAP_OK:
    pytest.skip("fmha_bwd_sm90 needs an SM90 GPU (compute capability 9.0)", allow_module_level=True)

from mla_autograd import reference  # noqa: E402
from mla_autograd._build import load_family  # noqa: E402
from mla_autograd.testing import BAD_VARLEN_CASES, BAD_VARLEN_ROWS, assert_error_within, naive_attention  # noqa: E402

DEV = "cuda"
DIMS = [(192, 128), (128, 128), (64, 64)]
DTYPES = [torch.bfloat16, torch.float16]
MASKS = [(False, False), (True, False), (True, True)]  # (causal, bottom_right)
SHAPES = [(1, 1), (17, 113), (113, 17), (1023, 1023), (113, 1023), (1023, 17), (97, 224)]  # 224 = 2 x BN at d = 192
HEADS = [(1, 1), (2, 2), (8, 2), (8, 1)]
EPS = 1e-4


@pytest.fixture(scope="module")
def ext():
    return load_family("fmha_bwd_sm90")


def _bwd(ext, *args, **options):
    """ext.bwd's arguments, run through ext.bwd_with_options with the fp32 workspace (lse_log2, dpsum, the dQ
    accumulator) filled with NaN and its semaphores with -1 first, so a row or block the preprocess does not
    write or clear shows up as NaN instead of as the allocator's zeros; `options` adds launch options."""
    ext.bwd_with_options(*args, {"poison_workspace": True, **options})


def _mask_id(m):
    return {(False, False): "nomask", (True, False): "causal_tl", (True, True): "causal_br"}[m]


def _inputs(shape_q, shape_k, shape_v, dtype, seed):
    g = torch.Generator(device=DEV).manual_seed(seed)
    q = torch.randn(shape_q, device=DEV, dtype=torch.float32, generator=g).to(dtype)
    k = torch.randn(shape_k, device=DEV, dtype=torch.float32, generator=g).to(dtype)
    v = torch.randn(shape_v, device=DEV, dtype=torch.float32, generator=g).to(dtype)
    return q, k, v


def _kernel_vs_reference(ext, q, k, v, *, scale, causal, bottom_right, cu_q=None, cu_k=None, msq=None, msk=None,
                         deterministic=False, seed=0, options=None):
    """Run the kernel (outputs and workspace NaN-poisoned; `options`: more launch options for _bwd) and return
    [(name, kernel grad, float32 reference grad, plain-PyTorch grad in the input dtype)] for dq, dk, dv."""
    dtype = q.dtype
    kw = dict(cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=msq, max_seqlen_k=msk,
              softmax_scale=scale, causal=causal, bottom_right=bottom_right)
    # forward in float32 on the 16-bit inputs; the kernel gets out rounded to the input dtype
    out32, lse = reference.attention_forward(q.float(), k.float(), v.float(), **kw)
    out = out32.to(dtype)
    g = torch.Generator(device=DEV).manual_seed(seed + 1)
    dout = torch.randn(out.shape, device=DEV, dtype=torch.float32, generator=g).to(dtype)
    refs = reference.attention_backward(dout.float(), q.float(), k.float(), v.float(), out32, lse.float(), **kw)
    # plain PyTorch autograd in the same precision
    qb, kb, vb = (t.detach().clone().requires_grad_(True) for t in (q, k, v))
    ob = naive_attention(qb, kb, vb, softmax_scale=scale, causal=causal, bottom_right=bottom_right,
                         cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)
    ob.backward(dout)
    # kernel, outputs poisoned
    grads = [torch.full(t.shape, float("nan"), dtype=dtype, device=DEV) for t in (q, k, v)]
    _bwd(ext, dout, q, k, v, out, lse.contiguous(), *grads, cu_q, cu_k, msq, msk, scale, causal, bottom_right,
         deterministic, **(options or {}))
    torch.cuda.synchronize()
    return list(zip(("dq", "dk", "dv"), grads, refs, (qb.grad, kb.grad, vb.grad)))


def _run_and_check(ext, q, k, v, **kw):
    results = _kernel_vs_reference(ext, q, k, v, **kw)
    for name, a, r, b in results:
        assert torch.isfinite(a).all(), f"{name}: non-finite values"
        assert_error_within(a, r, b, factor=2.0, eps=EPS, name=name)
    return tuple(a for _, a, _, _ in results)


@pytest.mark.parametrize("heads", HEADS, ids=lambda h: f"h{h[0]}x{h[1]}")
@pytest.mark.parametrize("sq_sk", SHAPES, ids=lambda s: f"sq{s[0]}_sk{s[1]}")
@pytest.mark.parametrize("mask", MASKS, ids=_mask_id)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("dims", DIMS, ids=lambda d: f"d{d[0]}_{d[1]}")
def test_dense(ext, dims, dtype, mask, sq_sk, heads):
    d, dv_ = dims
    sq, sk = sq_sk
    hq, hkv = heads
    B = 2
    q, k, v = _inputs((B, sq, hq, d), (B, sk, hkv, d), (B, sk, hkv, dv_), dtype, seed=sq * 7 + sk + hq)
    _run_and_check(ext, q, k, v, scale=1.0 / math.sqrt(d), causal=mask[0], bottom_right=mask[1])


@pytest.mark.parametrize("mask", MASKS, ids=_mask_id)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("dims", DIMS, ids=lambda d: f"d{d[0]}_{d[1]}")
def test_varlen(ext, dims, dtype, mask):
    d, dv_ = dims
    lens_q = [0, 17, 1, 113, 0, 300, 64, 65]
    lens_k = [5, 0, 17, 200, 0, 113, 64, 1]
    hq, hkv = 8, 2
    cu_q = torch.tensor([0] + list(itertools.accumulate(lens_q)), dtype=torch.int32, device=DEV)
    cu_k = torch.tensor([0] + list(itertools.accumulate(lens_k)), dtype=torch.int32, device=DEV)
    q, k, v = _inputs((sum(lens_q), hq, d), (sum(lens_k), hkv, d), (sum(lens_k), hkv, dv_), dtype, seed=3)
    _run_and_check(ext, q, k, v, scale=1.0 / math.sqrt(d), causal=mask[0], bottom_right=mask[1],
                   cu_q=cu_q, cu_k=cu_k, msq=max(lens_q), msk=max(lens_k))


@pytest.mark.parametrize("dims", DIMS, ids=lambda d: f"d{d[0]}_{d[1]}")
def test_strided_inputs(ext, dims):
    """q/k/v as non-contiguous views (padded heads / interleaved buffers); unit last-dim stride."""
    d, dv_ = dims
    B, sq, sk, hq, hkv = 2, 113, 77, 4, 2
    big_q = torch.randn(B, sq, hq + 1, d + 16, device=DEV).to(torch.bfloat16)
    kv = torch.randn(B, sk, hkv, d + dv_ + 8, device=DEV).to(torch.bfloat16)
    q = big_q[:, :, 1:, 8:8 + d]
    k = kv[..., :d]
    v = kv[..., d + 8:]
    _run_and_check(ext, q, k, v, scale=0.1, causal=True, bottom_right=True)


@pytest.mark.parametrize("dims", DIMS, ids=lambda d: f"d{d[0]}_{d[1]}")
def test_deterministic(ext, dims):
    d, dv_ = dims
    B, sq, sk, hq, hkv = 2, 200, 333, 4, 2
    q, k, v = _inputs((B, sq, hq, d), (B, sk, hkv, d), (B, sk, hkv, dv_), torch.bfloat16, seed=11)
    scale = 1.0 / math.sqrt(d)
    dq0, dk0, dv0 = _run_and_check(ext, q, k, v, scale=scale, causal=True, bottom_right=True, deterministic=True)
    out, lse = reference.attention_forward(q, k, v, softmax_scale=scale, causal=True, bottom_right=True)
    dout = torch.randn_like(out)
    first = None
    for _ in range(100):
        dq = torch.full_like(q, float("nan"))
        dk = torch.full_like(k, float("nan"))
        dv = torch.full_like(v, float("nan"))
        _bwd(ext, dout, q, k, v, out, lse, dq, dk, dv, None, None, None, None, scale, True, True, True)
        if first is None:
            first = (dq, dk, dv)
        else:
            for a, b_ in zip(first, (dq, dk, dv)):
                assert torch.equal(a.view(torch.int16), b_.view(torch.int16)), "deterministic mode not bit-identical"


def test_launch_groups(ext):
    """The main kernel's launch order takes (kv head, batch) pairs in groups (pair_group in
    fmha_bwd_sm90_scheduler.cuh); the other tests' problems are small enough to fit one group. Force 1 (one pair after
    another), 4 (9 pairs: 4, 4, 1, a smaller last group) and 0 (all interleaved) through options["l2_group"]:
    every order must give correct gradients, dense and varlen, and deterministic mode the same bits under all
    three (its sums run in K/V block order whatever the launch order)."""
    digests = []
    for group in (1, 4, 0):
        options = {"l2_group": group}
        h = hashlib.sha256()
        for (d, dv), (causal, br), det in itertools.product(DIMS, MASKS, (False, True)):
            # 3 batches x 3 kv heads = 9 (kv head, batch) pairs: groups of 4 are 4, 4, 1
            q, k, v = _inputs((3, 301, 6, d), (3, 250, 3, d), (3, 250, 3, dv), torch.bfloat16, seed=d + causal)
            grads = _run_and_check(ext, q, k, v, scale=1 / math.sqrt(d), causal=causal, bottom_right=br,
                                   deterministic=det, options=options)
            if det:
                for g in grads:
                    h.update(g.view(torch.int16).cpu().numpy().tobytes())
        lq, lk = [0, 130, 64, 257], [70, 200, 1, 300]
        cu_q = torch.tensor([0, *itertools.accumulate(lq)], device=DEV, dtype=torch.int32)
        cu_k = torch.tensor([0, *itertools.accumulate(lk)], device=DEV, dtype=torch.int32)
        for (d, dv), (causal, br) in itertools.product(DIMS, MASKS):
            q, k, v = _inputs((sum(lq), 4, d), (sum(lk), 2, d), (sum(lk), 2, dv), torch.bfloat16, seed=5)
            _run_and_check(ext, q, k, v, scale=1 / math.sqrt(d), causal=causal, bottom_right=br, cu_q=cu_q,
                           cu_k=cu_k, msq=max(lq), msk=max(lk), options=options)
        digests.append(h.hexdigest())
    assert len(set(digests)) == 1, f"deterministic gradients differ between launch orders: {digests}"


# 75 packed sequences (three 32-sequence steps of the grids' scan of cu_seqlens), long-tail lengths with runs
# of empty ones: the grids over max_seqlen x batch would be about 85% past their sequence's end
LENS_Q = [(0 if i % 11 in (4, 5, 6) else (i * 37) % 61 + (600 if i % 25 == 7 else 0)) for i in range(75)]
LENS_K = [(0 if i % 13 == 2 else (i * 53) % 97 + (500 if i % 25 == 7 else 0)) for i in range(75)]


@pytest.mark.parametrize("dims", DIMS, ids=lambda d: f"d{d[0]}_{d[1]}")
def test_compact_varlen_grids(ext, dims):
    """Packed batches run on grids over the blocks that hold rows (FmhaBwdSm90Params::kv_slots for the main
    kernel, q_slots for the preprocess and postprocess; numbered by a scan of cu_seqlens): correct gradients on
    them (the sequences taken longest first, and in cu_seqlens order with options["longest_first"] False), under
    forced launch groups, and on the grids over max_seqlen x batch (options["compact_varlen"] False), with dK and
    dV bit for bit the same on every grid (a CTA's sums do not depend on where it runs; dQ's adds may come in
    another order). Deterministic mode, whose main grid stays over max_seqlen x batch, gives all three gradients
    the same bits with and without the compact preprocess / postprocess grids."""
    d, dv = dims
    cu_q = torch.tensor([0, *itertools.accumulate(LENS_Q)], device=DEV, dtype=torch.int32)
    cu_k = torch.tensor([0, *itertools.accumulate(LENS_K)], device=DEV, dtype=torch.int32)
    q, k, v = _inputs((sum(LENS_Q), 4, d), (sum(LENS_K), 2, d), (sum(LENS_K), 2, dv), torch.bfloat16, seed=d)
    kw = dict(scale=1 / math.sqrt(d), cu_q=cu_q, cu_k=cu_k, msq=max(LENS_Q), msk=max(LENS_K))
    for causal, br in MASKS:
        runs = {}
        for name, options in (("compact", {}), ("l2_group=1", {"l2_group": 1}), ("l2_group=0", {"l2_group": 0}),
                              ("cu_order", {"longest_first": False}), ("full", {"compact_varlen": False})):
            runs[name] = _run_and_check(ext, q, k, v, causal=causal, bottom_right=br, options=options, **kw)
        for name, (_, dk, dv_) in runs.items():
            for what, a, b_ in (("dk", dk, runs["full"][1]), ("dv", dv_, runs["full"][2])):
                assert torch.equal(a.view(torch.int16), b_.view(torch.int16)), f"{what}: {name} grid != full grid"
        det = [_run_and_check(ext, q, k, v, causal=causal, bottom_right=br, deterministic=True,
                              options={"compact_varlen": c}, **kw) for c in (True, False)]
        for what, a, b_ in zip(("dq", "dk", "dv"), *det):
            assert torch.equal(a.view(torch.int16), b_.view(torch.int16)), f"deterministic {what}: compact != full"


@pytest.mark.parametrize("case", BAD_VARLEN_CASES, ids=lambda c: c.name)
def test_uncovered_rows(ext, case):
    """cu_seqlens / max_seqlen that break the rules (testing.BAD_VARLEN_CASES: a negative start, ends past the
    tensor, a decreasing pair, sequences cut at max_seqlen, int32 extremes, a max_seqlen past int32), gradients
    NaN-poisoned first: the rows no sequence covers come out 0 (the uncovered-rows kernel; the others write only
    covered rows), and the covered rows match the float32 reference, which takes the same ranges (every dims pair
    and mask). Overlapping ranges: no fault, finite gradients."""
    tq, tk = BAD_VARLEN_ROWS
    cq, ck = (torch.tensor(c, dtype=torch.int32, device=DEV) for c in (case.cu_q, case.cu_k))
    for (d, dv), (causal, br) in itertools.product(DIMS, MASKS):
        q, k, v = _inputs((tq, 4, d), (tk, 2, d), (tk, 2, dv), torch.bfloat16, seed=d + 3)
        kw = dict(cu_seqlens_q=cq, cu_seqlens_k=ck, max_seqlen_q=case.max_q, max_seqlen_k=case.max_k,
                  softmax_scale=1 / math.sqrt(d), causal=causal, bottom_right=br)
        out32, lse = reference.attention_forward(q.float(), k.float(), v.float(), **kw)
        dout = torch.randn(out32.shape, device=DEV, generator=torch.Generator(device=DEV).manual_seed(d)).bfloat16()
        refs = reference.attention_backward(dout.float(), q.float(), k.float(), v.float(), out32, lse.float(), **kw)
        grads = [torch.full(t.shape, float("nan"), dtype=t.dtype, device=DEV) for t in (q, k, v)]
        _bwd(ext, dout, q, k, v, out32.bfloat16(), lse.contiguous(), *grads, cq, ck, case.max_q, case.max_k,
             kw["softmax_scale"], causal, br, False)
        torch.cuda.synchronize()
        what = f"{case.name} d={d} {causal=} {br=}"
        for name, a in zip(("dq", "dk", "dv"), grads):
            assert torch.isfinite(a).all(), f"{what}: {name} has rows left unwritten"
        if case.overlapping:
            continue
        for name, a, r, ranges, rows in (("dq", grads[0], refs[0], case.ranges_q, tq),
                                         ("dk", grads[1], refs[1], case.ranges_k, tk),
                                         ("dv", grads[2], refs[2], case.ranges_k, tk)):
            covered = torch.zeros(rows, dtype=torch.bool, device=DEV)
            for s_, e_ in ranges:
                covered[s_:e_] = True
            assert torch.all(a[~covered] == 0), f"{what}: {name} of rows no sequence covers"
            err = (a[covered].float() - r[covered].float()).abs().max().item() if covered.any() else 0.0
            assert err <= 0.02 * max(r.abs().max().item(), 1.0), f"{what}: {name} off by {err}"


@pytest.mark.parametrize("dims", DIMS, ids=lambda d: f"d{d[0]}_{d[1]}")
def test_dq_handoff_per_warpgroup(ext, dims):
    """Each consumer warpgroup hands its half of an M-block's dQ to the reducer warp through a barrier pair of its
    own (the default), or both through one shared pair (options["dq_wg_barriers"] False): correct gradients both
    ways, dense (M-blocks ending inside a warpgroup's rows, GQA) and varlen with empty sequences, dK and dV the
    same bits, and deterministic mode all three gradients the same bits (its dQ sums run in K/V block order)."""
    d, dv = dims
    lq, lk = [0, 130, 64, 257, 1], [70, 200, 1, 300, 0]
    cu_q = torch.tensor([0, *itertools.accumulate(lq)], device=DEV, dtype=torch.int32)
    cu_k = torch.tensor([0, *itertools.accumulate(lk)], device=DEV, dtype=torch.int32)
    for (causal, br), det in itertools.product(MASKS, (False, True)):
        dense = _inputs((2, 301, 6, d), (2, 250, 3, d), (2, 250, 3, dv), torch.bfloat16, seed=d + 7)
        packed = _inputs((sum(lq), 4, d), (sum(lk), 2, d), (sum(lk), 2, dv), torch.bfloat16, seed=d + 8)
        for (q, k, v), extra in ((dense, {}), (packed, dict(cu_q=cu_q, cu_k=cu_k, msq=max(lq), msk=max(lk)))):
            runs = [_run_and_check(ext, q, k, v, scale=1 / math.sqrt(d), causal=causal, bottom_right=br,
                                   deterministic=det, options={"dq_wg_barriers": split}, **extra)
                    for split in (True, False)]
            for what, a, b_ in list(zip(("dq", "dk", "dv"), *runs))[0 if det else 1:]:
                assert torch.equal(a.view(torch.int16), b_.view(torch.int16)), \
                    f"{what} differs between the dQ hand-offs ({causal=} {br=} {det=} varlen={bool(extra)})"


@pytest.mark.parametrize("causal", [False, True], ids=["nomask", "causal"])
@pytest.mark.parametrize("dims", DIMS, ids=lambda d: f"d{d[0]}_{d[1]}")
def test_bwd_entry(ext, dims, causal):
    """ext.bwd (no options, workspace not poisoned) gives the bits of the checked, poisoned bwd_with_options path
    in deterministic mode, dense and varlen."""
    d, dv_ = dims
    scale = 1.0 / math.sqrt(d)
    cases = [((2, 1024, 16, d), (2, 1024, 4, d), (2, 1024, 4, dv_), None, None, None, None)]
    lq, lk = [0, 130, 1024, 257], [70, 1024, 1, 300]
    cu_q = torch.tensor([0, *itertools.accumulate(lq)], device=DEV, dtype=torch.int32)
    cu_k = torch.tensor([0, *itertools.accumulate(lk)], device=DEV, dtype=torch.int32)
    cases.append(((sum(lq), 8, d), (sum(lk), 2, d), (sum(lk), 2, dv_), cu_q, cu_k, max(lq), max(lk)))
    for sq_, sk_, sv_, cq, ck, msq, msk in cases:
        q, k, v = _inputs(sq_, sk_, sv_, torch.bfloat16, seed=21)
        kw = dict(cu_seqlens_q=cq, cu_seqlens_k=ck, max_seqlen_q=msq, max_seqlen_k=msk, softmax_scale=scale,
                  causal=causal, bottom_right=False)
        out, lse = reference.attention_forward(q.float(), k.float(), v.float(), **kw)
        out = out.to(q.dtype)
        dout = torch.randn(out.shape, device=DEV, generator=torch.Generator(device=DEV).manual_seed(22)).to(q.dtype)
        res = []
        for entry in ("bwd", "bwd_with_options"):
            grads = [torch.full(t.shape, float("nan"), dtype=t.dtype, device=DEV) for t in (q, k, v)]
            args = (dout, q, k, v, out, lse.contiguous(), *grads, cq, ck, msq, msk, scale, causal, False, True)
            if entry == "bwd":
                ext.bwd(*args)
            else:
                _bwd(ext, *args)
            res.append(grads)
        for name, a, b in zip(("dq", "dk", "dv"), *res):
            assert torch.isfinite(a).all(), f"bwd {name}: non-finite values"
            assert torch.equal(a.view(torch.int16), b.view(torch.int16)), f"bwd and bwd_with_options differ in {name}"


def test_zero_length(ext):
    d, dv_ = 128, 128
    q, k, v = _inputs((2, 0, 2, d), (2, 5, 2, d), (2, 5, 2, dv_), torch.bfloat16, seed=1)
    out = torch.zeros(2, 0, 2, dv_, device=DEV, dtype=torch.bfloat16)
    lse = torch.zeros(2, 2, 0, device=DEV)
    dq, dk, dv = torch.empty_like(q), torch.full_like(k, float("nan")), torch.full_like(v, float("nan"))
    ext.bwd(out, q, k, v, out, lse, dq, dk, dv, None, None, None, None, 0.1, False, False, False)
    assert (dk == 0).all() and (dv == 0).all()


def test_bad_args(ext):
    q, k, v = _inputs((1, 8, 2, 96), (1, 8, 2, 96), (1, 8, 2, 96), torch.bfloat16, seed=1)
    out = torch.zeros_like(v)
    lse = torch.zeros(1, 2, 8, device=DEV)
    with pytest.raises(RuntimeError, match="head dims"):
        ext.bwd(out, q, k, v, out, lse, torch.empty_like(q), torch.empty_like(k), torch.empty_like(v),
                None, None, None, None, 0.1, False, False, False)
