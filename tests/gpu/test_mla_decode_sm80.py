"""GPU tests of the mla_decode_sm80 kernel family (weight-absorbed MLA decode, mma.sync / cp.async).

Reference: mla_autograd.reference.decode_forward in float32 on the same 16-bit inputs. Tolerance:
FlashAttention's rule, kernel error <= 2 x (plain PyTorch in the same dtype) error + eps. Paged caches
have shuffled non-contiguous page tables and NaN in every unused page/slot; outputs are NaN-poisoned.
"""
from __future__ import annotations

import math

import pytest
import torch

pytestmark = pytest.mark.gpu

_CAP_OK = torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 0)
if not _CAP_OK:
    pytest.skip("mla_decode_sm80 needs a CUDA GPU with compute capability >= 8.0", allow_module_level=True)

from mla_autograd import reference  # noqa: E402
from mla_autograd._build import load_family  # noqa: E402

try:
    from mla_autograd.testing import assert_error_within, random_paged_cache
except ImportError:  # pragma: no cover - helpers not there yet
    assert_error_within = random_paged_cache = None

LENS = [0, 1, 17, 64, 1000, 4097]
SCALE = 1.0 / math.sqrt(192.0)
DEV = "cuda"


@pytest.fixture(scope="module")
def ext():
    return load_family("mla_decode_sm80")


def _paged_cache(lens, page_size, dtype, fused, seed):
    g = torch.Generator().manual_seed(seed)
    if random_paged_cache is not None:
        return random_paged_cache(lens, page_size=page_size, dtype=dtype, device=DEV, fused=fused, generator=g)
    # inline fallback: shuffled pages, NaN everywhere unused
    pages_per = [max(1, -(-L // page_size)) for L in lens]
    total = sum(pages_per) + 3
    buf = torch.full((total, page_size, 576), float("nan"), dtype=dtype, device=DEV)
    perm = torch.randperm(total, generator=g).tolist()
    table = torch.full((len(lens), max(pages_per)), perm[-1], dtype=torch.int32)
    nxt = 0
    for b, L in enumerate(lens):
        for p in range(pages_per[b]):
            pg = perm[nxt]; nxt += 1
            table[b, p] = pg
            used = min(page_size, L - p * page_size)
            if used > 0:
                buf[pg, :used] = torch.randn(used, 576, generator=g).to(dtype=dtype, device=DEV)
    if fused:
        return buf[..., :512], buf[..., 512:], table.to(DEV)
    return buf[..., :512].contiguous(), buf[..., 512:].contiguous(), table.to(DEV)


def _baseline(q_nope, q_pe, ckv, kpe, table, lens, scale, causal):
    """Plain PyTorch in the inputs' own dtype (the 'same precision' baseline of the tolerance rule)."""
    B, Sq, H, _ = q_nope.shape
    page = ckv.shape[1]
    out = torch.zeros_like(q_nope)
    lse = torch.full((B, H, Sq), float("-inf"), dtype=torch.float32, device=q_nope.device)
    for b, L in enumerate(lens):
        if L == 0:
            continue
        pos = torch.arange(L, device=q_nope.device)
        pg = table[b].long()[pos // page]
        k = torch.cat([ckv[pg, pos % page], kpe[pg, pos % page]], -1)  # (L, 576) dtype
        q = torch.cat([q_nope[b], q_pe[b]], -1)  # (Sq, H, 576)
        s = torch.einsum("shd,ld->hsl", q, k) * scale
        if causal:
            vis = pos[None, :] <= (L - Sq + torch.arange(Sq, device=q.device))[:, None]
            s = s.masked_fill(~vis[None], float("-inf"))
        lse[b] = torch.logsumexp(s.float(), -1)
        p = torch.nan_to_num(torch.softmax(s, -1), nan=0.0)
        out[b] = torch.einsum("hsl,ld->shd", p, k[:, :512])
    return out, lse


def _check(actual, ref, base, eps, name):
    if assert_error_within is not None:
        assert_error_within(actual, ref, base, factor=2.0, eps=eps, name=name)
        return
    a, r, bl = actual.double(), ref.double(), base.double()
    fin = torch.isfinite(r)
    assert torch.equal(torch.isfinite(a), fin), f"{name}: non-finite pattern differs"
    assert torch.equal(a[~fin], r[~fin]), f"{name}: non-finite values differ"
    if fin.any():
        err = (a[fin] - r[fin]).abs().max().item()
        be = (bl[fin] - r[fin]).abs().max().item()
        assert err <= 2 * be + eps, f"{name}: err {err:.3e} > 2 x {be:.3e} + {eps}"


def _call_tensors(lens, H, Sq, dtype):
    """Fresh random queries, the lengths, and NaN-poisoned outputs for one decode call."""
    B = len(lens)
    q_nope = torch.randn(B, Sq, H, 512, dtype=dtype, device=DEV)
    q_pe = torch.randn(B, Sq, H, 64, dtype=dtype, device=DEV)
    seqlens = torch.tensor(lens, dtype=torch.int32, device=DEV)
    out = torch.full((B, Sq, H, 512), float("nan"), dtype=dtype, device=DEV)
    lse = torch.full((B, H, Sq), float("nan"), dtype=torch.float32, device=DEV)
    return q_nope, q_pe, seqlens, out, lse


def _check_call(q_nope, q_pe, ckv, kpe, table, seqlens, lens, out, lse, causal, tag=""):
    """out / lse of a finished call against the float32 reference, with the 2x-of-plain-PyTorch rule."""
    ref_o, ref_l = reference.decode_forward(q_nope.float(), q_pe.float(), ckv.float(), kpe.float(), table, seqlens,
                                            softmax_scale=SCALE, causal=causal)
    base_o, base_l = _baseline(q_nope, q_pe, ckv, kpe, table, lens, SCALE, causal)
    _check(out.float(), ref_o.float(), base_o.float(), 1e-5, f"out {tag}")
    _check(lse, ref_l.float(), base_l, 1e-4, f"lse {tag}")


def _capture(fn):
    """A CUDA graph of fn(), after one warm-up call (builds, allocates workspace) on a side stream."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph


def _replay_and_check(graph, lens_list, q_nope, q_pe, ckv, kpe, table, seqlens, out, lse, before_replay=None):
    """Replay a captured causal decode for each lengths list (fresh queries, poisoned outputs) and check it;
    before_replay() runs after the new lengths are in place."""
    for new_lens in lens_list:
        seqlens.copy_(torch.tensor(new_lens, dtype=torch.int32))
        if before_replay is not None:
            before_replay()
        q_nope.copy_(torch.randn_like(q_nope))
        out.fill_(float("nan"))
        lse.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        _check_call(q_nope, q_pe, ckv, kpe, table, seqlens, new_lens, out, lse, True, tag=str(new_lens))


def _run_case(ext, *, lens, H, Sq, page_size, dtype, fused, causal, splits=0, seed=0, options=None):
    """One checked call: decode / decode_splits, or with `options` (LaunchOptions keywords) decode_with_options."""
    torch.manual_seed(seed)
    ckv, kpe, table = _paged_cache(lens, page_size, dtype, fused, seed)
    q_nope, q_pe, seqlens, out, lse = _call_tensors(lens, H, Sq, dtype)
    if options is not None:
        ext.decode_with_options(q_nope, q_pe, ckv, kpe, table, seqlens, out, lse, SCALE, causal,
                                ext.LaunchOptions(**options), splits)
    elif splits:
        ext.decode_splits(q_nope, q_pe, ckv, kpe, table, seqlens, out, lse, SCALE, causal, splits)
    else:
        ext.decode(q_nope, q_pe, ckv, kpe, table, seqlens, out, lse, SCALE, causal)
    torch.cuda.synchronize()
    _check_call(q_nope, q_pe, ckv, kpe, table, seqlens, lens, out, lse, causal)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("page_size", [1, 16, 64, 256])
@pytest.mark.parametrize("Sq", [1, 2, 4])
@pytest.mark.parametrize("H", [8, 16, 128])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_decode_matrix(ext, dtype, page_size, Sq, H, causal):
    # fused vs separate cache buffers alternate over the matrix (both are covered for every page size)
    fused = (H + Sq + page_size) % 2 == 0 if H != 16 else Sq != 2
    lens = LENS[:]
    torch.manual_seed(page_size * 7 + Sq)
    lens = [lens[i] for i in torch.randperm(len(lens)).tolist()]
    _run_case(ext, lens=lens, H=H, Sq=Sq, page_size=page_size, dtype=dtype, fused=fused, causal=causal,
              seed=H * 1000 + Sq * 10 + page_size)


@pytest.mark.parametrize("fused", [True, False], ids=["fused576", "separate"])
@pytest.mark.parametrize("page_size", [1, 64])
def test_decode_fused_and_separate(ext, fused, page_size):
    _run_case(ext, lens=[4097, 17, 0, 1000], H=16, Sq=2, page_size=page_size, dtype=torch.bfloat16, fused=fused,
              causal=True, seed=5)


@pytest.mark.parametrize("splits", [2, 7, 40])
@pytest.mark.parametrize("H,Sq", [(16, 1), (128, 4), (8, 2)])
def test_decode_forced_splits(ext, splits, H, Sq):
    _run_case(ext, lens=[1000, 0, 4097, 1, 17, 64], H=H, Sq=Sq, page_size=16, dtype=torch.bfloat16, fused=True,
              causal=True, splits=splits, seed=splits + H)


def test_decode_many_splits(ext):
    # more splits than the merge kernel loads at once (32): its online rescale over ten groups; a 13000-token request in
    # 300 splits of ~43 tokens, beside short and empty ones
    _run_case(ext, lens=[13000, 5, 0, 4097], H=16, Sq=1, page_size=64, dtype=torch.bfloat16, fused=True,
              causal=False, splits=300, seed=17)


@pytest.mark.parametrize("H,Sq", [(16, 1), (128, 2)])
def test_decode_auto_split_small_batch(ext, H, Sq):
    # few long requests: the device scheduler splits them across the SMs and the merge kernel combines
    _run_case(ext, lens=[20000, 3001, 0], H=H, Sq=Sq, page_size=64, dtype=torch.float16, fused=True,
              causal=True, seed=11)


def test_decode_merge_loops_over_rows(ext):
    # The merge grid is capped at eight one-warp CTAs per SM, each looping over (row, 128-dim slice) units
    # c, c + G, ... in rounds of 32. Forced splits over 70 x 4 x 128 = 35,840 rows, 143,360 units: at least 128
    # units per CTA on any GPU up to 140 SMs, so CTAs run four rounds or more.
    g = torch.Generator().manual_seed(23)
    lens = torch.randint(0, 300, (70,), generator=g).tolist()
    lens[3], lens[40] = 0, 1
    _run_case(ext, lens=lens, H=128, Sq=4, page_size=16, dtype=torch.bfloat16, fused=True, causal=True,
              splits=2, seed=23)


@pytest.mark.parametrize("B", [200, 300], ids=["inline_schedule", "metadata_kernel"])
def test_decode_merge_mixed_split_and_whole_requests(ext, B):
    # The device scheduler splits only the three long requests among short ones: a merge CTA's rows mix split
    # requests (merged) with whole ones (written by the main kernel, left untouched). decode() without a
    # schedule: B <= 256 schedules inline in the main kernel, B > 256 runs the metadata kernel first.
    g = torch.Generator().manual_seed(29)
    lens = torch.randint(0, 65, (B,), generator=g).tolist()
    for i in (7, 111, 199):
        lens[i] = 30000
    sched = ext.decode_schedule(torch.tensor(lens, dtype=torch.int32, device=DEV), 1, 16)
    splits = sched[-2 * len(lens):].view(-1, 2)[:, 1].cpu()  # reqs[B][2] = (first item, splits) end the schedule
    assert (splits[[7, 111, 199]] > 1).all() and (splits == 1).sum() >= B - 10, splits
    _run_case(ext, lens=lens, H=16, Sq=1, page_size=64, dtype=torch.bfloat16, fused=True, causal=False, seed=29)


# Launch options that make, on the GPU at hand, the choices the automatic launch makes elsewhere: the all-warps
# 16/32-row kernel (8.6/8.9, or caches with strides beyond 32 bits) at two CTAs per SM or one with the most stages
# or fewer (8.0/8.7: 3, 8.6/8.9: 2); the warp-specialized kernel with 3 or 4 stages (8.0/8.7); the 32-token 64-row
# kernel (8.0/8.7: 2 stages); plain launches without PDL (sm_80); and all of sm_80's at once.
LAUNCH_VARIANTS = {
    "all_warps_2cta": dict(warp_specialized=False),
    "all_warps_1cta": dict(warp_specialized=False, ctas_per_sm=1),
    "all_warps_1cta_3stages": dict(warp_specialized=False, ctas_per_sm=1, stages=3),
    "all_warps_1cta_2stages_no_pdl": dict(warp_specialized=False, ctas_per_sm=1, stages=2, pdl=False),
    "ws_3stages": dict(stages=3),
    "ws_4stages": dict(stages=4),
    "narrow": dict(groups=False),
    "narrow_2stages": dict(groups=False, stages=2),
    "no_pdl": dict(pdl=False),
    "sm80_like": dict(stages=2, groups=False, pdl=False),
    "no_wgmma": dict(wgmma=False),
}


@pytest.mark.parametrize("name", list(LAUNCH_VARIANTS))
def test_decode_launch_variants(ext, name):
    options = LAUNCH_VARIANTS[name]
    for H, Sq, causal in [(16, 1, False), (128, 2, True), (8, 4, True)]:
        _run_case(ext, lens=[4097, 0, 17, 1000, 1], H=H, Sq=Sq, page_size=16, dtype=torch.bfloat16, fused=True,
                  causal=causal, seed=H + Sq, options=options)


def test_launch_options_defaults_are_the_automatic_launch(ext):
    # LaunchOptions() is decode()'s launch: the same launch_info, and decode_with_options gives the same bits
    dev = torch.cuda.current_device()
    auto = ext.LaunchOptions()
    for B, Sq, H in [(4, 1, 16), (4, 2, 16), (3, 1, 128), (2, 4, 8)]:
        assert ext.launch_info(B, Sq, H, dev, auto) == ext.launch_info(B, Sq, H, dev), (B, Sq, H)
        lens = [1000, 0, 4097, 17][:B]
        ckv, kpe, table = _paged_cache(lens, 16, torch.bfloat16, True, B + H)
        q_nope, q_pe, seqlens, out, lse = _call_tensors(lens, H, Sq, torch.bfloat16)
        out2, lse2 = torch.full_like(out, float("nan")), torch.full_like(lse, float("nan"))
        ext.decode(q_nope, q_pe, ckv, kpe, table, seqlens, out, lse, SCALE, True)
        ext.decode_with_options(q_nope, q_pe, ckv, kpe, table, seqlens, out2, lse2, SCALE, True, auto)
        torch.cuda.synchronize()
        _same_bits(out2, out, f"out B={B} Sq={Sq} H={H}")
        _same_bits(lse2, lse, f"lse B={B} Sq={Sq} H={H}")
    opts = ext.LaunchOptions(stages=3, warp_specialized=False)
    assert (opts.stages, opts.ctas_per_sm, opts.warp_specialized, opts.groups, opts.pdl) == (3, 0, False, True, True)
    info = ext.launch_info(4, 1, 16, dev, opts)
    assert info["kernel"] == "all_warps" and info["stages"] <= 3, info


def test_launch_options_rejected_before_anything_runs(ext):
    lens, H, Sq = [100, 9], 16, 1
    ckv, kpe, table = _paged_cache(lens, 16, torch.bfloat16, True, 2)
    q_nope, q_pe, seqlens, out, lse = _call_tensors(lens, H, Sq, torch.bfloat16)
    dev = torch.cuda.current_device()
    for opts, match in ((ext.LaunchOptions(stages=1), "options.stages must be"),
                        (ext.LaunchOptions(stages=9), "options.stages must be"),
                        (ext.LaunchOptions(ctas_per_sm=3), "options.ctas_per_sm must be")):
        with pytest.raises(RuntimeError, match=match):
            ext.decode_with_options(q_nope, q_pe, ckv, kpe, table, seqlens, out, lse, SCALE, True, opts)
        with pytest.raises(RuntimeError, match=match):
            ext.decode_schedule_with_options(seqlens, Sq, H, opts)
        with pytest.raises(RuntimeError, match=match):
            ext.launch_info(2, Sq, H, dev, opts)
    torch.cuda.synchronize()
    assert out.isnan().all() and lse.isnan().all(), "a rejected call wrote its outputs"


WIDE_KERNELS = {  # 64-row tiles: LaunchOptions keywords, launch_info's kernel name
    "wgmma": (dict(), "wgmma_sm90"),
    "wide_groups": (dict(wgmma=False), "all_warps_wide_groups"),
    "narrow": (dict(groups=False), "all_warps_narrow"),
}
_HOPPER = torch.cuda.get_device_capability() == (9, 0)


@pytest.mark.parametrize("kernel", list(WIDE_KERNELS))
@pytest.mark.parametrize("H,Sq,causal,page_size", [(64, 1, False, 1), (128, 1, True, 64), (24, 3, True, 16),
                                                   (32, 4, True, 256), (128, 8, True, 64), (64, 2, True, 8)])
def test_decode_wide_tile(ext, kernel, H, Sq, causal, page_size):
    # 64-row tiles: on 9.0 the wgmma + TMA kernel (automatic there), the row-group kernel (automatic where it fits
    # otherwise: 64 KV tokens per step, two 4-warp groups of 32 rows that meet only at the KV stages' mbarriers)
    # and the 32-token all-warps kernel (four QK warps), on the same cases: lengths that end mid-step (17, 1000,
    # 4097: odd numbers of 32-token tiles, so the last 64-token step's second half lies past the end and is
    # zero-filled), empty requests, padding rows (24 x 3 = 72 rows), and splits (4097 tokens over several CTAs).
    # Page size 1 is below the wgmma kernel's TMA boxes: that call falls back to the row-group kernel; page size 8 is
    # the smallest it takes (eight boxes of 8 rows per 64-token block, each its own page).
    options, want = WIDE_KERNELS[kernel]
    if kernel == "wgmma" and not _HOPPER:
        pytest.skip("the wgmma kernel runs on compute capability 9.0 only")
    info = ext.launch_info(6, Sq, H, torch.cuda.current_device(), ext.LaunchOptions(**options))
    assert info["m_tile"] == 64 and info["kernel"] == want, info
    for dtype, fused in ((torch.bfloat16, True), (torch.float16, False)):
        _run_case(ext, lens=[4097, 0, 17, 1000, 1, 64], H=H, Sq=Sq, page_size=page_size, dtype=dtype,
                  fused=fused, causal=causal, seed=H * 7 + Sq, options=options)
    _run_case(ext, lens=[4097, 33], H=H, Sq=Sq, page_size=page_size, dtype=torch.bfloat16, fused=True,
              causal=causal, splits=5, seed=H + 5, options=options)


def test_qk_mbar_only_in_a_sanitizer_build(ext):
    # The warp-specialized kernel's QK warps sync on an mbarrier only in a module built with -DMLA_DECODE_QK_MBAR
    # (tools/sanitize_small.py --qk-mbar, for compute-sanitizer racecheck); the normal build uses the named barrier.
    assert ext.qk_mbar is False


def test_read_stamps_empty_in_a_normal_build(ext):
    # The per-CTA timer stamps (tools/decode_stamps.py) exist only in a module built with -DMLA_DECODE_STAMPS;
    # the normal build writes none, so read_stamps() gives an empty (0, 8) tensor even after a call.
    lens = [100, 3]
    ckv, kpe, table = _paged_cache(lens, 16, torch.bfloat16, True, 16)
    q_nope, q_pe, seqlens, out, lse = _call_tensors(lens, 16, 1, torch.bfloat16)
    ext.decode(q_nope, q_pe, ckv, kpe, table, seqlens, out, lse, SCALE, False)
    torch.cuda.synchronize()
    st = ext.read_stamps()
    assert st.shape == (0, 8) and st.dtype == torch.int64


def test_decode_odd_heads_and_sq(ext):
    for H, Sq in [(1, 1), (3, 5), (24, 8), (64, 3)]:
        _run_case(ext, lens=[513, 2, 77], H=H, Sq=Sq, page_size=32, dtype=torch.bfloat16, fused=False, causal=True,
                  seed=H + Sq)


def test_decode_cuda_graph(ext):
    torch.manual_seed(3)
    dtype, H, Sq, page = torch.bfloat16, 16, 2, 16
    cap_lens = [4097, 1000, 300, 64]
    ckv, kpe, table = _paged_cache(cap_lens, page, dtype, True, 3)
    q_nope, q_pe, seqlens, out, lse = _call_tensors(cap_lens, H, Sq, dtype)
    graph = _capture(lambda: ext.decode(q_nope, q_pe, ckv, kpe, table, seqlens, out, lse, SCALE, True))
    _replay_and_check(graph, ([4097, 1000, 300, 64], [3, 0, 299, 17], [4000, 999, 1, 64], [0, 0, 0, 0]),
                      q_nope, q_pe, ckv, kpe, table, seqlens, out, lse)


def test_decode_back_to_back(ext):
    # Many calls queued on one stream with no sync between them: each call's metadata, main and merge kernels
    # (programmatic dependent launches on sm_90) reuse the workspace the allocator hands back from the call
    # before, and every call needs a different schedule (lengths, so splits, change). A kernel that read its
    # schedule or wrote its outputs before its predecessor finished would mix calls up here.
    torch.manual_seed(5)
    dtype, H, Sq, page = torch.bfloat16, 16, 1, 64
    cap = [9000, 4097, 1000, 17]
    ckv, kpe, table = _paged_cache(cap, page, dtype, True, 5)
    calls = []
    for i in range(12):
        lens = [int(torch.randint(0, c + 1, ()).item()) for c in cap] if i % 3 else list(cap)
        calls.append((lens, *_call_tensors(lens, H, Sq, dtype)))
    torch.cuda.synchronize()
    for lens, q_nope, q_pe, seqlens, out, lse in calls:
        ext.decode(q_nope, q_pe, ckv, kpe, table, seqlens, out, lse, SCALE, False)
    torch.cuda.synchronize()
    for lens, q_nope, q_pe, seqlens, out, lse in calls:
        _check_call(q_nope, q_pe, ckv, kpe, table, seqlens, lens, out, lse, False, tag=str(lens))


def test_decode_rejects_bad_inputs(ext):
    B, Sq, H = 2, 1, 16
    q_nope = torch.randn(B, Sq, H, 512, dtype=torch.bfloat16, device=DEV)
    q_pe = torch.randn(B, Sq, H, 64, dtype=torch.bfloat16, device=DEV)
    ckv, kpe, table = _paged_cache([5, 9], 16, torch.bfloat16, True, 0)
    seqlens = torch.tensor([5, 9], dtype=torch.int32, device=DEV)
    out = torch.empty(B, Sq, H, 512, dtype=torch.bfloat16, device=DEV)
    lse = torch.empty(B, H, Sq, dtype=torch.float32, device=DEV)
    with pytest.raises(RuntimeError, match="q_pe"):
        ext.decode(q_nope, q_pe.half(), ckv, kpe, table, seqlens, out, lse, SCALE, False)
    with pytest.raises(RuntimeError, match="cache_seqlens"):
        ext.decode(q_nope, q_pe, ckv, kpe, table, seqlens.long(), out, lse, SCALE, False)
    with pytest.raises(RuntimeError, match="block_table"):
        ext.decode(q_nope, q_pe, ckv, kpe, table[:1], seqlens, out, lse, SCALE, False)
    with pytest.raises(RuntimeError, match="page_size"):
        c3 = torch.randn(4, 3, 576, dtype=torch.bfloat16, device=DEV)
        ext.decode(q_nope, q_pe, c3[..., :512], c3[..., 512:], table, seqlens, out, lse, SCALE, False)


# ---- precomputed schedules (decode_schedule once per step, decode(..., schedule=) per layer) ----


def _same_bits(a, b, name):
    assert a.shape == b.shape and a.dtype == b.dtype, name
    ai = a.view(torch.int16) if a.element_size() == 2 else a.view(torch.int32)
    bi = b.view(torch.int16) if b.element_size() == 2 else b.view(torch.int32)
    assert torch.equal(ai, bi), f"{name}: not bit-identical ({int((ai != bi).sum())} elements differ)"


@pytest.mark.parametrize("options", [None, dict(pdl=False), dict(warp_specialized=False, ctas_per_sm=2)],
                         ids=["auto", "no_pdl", "all_warps_2cta"])
@pytest.mark.parametrize("lens,H,Sq,splits", [([4097, 0, 17, 1000, 1], 16, 1, 0), ([20000, 3001, 0], 128, 2, 0),
                                              ([513, 2, 77], 24, 3, 0), ([1000, 0, 4097, 17], 16, 1, 7)])
def test_decode_schedule_bit_identical(ext, options, lens, H, Sq, splits):
    ckv, kpe, table = _paged_cache(lens, 16, torch.bfloat16, True, H + Sq)
    q_nope, q_pe, seqlens, out, lse = _call_tensors(lens, H, Sq, torch.bfloat16)
    out2, lse2 = torch.full_like(out, float("nan")), torch.full_like(lse, float("nan"))
    if options is not None:  # the test entry points, with a schedule made for the same options
        opts = ext.LaunchOptions(**options)
        ext.decode_with_options(q_nope, q_pe, ckv, kpe, table, seqlens, out, lse, SCALE, True, opts, splits)
        sched = ext.decode_schedule_with_options(seqlens, Sq, H, opts, splits)
        ext.decode_with_options(q_nope, q_pe, ckv, kpe, table, seqlens, out2, lse2, SCALE, True, opts, splits,
                                schedule=sched)
    elif splits:
        ext.decode_splits(q_nope, q_pe, ckv, kpe, table, seqlens, out, lse, SCALE, True, splits)
        sched = ext.decode_schedule(seqlens, Sq, H, splits)
        ext.decode_splits(q_nope, q_pe, ckv, kpe, table, seqlens, out2, lse2, SCALE, True, splits, schedule=sched)
    else:
        ext.decode(q_nope, q_pe, ckv, kpe, table, seqlens, out, lse, SCALE, True)
        sched = ext.decode_schedule(seqlens, Sq, H)
        ext.decode(q_nope, q_pe, ckv, kpe, table, seqlens, out2, lse2, SCALE, True, schedule=sched)
    torch.cuda.synchronize()
    _same_bits(out2, out, "out")
    _same_bits(lse2, lse, "lse")
    _check_call(q_nope, q_pe, ckv, kpe, table, seqlens, lens, out2, lse2, True)


def test_decode_schedule_reused_over_layers(ext):
    # one schedule for three "layers": different queries and caches, the same lengths (and seqlens tensor)
    lens, H, Sq = [9000, 4097, 0, 17, 1000], 16, 1
    seqlens = torch.tensor(lens, dtype=torch.int32, device=DEV)
    sched = ext.decode_schedule(seqlens, Sq, H)
    layers = []
    for layer in range(3):
        ckv, kpe, table = _paged_cache(lens, 64, torch.bfloat16, layer != 1, 100 + layer)
        q_nope, q_pe, _, out, lse = _call_tensors(lens, H, Sq, torch.bfloat16)
        ext.decode(q_nope, q_pe, ckv, kpe, table, seqlens, out, lse, SCALE, True, schedule=sched)
        layers.append((q_nope, q_pe, ckv, kpe, table, out, lse))
    torch.cuda.synchronize()
    for layer, (q_nope, q_pe, ckv, kpe, table, out, lse) in enumerate(layers):
        out1, lse1 = torch.full_like(out, float("nan")), torch.full_like(lse, float("nan"))
        ext.decode(q_nope, q_pe, ckv, kpe, table, seqlens, out1, lse1, SCALE, True)
        torch.cuda.synchronize()
        _same_bits(out, out1, f"out layer {layer}")
        _same_bits(lse, lse1, f"lse layer {layer}")
        _check_call(q_nope, q_pe, ckv, kpe, table, seqlens, lens, out, lse, True, tag=f"layer {layer}")


@pytest.mark.parametrize("inside", [True, False], ids=["schedule_in_graph", "schedule_outside"])
def test_decode_schedule_cuda_graph(ext, inside):
    dtype, H, Sq, page = torch.bfloat16, 16, 2, 16
    cap_lens = [4097, 1000, 300, 64]
    ckv, kpe, table = _paged_cache(cap_lens, page, dtype, True, 7)
    q_nope, q_pe, seqlens, out, lse = _call_tensors(cap_lens, H, Sq, dtype)
    static_sched = ext.decode_schedule(seqlens, Sq, H)

    def step():
        sched = ext.decode_schedule(seqlens, Sq, H) if inside else static_sched
        for _ in range(2):  # two "layers" share the schedule
            ext.decode(q_nope, q_pe, ckv, kpe, table, seqlens, out, lse, SCALE, True, schedule=sched)

    def plan_outside():  # this step's plan, outside the graph, into the buffer the graph reads
        static_sched.copy_(ext.decode_schedule(seqlens, Sq, H))

    _replay_and_check(_capture(step), ([3, 0, 299, 17], [4097, 1000, 300, 64], [4000, 999, 1, 64], [0, 0, 0, 0]),
                      q_nope, q_pe, ckv, kpe, table, seqlens, out, lse, None if inside else plan_outside)


@pytest.mark.parametrize("B,splits", [(4, 0), (200, 0), (256, 0), (300, 0), (1000, 0), (37, 5)])
def test_decode_schedule_items_cover_every_request(ext, B, splits):
    # The schedule itself (decode_schedule, the metadata kernel; B <= 256 and B > 256 write the items on
    # different paths): request b's splits are items first .. first + n - 1, in order, each (b, j, begin, end)
    # with 32-token-aligned begins, together covering [0, L) once, sizes within one 32-token tile of each
    # other; the items past the last used one are (-1, 0, 0, 0).
    g = torch.Generator().manual_seed(B + splits)
    lens = torch.randint(0, 3000, (B,), generator=g)
    lens[0], lens[-1] = 0, 40000
    lens[B // 2] = 1
    sched = ext.decode_schedule(lens.to(torch.int32).to(DEV), 1, 16, splits).cpu()
    num_items = (sched.numel() - 2 * B) // 4
    items, reqs = sched[: num_items * 4].view(-1, 4), sched[num_items * 4:].view(-1, 2)
    nxt = 0
    for b in range(B):
        first, n = reqs[b].tolist()
        L = int(lens[b])
        assert first == nxt and n >= 1, (b, first, n, nxt)
        if splits and L >= 32 * splits:
            assert n == splits, (b, n)
        got = items[first:first + n].tolist()
        assert [r[:2] for r in got] == [[b, j] for j in range(n)], (b, got)
        bounds = [r[2:] for r in got]
        assert bounds[0][0] == 0 and bounds[-1][1] == L, (b, L, bounds)
        assert all(bounds[j][1] == bounds[j + 1][0] for j in range(n - 1)), (b, bounds)
        assert all(lo % 32 == 0 and hi > lo for lo, hi in bounds) or L == 0, (b, bounds)
        tiles = [-(-hi // 32) - lo // 32 for lo, hi in bounds]
        assert max(tiles) - min(tiles) <= 1, (b, tiles)
        nxt += n
    assert (items[nxt:] == torch.tensor([-1, 0, 0, 0], dtype=torch.int32)).all()


@pytest.mark.parametrize("B", [1, 4, 7, 8, 33])
def test_decode_schedule_fills_one_wave(ext, B):
    # Equal long requests: the split rule's counts, round(x / T), are rounded down when they would need more than
    # num_parts items, so the used items never exceed num_parts (one wave of CTAs); they still fill most of it.
    # Before: 7 x 1024 tiles on 132 SMs gave 19 splits each, 133 items, one CTA in a second wave.
    lens = torch.full((B,), 32768, dtype=torch.int32, device=DEV)
    sched = ext.decode_schedule(lens, 1, 16).cpu()
    num_items = (sched.numel() - 2 * B) // 4
    num_parts = num_items - B  # num_items = B + num_parts without forced splits
    splits = sched[num_items * 4:].view(-1, 2)[:, 1]
    used = int(splits.sum())
    assert 0.9 * num_parts <= used <= num_parts, (used, num_parts)
    assert (splits == splits[0]).all(), splits


def test_decode_schedule_fake_size_is_real_size(ext):
    from torch._subclasses.fake_tensor import FakeTensorMode

    import mla_autograd as M
    from mla_autograd import _ops

    dev = torch.device(DEV, torch.cuda.current_device())
    for B, Sq, H in [(1, 1, 16), (128, 1, 16), (4, 1, 128), (3, 2, 16), (5, 4, 128), (2, 8, 8), (7, 3, 64), (2, 1, 8)]:
        seqlens = torch.randint(1, 5000, (B,), dtype=torch.int32, device=DEV)
        real = ext.decode_schedule(seqlens, Sq, H).numel()
        assert _ops.schedule_numel(dev, B, Sq, H) == real, (B, Sq, H)
        with FakeTensorMode() as mode:
            fake = torch.ops.mla_autograd.mla_decode_schedule(mode.from_tensor(seqlens), Sq, H)
        assert fake.shape == (real,) and fake.dtype == torch.int32, (B, Sq, H, tuple(fake.shape), real)
        assert M.decode_schedule(seqlens, seqlen_q=Sq, num_heads=H).tensor.numel() == real, (B, Sq, H)
    for splits in (1, 7):
        seqlens = torch.randint(1, 5000, (6,), dtype=torch.int32, device=DEV)
        assert ext.decode_schedule(seqlens, 1, 16, splits).numel() == ext.schedule_numel(6, 1, 16, dev.index, splits)
        assert ext.decode_schedule(seqlens, 1, 16, splits).numel() == 6 * splits * 4 + 6 * 2


def test_decode_schedule_rejects_bad_schedules(ext):
    lens, H, Sq = [513, 9, 77], 16, 1
    ckv, kpe, table = _paged_cache(lens, 16, torch.bfloat16, True, 1)
    q_nope, q_pe, seqlens, out, lse = _call_tensors(lens, H, Sq, torch.bfloat16)
    good = ext.decode_schedule(seqlens, Sq, H)
    bad = [(ext.decode_schedule(seqlens, Sq, 128), "schedule has .* elements but this call"),  # another H
           (good[:-1], "schedule has .* elements but this call"),
           (good.long(), "schedule must be int32"),
           (good.cpu(), "schedule must be on"),
           (good.view(-1, 2), "schedule must be a contiguous 1-D tensor")]
    torch.cuda.synchronize()
    for sched, match in bad:
        with pytest.raises(RuntimeError, match=match):
            ext.decode(q_nope, q_pe, ckv, kpe, table, seqlens, out, lse, SCALE, True, schedule=sched)
    with pytest.raises(RuntimeError, match="num_splits=3"):  # decode_splits wants its own num_items
        ext.decode_splits(q_nope, q_pe, ckv, kpe, table, seqlens, out, lse, SCALE, True, 3, schedule=good)
    torch.cuda.synchronize()
    assert out.isnan().all() and lse.isnan().all(), "a rejected call wrote its outputs"
    with pytest.raises(RuntimeError, match="cache_seqlens must be a CUDA tensor"):
        ext.decode_schedule(seqlens.cpu(), Sq, H)
    with pytest.raises(RuntimeError, match="cache_seqlens must be int32"):
        ext.decode_schedule(seqlens.long(), Sq, H)
    with pytest.raises(RuntimeError, match="seqlen_q must be in"):
        ext.decode_schedule(seqlens, 0, H)
    with pytest.raises(RuntimeError, match="num_heads must be in"):
        ext.decode_schedule(seqlens, Sq, 0)


def test_decode_schedule_functional_api():
    # the public API on the kernel path: same bits with and without a schedule; stale schedules rejected
    import mla_autograd as M

    lens, H, Sq = [4097, 17, 0, 1000], 16, 2
    ckv, kpe, table = _paged_cache(lens, 64, torch.bfloat16, True, 9)
    q_nope, q_pe, seqlens, _, _ = _call_tensors(lens, H, Sq, torch.bfloat16)
    with torch.inference_mode():
        s = M.decode_schedule(seqlens, seqlen_q=Sq, num_heads=H)
        assert s.tensor.numel() > 0 and s.tensor.device == seqlens.device
        o1, l1 = M.decode(q_nope, q_pe, ckv, kpe, table, seqlens, softmax_scale=SCALE, return_lse=True, schedule=s)
        o0, l0 = M.decode(q_nope, q_pe, ckv, kpe, table, seqlens, softmax_scale=SCALE, return_lse=True)
        _same_bits(o1, o0, "out")
        _same_bits(l1, l0, "lse")
        seqlens += 1  # seqlens is a normal tensor (made outside inference_mode): its version counter moves
        with pytest.raises(ValueError, match="schedule is stale"):  # (the idle slot's 1 < Sq: values unchecked)
            M.decode(q_nope, q_pe, ckv, kpe, table, seqlens, softmax_scale=SCALE, check_values=False, schedule=s)


WGMMA_LENS = [0, 1, 31, 32, 33, 63, 64, 65, 127, 129, 1000, 4097]


@pytest.mark.skipif(not _HOPPER, reason="the wgmma kernel runs on compute capability 9.0 only")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("page_size", [8, 16, 32, 64, 256])
@pytest.mark.parametrize("H,Sq", [(64, 1), (128, 1), (128, 2), (16, 5), (40, 2)])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_decode_wgmma_pages_and_lengths(ext, dtype, page_size, H, Sq, causal):
    # The TMA loader reads boxes of min(page, 32) rows; lengths at and around the 32-token split grain and the
    # 64-token block, pages smaller and larger than a block, padding rows (16 x 5 = 80, 40 x 2 = 80 rows: a
    # second m-block with 16 real rows), NaN in every unused page slot (the last page's tail is zeroed in smem)
    fused = (page_size + H + Sq) % 2 == 0
    lens = [WGMMA_LENS[i] for i in torch.randperm(len(WGMMA_LENS), generator=torch.Generator().manual_seed(page_size)).tolist()]
    assert ext.launch_info(len(lens), Sq, H, torch.cuda.current_device())["kernel"] == "wgmma_sm90"
    _run_case(ext, lens=lens, H=H, Sq=Sq, page_size=page_size, dtype=dtype, fused=fused, causal=causal,
              seed=page_size * 31 + H + Sq)


@pytest.mark.skipif(not _HOPPER, reason="the wgmma kernel runs on compute capability 9.0 only")
@pytest.mark.parametrize("splits", [2, 3, 7, 40])
@pytest.mark.parametrize("page_size", [16, 64, 256])
def test_decode_wgmma_forced_splits(ext, splits, page_size):
    # split ranges start on 32-token boundaries, so a 64-token block of a split can straddle two pages (page 64) or
    # start mid-page (256); every split but a request's last ends where the next begins, masked by the kernel
    _run_case(ext, lens=[4097, 65, 0, 1000], H=128, Sq=1, page_size=page_size, dtype=torch.bfloat16, fused=True,
              causal=True, splits=splits, seed=splits + page_size)
    _run_case(ext, lens=[2049, 3], H=64, Sq=2, page_size=page_size, dtype=torch.float16, fused=False,
              causal=False, splits=splits, seed=splits * 3 + page_size)


@pytest.mark.skipif(not _HOPPER, reason="the wgmma kernel runs on compute capability 9.0 only")
def test_decode_wgmma_matches_row_group_kernel(ext):
    # the same call through the wgmma kernel and the row-group kernel: both within the tolerance of the float32
    # reference (checked in _run_case), and close to each other
    lens = [4097, 1000, 17, 0, 64]
    ckv, kpe, table = _paged_cache(lens, 64, torch.bfloat16, True, 11)
    q_nope, q_pe, seqlens, out, lse = _call_tensors(lens, 128, 1, torch.bfloat16)
    out2, lse2 = torch.full_like(out, float("nan")), torch.full_like(lse, float("nan"))
    ext.decode(q_nope, q_pe, ckv, kpe, table, seqlens, out, lse, SCALE, True)
    ext.decode_with_options(q_nope, q_pe, ckv, kpe, table, seqlens, out2, lse2, SCALE, True,
                            ext.LaunchOptions(wgmma=False))
    torch.cuda.synchronize()
    torch.testing.assert_close(out.float(), out2.float(), atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(lse, lse2, atol=1e-3, rtol=1e-3)
