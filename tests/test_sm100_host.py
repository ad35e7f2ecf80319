"""CPU tests of the SM100 (Blackwell) families' host side: they build fmha_fwd_sm100 and fmha_bwd_sm100
(for sm_100a, through mla_autograd._build.load_family, the same cached build the compile check uses)
and check the pure-host planners plan_fwd / plan_bwd (which validate and pack exactly what fwd / bwd
launch, but launch nothing) against hand-computed values, plus the error messages for bad inputs.
No GPU is needed; tensors are meta tensors. Skipped when nvcc or the CUTLASS headers are missing.
"""
from __future__ import annotations

import itertools
import shutil

import pytest
import torch

try:
    from mla_autograd._build import family_available, load_family
except Exception as exc:  # pragma: no cover - package not importable
    pytest.skip(f"mla_autograd._build not importable: {exc}", allow_module_level=True)

for _fam in ("fmha_fwd_sm100", "fmha_bwd_sm100"):
    _ok, _why = family_available(_fam)
    if not _ok:
        pytest.skip(f"cannot build {_fam} here: {_why}", allow_module_level=True)
if shutil.which("nvcc") is None:
    pytest.skip("nvcc not found", allow_module_level=True)

M = "meta"
BF, FP = torch.bfloat16, torch.float16
INT32_MAX = 2**31 - 1


@pytest.fixture(scope="module")
def fwd():
    return load_family("fmha_fwd_sm100")


@pytest.fixture(scope="module")
def bwd():
    return load_family("fmha_bwd_sm100")


def t(*shape, dtype=BF):
    return torch.empty(*shape, dtype=dtype, device=M)


def cu_of(lens):
    return torch.tensor([0] + list(itertools.accumulate(lens)), dtype=torch.int32)


def dense_args(B, Sq, Sk, Hq, Hk, dqk, dvo, dtype=BF):
    q, k, v = t(B, Sq, Hq, dqk, dtype=dtype), t(B, Sk, Hk, dqk, dtype=dtype), t(B, Sk, Hk, dvo, dtype=dtype)
    out, lse = t(B, Sq, Hq, dvo, dtype=dtype), t(B, Hq, Sq, dtype=torch.float32)
    return q, k, v, out, lse


def varlen_args(lens_q, lens_k, Hq, Hk, dqk, dvo, dtype=BF):
    Tq, Tk = sum(lens_q), sum(lens_k)
    q, k, v = t(Tq, Hq, dqk, dtype=dtype), t(Tk, Hk, dqk, dtype=dtype), t(Tk, Hk, dvo, dtype=dtype)
    out, lse = t(Tq, Hq, dvo, dtype=dtype), t(Hq, Tq, dtype=torch.float32)
    return q, k, v, out, lse, cu_of(lens_q), cu_of(lens_k), max(lens_q), max(lens_k)


def bwd_dense(B, Sq, Sk, Hq, Hk, dqk, dvo, dtype=BF):
    q, k, v, out, lse = dense_args(B, Sq, Sk, Hq, Hk, dqk, dvo, dtype)
    return (t(*out.shape, dtype=dtype), q, k, v, out, lse, t(*q.shape, dtype=dtype), t(*k.shape, dtype=dtype),
            t(*v.shape, dtype=dtype))


# ---------------------------------------------------------------- forward plans (design note, section 4)
def test_fwd_dense_mla_b2_s4096_h128(fwd):
    q, k, v, out, lse = dense_args(2, 4096, 4096, 128, 128, 192, 128)
    p = fwd.plan_fwd(q, k, v, out, lse, None, None, None, None, 192 ** -0.5, False, False)
    assert p["kernel"] == "fmha_fwd_sm100<bf16,192x128,residual,varlen>"
    assert p["tile_shape"] == (256, 128, (128, 64))
    # dense goes through the varlen problem shape: cu = arange(B+1) * S, total = B * S
    assert p["problem_shape"] == ((4096, 8192), (4096, 8192), (128, 64), ((1, 128), 2))
    assert p["cu_rewrite"] == "none" and p["batches_launched"] == 2
    assert p["stride_q"] == (24576, 1, ((192, 192), 0))
    assert p["stride_k"] == (24576, 1, ((0, 192), 0))
    assert p["stride_v"] == (16384, 1, ((0, 128), 0))
    assert p["stride_o"] == (16384, 1, ((128, 128), 0))
    # lse (B, H, S): row offset cu[b] = b*4096, so the batch stride is H*S - S = 524288 - 4096
    assert p["stride_lse"] == (1, ((4096, 4096), 524288 - 4096))
    assert p["grid"] == (16, 128, 2) and p["threads"] == 512
    assert not (p["copy_q"] or p["copy_k"] or p["copy_v"] or p["lse_staging"])
    # out from a plain allocation: staged through a padded buffer (max_q rows in front), then copied
    assert p["out_pad_rows"] == 4096 and p["out_staging"]
    assert p["out_staging_bytes"] == (4096 + 8192) * 128 * 128 * 2
    assert 0 < p["smem_bytes"] <= 232448
    assert p["workspace_bytes"] == 0


def test_fwd_out_with_own_padding_is_written_in_place(fwd):
    q, k, v, _, lse = dense_args(2, 4096, 4096, 128, 128, 192, 128)
    pad = fwd.out_pad_rows(4096)
    assert pad == 4096
    buf = t(pad * 128 * 128 + 2 * 4096 * 128 * 128)
    out = buf[pad * 128 * 128:].view(2, 4096, 128, 128)
    p = fwd.plan_fwd(q, k, v, out, lse, None, None, None, None, 0.07, True, False)
    assert not p["out_staging"] and p["out_staging_bytes"] == 0
    assert p["mask"] == "causal_top_left"


def test_fwd_varlen_gqa_128(fwd):
    q, k, v, out, lse, cq, ck, mq, mk = varlen_args([4096, 3000, 2904], [4096, 3000, 2904], 32, 8, 128, 128)
    p = fwd.plan_fwd(q, k, v, out, lse, cq, ck, mq, mk, 128 ** -0.5, False, False)
    # an empty batch 0 is prepended (B+1 launched batches) so CUTLASS's debug print never fires
    assert p["cu_rewrite"] == "prepend_empty_batch" and p["cu_entries"] == 5
    assert p["problem_shape"] == ((4096, 10000), (4096, 10000), 128, ((4, 8), 4))
    assert p["stride_q"] == (4096, 1, ((128, 512), 0))
    assert p["stride_k"] == (1024, 1, ((0, 128), 0))
    assert p["stride_v"] == (1024, 1, ((0, 128), 0))
    assert p["stride_lse"] == (1, ((10000, 40000), 0))
    assert p["out_pad_rows"] == 4096 and p["out_staging_bytes"] == (4096 + 10000) * 32 * 128 * 2
    assert p["grid"] == (16, 32, 4)


def test_fwd_bottom_right_split(fwd):
    # varlen bottom-right causal: every sequence split into (rows without keys, rest) -> 2B+1 batches
    q, k, v, out, lse, cq, ck, mq, mk = varlen_args([17, 300, 1], [5, 400, 0], 4, 4, 192, 128, FP)
    p = fwd.plan_fwd(q, k, v, out, lse, cq, ck, mq, mk, 0.1, True, True)
    assert p["kernel"] == "fmha_fwd_sm100<fp16,192x128,causal_bottom_right,varlen>"
    assert p["cu_rewrite"] == "split_bottom_right" and p["batches_launched"] == 7 and p["cu_entries"] == 8
    assert not p["lse_staging"]
    # dense with s_q > s_k: same split, lse staged (launched batch index != user batch index)
    q, k, v, out, lse = dense_args(3, 300, 128, 4, 2, 128, 128)
    p = fwd.plan_fwd(q, k, v, out, lse, None, None, None, None, 0.1, True, True)
    assert p["cu_rewrite"] == "split_bottom_right" and p["batches_launched"] == 7 and p["launches"] == 1
    assert p["lse_staging"] and p["lse_staging_bytes"] == 4 * 900 * 4
    # ... unless the batches are launched one at a time (s_k = 40 leaves a partial key tile): each launch
    # splits its one batch and writes lse in place at the batch's offset
    q, k, v, out, lse = dense_args(3, 100, 40, 4, 2, 128, 128)
    p = fwd.plan_fwd(q, k, v, out, lse, None, None, None, None, 0.1, True, True)
    assert p["cu_rewrite"] == "split_bottom_right" and p["batches_launched"] == 3 and p["launches"] == 3
    assert not p["lse_staging"] and p["stride_lse"] == (1, ((100, 200), 0))
    # s_q <= s_k needs no split
    q, k, v, out, lse = dense_args(3, 40, 100, 4, 2, 128, 128)
    p = fwd.plan_fwd(q, k, v, out, lse, None, None, None, None, 0.1, True, True)
    assert p["cu_rewrite"] == "none" and not p["lse_staging"]


def test_fwd_strided_inputs(fwd):
    B, S, H, D = 2, 64, 4, 192
    # packed qkv (B, S, 3, H, D): slices keep batch/seq mergeable -> no copy, row stride 3*H*D
    qkv = t(B, S, 3, H, D)
    q, k = qkv[:, :, 0], qkv[:, :, 1]
    v = t(B, S, 3, H, 128)[:, :, 2]
    out, lse = t(B, S, H, 128), t(B, H, S, dtype=torch.float32)
    p = fwd.plan_fwd(q, k, v, out, lse, None, None, None, None, 0.1, False, False)
    assert p["stride_q"] == (3 * H * D, 1, ((D, D), 0)) and not p["copy_q"]
    # (B, H, S, D).transpose(1, 2): batch and seq not mergeable -> copied to contiguous
    qt = t(B, H, S, D).transpose(1, 2)
    p = fwd.plan_fwd(qt, k, v, out, lse, None, None, None, None, 0.1, False, False)
    assert p["copy_q"] and p["stride_q"] == (H * D, 1, ((D, D), 0))


def test_fwd_empty(fwd):
    q, k, v, out, lse = dense_args(2, 7, 0, 2, 2, 128, 128)
    assert fwd.plan_fwd(q, k, v, out, lse, None, None, None, None, 0.1, True, True)["empty"] == "no_keys"
    q, k, v, out, lse = dense_args(2, 0, 9, 2, 2, 128, 128)
    assert fwd.plan_fwd(q, k, v, out, lse, None, None, None, None, 0.1, True, True)["empty"] == "no_query_rows"
    q, k, v, out, lse = dense_args(2, 7, 9, 2, 2, 128, 128)
    assert fwd.plan_fwd(q, k, v, out, lse, None, None, None, None, 0.1, True, True)["empty"] is None


@pytest.mark.parametrize("dtype", [BF, FP], ids=str)
@pytest.mark.parametrize("dims", [(192, 128), (128, 128)], ids=lambda d: f"d{d[0]}")
@pytest.mark.parametrize("mask", [(False, False), (True, False), (True, True)], ids=["none", "tl", "br"])
def test_every_instantiation_linked(fwd, bwd, dtype, dims, mask):
    """smem of every compiled (dtype, dims, mask) variant, fwd and bwd (also proves each one is linked)."""
    q, k, v, out, lse = dense_args(1, 64, 64, 2, 2, dims[0], dims[1], dtype)
    pf = fwd.plan_fwd(q, k, v, out, lse, None, None, None, None, 0.1, *mask)
    pb = bwd.plan_bwd(*bwd_dense(1, 64, 64, 2, 2, dims[0], dims[1], dtype), None, None, None, None, 0.1, *mask, False)
    # values of CUTLASS 4.2's kernels (design note: fwd MLA 180,448 / 128x128 164,080 with the
    # individual tile scheduler; bwd 128x128 231,620 / MLA 198,852); SM100 opt-in limit 232,448
    assert pf["smem_bytes"] == (180448 if dims[0] == 192 else 164080)
    assert pb["smem_bytes"] == (198852 if dims[0] == 192 else 231620)
    # the MLA backward runs top-left calls (here Sq == Sk) with its bottom-right kernel
    assert pb["mask_requested"] == {(False, False): "residual", (True, False): "causal_top_left",
                                    (True, True): "causal_bottom_right"}[mask]
    if dims[0] == 192 and mask == (True, False):
        assert pb["mask"] == "causal_bottom_right"
    else:
        assert pb["mask"] == pb["mask_requested"]


@pytest.mark.parametrize("lens_q,lens_k,same_cu,ok", [
    ([300, 17], [300, 17], True, True),     # one cu_seqlens tensor: every Sq == Sk
    ([300, 17], [300, 17], False, False),   # two tensors: their values are never read, so not provably equal
    ([300, 17], [400, 17], False, False),
])
def test_bwd_mla_top_left_varlen_only_with_one_cu_tensor(bwd, lens_q, lens_k, same_cu, ok):
    q, k, v, out, lse, cq, ck, mq, mk = varlen_args(lens_q, lens_k, 4, 4, 192, 128)
    if same_cu:
        ck = cq
    args = (t(*out.shape), q, k, v, out, lse, t(*q.shape), t(*k.shape), t(*v.shape), cq, ck, mq, mk, 0.1, True, False,
            False)
    if ok:
        p = bwd.plan_bwd(*args)
        assert p["mask"] == "causal_bottom_right" and p["mask_requested"] == "causal_top_left"
    else:
        with pytest.raises(RuntimeError, match="top-left diagonal mask is wrong"):
            bwd.plan_bwd(*args)


def test_bwd_mla_top_left_dense_unequal_lengths_refused(bwd):
    with pytest.raises(RuntimeError, match="top-left diagonal mask is wrong"):
        bwd.plan_bwd(*bwd_dense(1, 100, 300, 4, 4, 192, 128), None, None, None, None, 0.1, True, False, False)
    p = bwd.plan_bwd(*bwd_dense(1, 100, 300, 4, 4, 128, 128), None, None, None, None, 0.1, True, False, False)
    assert p["mask"] == "causal_top_left"  # the 128x128 kernel's top-left mask is right


def test_fwd_int32_output_offset_refused(fwd):
    """Example 77's varlen epilogue moves the output pointer back by max_seqlen_q * row stride in int32:
    128/128 with 128 heads and max_seqlen_q = 131072 is exactly 2^31 and is refused; one row less plans."""
    q, k, v, out, lse = dense_args(1, 131072, 131072, 128, 128, 128, 128)
    with pytest.raises(RuntimeError, match="output row stride"):
        fwd.plan_fwd(q, k, v, out, lse, None, None, None, None, 0.1, False, False)
    q, k, v, out, lse = dense_args(1, 131071, 131071, 128, 128, 128, 128)
    fwd.plan_fwd(q, k, v, out, lse, None, None, None, None, 0.1, False, False)


@pytest.mark.parametrize("scale", [0.0, -0.1, float("inf"), float("nan")])
def test_one_softmax_scale_rule(fwd, bwd, scale):
    q, k, v, out, lse = dense_args(1, 16, 16, 2, 2, 128, 128)
    with pytest.raises(RuntimeError, match="softmax_scale must be a finite number > 0"):
        fwd.plan_fwd(q, k, v, out, lse, None, None, None, None, scale, False, False)
    with pytest.raises(RuntimeError, match="softmax_scale must be a finite number > 0"):
        bwd.plan_bwd(*bwd_dense(1, 16, 16, 2, 2, 128, 128), None, None, None, None, scale, False, False, False)


# ---------------------------------------------------------------- backward plans
def test_bwd_varlen_gqa_128_workspace(bwd):
    q, k, v, out, lse, cq, ck, mq, mk = varlen_args([4096, 3000, 2904], [4096, 3000, 2904], 32, 8, 128, 128)
    p = bwd.plan_bwd(t(*out.shape), q, k, v, out, lse, t(*q.shape), t(*k.shape), t(*v.shape), cq, ck, mq, mk,
                     128 ** -0.5, True, True, False)
    assert p["main_kernel"] == "Sm100FmhaBwdKernelTmaWarpSpecialized"
    assert p["gqa"] == "native" and p["kernel_heads"] == (4, 8)
    assert p["qp"] == 4096 and p["dp"] == 128
    # + the tail past the lse / sum(O*dO) workspaces that a sequence longer than max_seqlen_q may read
    assert p["workspace_tail_floats"] == 10000
    assert p["workspace_bytes"] == 4 * 3 * 32 * 4096 * 130 + 2 * 10000 * 4
    assert p["chunk_batches"] == 3 and p["num_chunks"] == 1
    assert p["problem_shape"] == ((4096, 10000), (4096, 10000), 128, 128, ((4, 8), 3))
    assert p["stride_lse_workspace"] == (1, (4096, 4096 * 32))
    assert p["stride_dq_acc"] == (128, 1, (128 * 4096, 128 * 4096 * 32))
    assert p["grid"] == (32, 8, 3)


def test_bwd_dense_mla(bwd):
    args = bwd_dense(2, 4096, 4096, 128, 128, 192, 128)
    p = bwd.plan_bwd(*args, None, None, None, None, 192 ** -0.5, False, False, False)
    assert p["main_kernel"] == "Sm100FmhaBwdMlaKernelTmaWarpSpecialized"
    assert p["tile_shape"] == (64, 128, 192, 128)
    assert p["problem_shape"] == ((4096, 8192), (4096, 8192), 192, 128, (128, 2))
    assert p["stride_q"] == (24576, 1, (192, 0)) and p["stride_dv"] == (16384, 1, (128, 0))
    assert p["workspace_bytes"] == 4 * 2 * 128 * 4096 * (2 + 192) == 813_694_976
    assert p["grid"] == (32, 128, 2) and p["gqa"] == "none"


def test_bwd_mla_gqa_expands(bwd):
    args = bwd_dense(2, 100, 300, 16, 4, 192, 128)
    p = bwd.plan_bwd(*args, None, None, None, None, 0.1, True, True, False)
    assert p["gqa"] == "expand_kv" and p["kernel_heads"] == (1, 16)
    assert p["stride_k"] == (16 * 192, 1, (192, 0)) and p["stride_dk"] == (16 * 192, 1, (192, 0))
    assert p["expand_kv_bytes"] == 2 * 600 * 16 * (192 + 128) * 2


def test_bwd_huge_workspace_is_int64_and_chunked(bwd):
    # MLA B=64 H=128 S=32768: CUTLASS's int arithmetic reports 2 GiB; the true size is 194 GiB
    args = bwd_dense(64, 32768, 32768, 128, 128, 192, 128)
    p = bwd.plan_bwd(*args, None, None, None, None, 0.07, True, True, False)
    assert p["workspace_bytes_unchunked"] == 4 * 64 * 128 * 32768 * 194 == 208_305_913_856
    assert p["workspace_bytes_unchunked"] > 2**37
    # one batch of dK spans 32767*24576 + 127*192 + 192 = 805,306,368 elements: 2 batches per chunk keep
    # every int32 offset of the CUTLASS kernel below 2^31
    assert p["chunk_batches"] == 2 and p["num_chunks"] == 32
    assert p["workspace_bytes"] == 2 * 128 * 32768 * 194 * 4
    # skewed varlen: one long sequence among short ones -> chunks bound the padded workspace
    lens = [32768] + [128] * 63
    q, k, v, out, lse, cq, ck, mq, mk = varlen_args(lens, lens, 8, 8, 128, 128)
    p = bwd.plan_bwd(t(*out.shape), q, k, v, out, lse, t(*q.shape), t(*k.shape), t(*v.shape), cq, ck, mq, mk,
                     0.1, False, False, False)
    assert p["workspace_bytes_unchunked"] == 64 * 8 * 32768 * 130 * 4
    assert p["chunk_batches"] == 2 and p["num_chunks"] == 32
    assert p["workspace_bytes"] == 2 * 8 * 32768 * 130 * 4 + 2 * sum(lens) * 4


def test_bwd_varlen_int32_limit_refused(bwd):
    lens = [32768] * 64  # 2M tokens x 128 heads x 192: dK offsets far above 2^31
    q, k, v, out, lse, cq, ck, mq, mk = varlen_args(lens, lens, 128, 128, 192, 128)
    with pytest.raises(RuntimeError, match="dk/dv offset"):
        bwd.plan_bwd(t(*out.shape), q, k, v, out, lse, t(*q.shape), t(*k.shape), t(*v.shape), cq, ck, mq, mk,
                     0.1, False, False, False)


# ---------------------------------------------------------------- errors name the argument
def _fwd_err(fwd, match, **over):
    a = dict(zip(["q", "k", "v", "out", "lse"], dense_args(2, 16, 16, 4, 2, 192, 128)))
    a.update(cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None, max_seqlen_k=None, softmax_scale=0.1,
             causal=False, bottom_right=False)
    a.update(over)
    with pytest.raises(RuntimeError, match=match):
        fwd.plan_fwd(**a)


def test_fwd_errors(fwd):
    _fwd_err(fwd, "head dims", q=t(2, 16, 4, 64), k=t(2, 16, 2, 64))
    _fwd_err(fwd, "q must be bfloat16 or float16", q=t(2, 16, 4, 192, dtype=torch.float32))
    _fwd_err(fwd, "k dtype", k=t(2, 16, 2, 192, dtype=FP))
    _fwd_err(fwd, "out dtype", out=t(2, 16, 4, 128, dtype=FP))
    _fwd_err(fwd, "lse must be float32", lse=t(2, 4, 16))
    _fwd_err(fwd, "multiple of k heads", k=t(2, 16, 3, 192), v=t(2, 16, 3, 128))
    _fwd_err(fwd, "out has shape", out=t(2, 16, 4, 192))
    _fwd_err(fwd, "lse has shape", lse=t(2, 16, 4, dtype=torch.float32))
    _fwd_err(fwd, "q must have unit stride", q=t(2, 16, 192, 4).transpose(-1, -2))
    _fwd_err(fwd, "q stride .* multiple of 8", q=t(2, 16, 4, 196)[..., :192])
    _fwd_err(fwd, "softmax_scale", softmax_scale=0.0)
    _fwd_err(fwd, "given together", cu_seqlens_q=cu_of([16, 16]))
    q, k, v, out, lse, cq, ck, mq, mk = varlen_args([3, 5], [4, 4], 4, 2, 128, 128)
    with pytest.raises(RuntimeError, match="cu_seqlens_q must be int32"):
        fwd.plan_fwd(q, k, v, out, lse, cq.long(), ck, mq, mk, 0.1, False, False)
    with pytest.raises(RuntimeError, match="cu_seqlens_k has 2 entries"):
        fwd.plan_fwd(q, k, v, out, lse, cq, ck[:2], mq, mk, 0.1, False, False)
    with pytest.raises(RuntimeError, match="need max_seqlen_q"):
        fwd.plan_fwd(q, k, v, out, lse, cq, ck, None, None, 0.1, False, False)
    # a CPU call is refused before anything is launched
    qc, kc, vc = torch.zeros(1, 8, 2, 128, dtype=BF), torch.zeros(1, 8, 2, 128, dtype=BF), torch.zeros(1, 8, 2, 128, dtype=BF)
    with pytest.raises(RuntimeError, match="CUDA tensor"):
        fwd.fwd(qc, kc, vc, torch.empty_like(qc), torch.empty(1, 2, 8), None, None, None, None, 0.1, False, False)


def test_bwd_errors(bwd):
    args = bwd_dense(2, 16, 16, 4, 2, 128, 128)
    with pytest.raises(RuntimeError, match="deterministic=True is not supported"):
        bwd.plan_bwd(*args, None, None, None, None, 0.1, False, False, True)
    bad = list(args)
    bad[6] = t(2, 16, 4, 128, dtype=FP)  # dq
    with pytest.raises(RuntimeError, match="dq dtype"):
        bwd.plan_bwd(*bad, None, None, None, None, 0.1, False, False, False)
    bad = list(args)
    bad[7] = t(2, 16, 4, 128)  # dk with the query heads
    with pytest.raises(RuntimeError, match="dk has shape"):
        bwd.plan_bwd(*bad, None, None, None, None, 0.1, False, False, False)
    bad = list(args)
    bad[0] = t(2, 16, 4, 136)[..., :128]  # dout stride 136 (multiple of 8) is fine ...
    bwd.plan_bwd(*bad, None, None, None, None, 0.1, False, False, False)
    bad[0] = t(2, 16, 4, 132)[..., :128]  # ... 132 is not
    with pytest.raises(RuntimeError, match="dout stride"):
        bwd.plan_bwd(*bad, None, None, None, None, 0.1, False, False, False)


# ---------------------------------------------------------------- cu_seqlens values (no host check on SM100)
def _sanitized(cu, rows):
    """The rule of csrc/sm100/fmha/sm100_fmha_cu.h: c[b] = clamp(cu[b], c[b-1], rows), c[-1] = 0."""
    out, lo = [], 0
    for x in cu:
        lo = min(max(int(x), lo), rows)
        out.append(lo)
    return out


def _bad_cu(rng, n, rows):
    # negative, past the rows, decreasing, far out of int range of lengths: anything an int32 can hold
    pool = [-2**31, -5, 0, 1, rows // 3, rows - 1, rows, rows + 7, 2**31 - 1]
    return torch.tensor([pool[i] if rng.random() < 0.3 else rng.randrange(-3, rows + 4) for i in
                         (rng.randrange(len(pool)) for _ in range(n))], dtype=torch.int32)


@pytest.mark.parametrize("batch", [0, 1, 5, 1023, 1024, 2500])  # 1024 sequences and more: several per thread
def test_cu_sanitizer_rule_and_layouts(fwd, bwd, batch):
    """Both families launch CUTLASS's kernels with the caller's cu_seqlens sanitised on the device; this runs the
    kernel's own steps (same chunks per thread, same prefix maximum) on the host. Every launched sequence lies
    inside the packed rows and none overlaps another, for any values; valid values are kept as they are."""
    import random
    rng = random.Random(batch)
    rows_q, rows_k = 700, 333
    for trial in range(4):
        if trial == 0:  # valid values are unchanged
            lens_q = [rng.randrange(0, 2) for _ in range(batch)]
            lens_k = [rng.randrange(0, 2) for _ in range(batch)]
            cq, ck = cu_of(lens_q), cu_of(lens_k)
            rq, rk = int(cq[-1]), int(ck[-1])
        else:
            rq, rk = rows_q, rows_k
            cq, ck = _bad_cu(rng, batch + 1, rq), _bad_cu(rng, batch + 1, rk)
        want_q, want_k = _sanitized(cq.tolist(), rq), _sanitized(ck.tolist(), rk)
        if trial == 0:
            assert want_q == cq.tolist() and want_k == ck.tolist()
        for mod in (fwd, bwd):
            sq, sk = mod.sanitize_cu_host(cq, ck, rq, rk, 0)
            assert sq.tolist() == want_q and sk.tolist() == want_k
        assert all(0 <= a <= b <= rq for a, b in zip(want_q, want_q[1:]))
        # layout 1: an empty batch 0 in front
        lq, lk = fwd.sanitize_cu_host(cq, ck, rq, rk, 1)
        assert lq.tolist() == want_q[:1] + want_q and lk.tolist() == want_k[:1] + want_k
        # layout 2 (bottom-right): batch 0 empty, then per sequence (rows that see no key, 0 keys), (the rest)
        lq, lk = fwd.sanitize_cu_host(cq, ck, rq, rk, 2)
        eq, ek = [want_q[0]], [want_k[0]]
        for b in range(batch + 1):
            eq.append(want_q[b])
            ek.append(want_k[b])
            if b < batch:
                skip = max(0, (want_q[b + 1] - want_q[b]) - (want_k[b + 1] - want_k[b]))
                eq.append(want_q[b] + skip)
                ek.append(want_k[b])
        assert lq.tolist() == eq and lk.tolist() == ek


def test_varlen_plans_sanitize_and_bound_the_workspace(fwd, bwd):
    """The backward reads a sequence's LSE and sum(O*dO) rows q < len_q (cp.async, predicated only by len_q)
    at b * H * qp + h * qp + q of its workspace; a sequence longer than max_seqlen_q (a bad value, unchecked
    on the host) must still read inside the allocation, with int32 offsets."""
    q, k, v, out, lse, cq, ck, mq, mk = varlen_args([300, 17, 40], [300, 17, 40], 8, 8, 128, 128)
    assert fwd.plan_fwd(q, k, v, out, lse, cq, ck, mq, mk, 0.1, False, False).get("cu_sanitized")
    for max_q in (300, 17, 1):  # 17 and 1 are smaller than the longest sequence: bad values
        p = bwd.plan_bwd(t(*out.shape), q, k, v, out, lse, t(*q.shape), t(*k.shape), t(*v.shape), cq, ck,
                         max_q, mk, 0.1, False, False, False)
        assert p.get("cu_sanitized")
        floats = p["workspace_scaled_lse_bytes"] // 4
        assert floats == p["workspace_sum_odo_bytes"] // 4
        qp, heads, chunk = p["qp"], 8, p["chunk_batches"]
        # the worst sanitised chunk: its last batch holds every row (len_q = total_q), read from the last head
        worst = (chunk - 1) * heads * qp + (heads - 1) * qp + (q.shape[0] - 1)
        assert worst < floats and worst <= INT32_MAX


def test_bwd_int32_products_refused(bwd):
    """The 128x128 backward's launcher forms q's kv-group stride (head stride x query heads per kv head) in
    int32: at 2^31 the plan refuses with a named error."""
    q = t(1, 1, 64, 2**25)[..., :128]  # head stride 2^25, 64 query heads on one kv head: 2^31
    dout = t(1, 1, 64, 128)
    k, v = t(1, 1, 1, 128), t(1, 1, 1, 128)
    args = (dout, q, k, v, t(1, 1, 64, 128), t(1, 64, 1, dtype=torch.float32), t(1, 1, 64, 128), t(*k.shape),
            t(*v.shape))
    with pytest.raises(RuntimeError, match="kv-group stride"):
        bwd.plan_bwd(*args, None, None, None, None, 0.1, False, False, False)
    q = t(1, 1, 64, 2**25 - 8)[..., :128]
    bwd.plan_bwd(dout, q, *args[2:], None, None, None, None, 0.1, False, False, False)


def test_int32_tma_row_coordinates_refused(fwd, bwd):
    """Example 77's TMA row coordinates (cu[b] + row) are int32: packed rows near 2^31 are refused by name."""
    T = INT32_MAX - 100
    q, k, v = t(T, 1, 128), t(1024, 1, 128), t(1024, 1, 128)
    out, lse = t(T, 1, 128), t(1, T, dtype=torch.float32)
    cq, ck = torch.tensor([0, T], dtype=torch.int32), torch.tensor([0, 1024], dtype=torch.int32)
    with pytest.raises(RuntimeError, match="TMA row coordinates"):
        fwd.plan_fwd(q, k, v, out, lse, cq, ck, 1000, 1024, 0.1, False, False)
    with pytest.raises(RuntimeError, match="TMA row coordinates"):
        bwd.plan_bwd(t(*out.shape), q, k, v, out, lse, t(*q.shape), t(*k.shape), t(*v.shape), cq, ck, 64, 1024,
                     0.1, False, False, False)


# ---------------------------------------------------------------- example 77's causal tile scheduler
def _causal_block_coord(bx, by, grid_x, grid_y):
    """CausalIndividualTileScheduler::get_block_coord of CUTLASS 4.2 (kernel/fmha_causal_tile_scheduler.hpp):
    (q tile, head) of block (bx, by); grid (heads, q tiles, batches)."""
    TileQ, TileH = 16, 8
    tile_col_count, tile_max_q = grid_x // TileH, grid_y // TileQ * TileQ
    block_idx = by * grid_x + bx
    tile_idx, tile_tail = divmod(block_idx, TileQ * TileH)
    tile_row_idx, tile_col_idx = divmod(tile_idx, tile_col_count) if tile_col_count else (0, 0)
    row_off, col_off = divmod(tile_tail, TileH)
    if by >= tile_max_q:
        return grid_y - 1 - by, bx
    return grid_y - 1 - (tile_row_idx * TileQ + row_off), tile_col_idx * TileH + col_off


@pytest.mark.parametrize("heads,max_q", [(128, 4096), (16, 300), (8, 256 * 17 + 1), (24, 5000)])
def test_fwd_causal_tile_scheduler(fwd, heads, max_q):
    """Causal forwards use example 77's CausalIndividualTileScheduler where FlashMLA does (causal mask, query
    heads a multiple of 8): its grid is (heads, q tiles, batches) and it visits every (q tile, head) once,
    the tiles with the longest key loops first."""
    q, k, v, out, lse = dense_args(2, max_q, max_q, heads, heads // 8 or 1, 192, 128)
    tiles = -(-max_q // 256)
    for mask in ((True, False), (True, True)):
        p = fwd.plan_fwd(q, k, v, out, lse, None, None, None, None, 0.1, *mask)
        assert p["tile_scheduler"] == "CausalIndividualTileScheduler"
        assert p["grid"] == (heads, tiles, p["batches_launched"])
    seen = sorted(_causal_block_coord(x, y, heads, tiles) for y in range(tiles) for x in range(heads))
    assert seen == sorted((m, h) for m in range(tiles) for h in range(heads))
    assert _causal_block_coord(0, 0, heads, tiles)[0] == tiles - 1  # the last q tile (longest loop) first
    p = fwd.plan_fwd(q, k, v, out, lse, None, None, None, None, 0.1, False, False)
    assert p["tile_scheduler"] == "IndividualTileScheduler" and p["grid"] == (tiles, heads, p["batches_launched"])


def test_fwd_causal_tile_scheduler_needs_heads_in_eights(fwd):
    """With query heads not a multiple of 8 the causal scheduler's swizzle misses tiles: the plan keeps the
    individual one (as FlashMLA does)."""
    heads, tiles = 12, 16
    seen = {_causal_block_coord(x, y, heads, tiles) for y in range(tiles) for x in range(heads)}
    assert seen != {(m, h) for m in range(tiles) for h in range(heads)}  # heads 8..11 missed, tiles < 0 made
    q, k, v, out, lse = dense_args(1, 256 * tiles, 256 * tiles, heads, 4, 128, 128)
    p = fwd.plan_fwd(q, k, v, out, lse, None, None, None, None, 0.1, True, True)
    assert p["tile_scheduler"] == "IndividualTileScheduler" and p["grid"] == (tiles, heads, p["batches_launched"])


# ---------------------------------------------------------------- dense batches do not see each other's rows
def _tiles_finite(seq_start, seq_len, tile, launch_base, launch_rows, values):
    """P.V of one query row over the tiles example 77's TMA loads for a sequence: tiles of `tile` rows from
    its first row (seq_start, inside its launch), rows past the launch's extent zero-filled, the others read
    from memory (values[launch_base + row]). P = 0 on rows outside the sequence (masked), 1/len inside; the
    MMA still multiplies them, so 0 * inf = nan there reaches the result."""
    acc = 0.0
    for r in range(seq_start, seq_start + -(-seq_len // tile) * tile):
        p = 1.0 / seq_len if r < seq_start + seq_len else 0.0
        acc += p * (values[launch_base + r] if r < launch_rows else 0.0)
    return acc == acc and abs(acc) != float("inf")


@pytest.mark.parametrize("S", [300, 256])
def test_dense_batches_isolated_in_partial_tiles(fwd, bwd, S):
    """Dense calls run through the varlen kernel. A batch's last partial key tile (and, in the backward,
    query tile) reads past its end; those rows must be zero-filled, not the next batch's first rows, where a
    NaN/Inf would reach this batch's output or gradients through P = 0. The plans give each launch's row
    extent (problem_shape totals) and how many launches (one per batch where isolation is needed)."""
    B, H = 3, 4
    q, k, v, out, lse = dense_args(B, S, S, H, H, 192, 128)
    values = [1.0] * (B * S)
    values[S] = float("inf")  # batch 1's first key / query row
    pf = fwd.plan_fwd(q, k, v, out, lse, None, None, None, None, 0.1, False, False)
    launches, rows_k = pf.get("launches", 1), pf["problem_shape"][1][1]
    per_launch = B // launches
    assert rows_k == per_launch * S
    for b in (0, 2):
        local = (b % per_launch) * S  # the batch's first row inside its launch
        base = (b // per_launch) * per_launch * S
        assert _tiles_finite(local, S, 128, base, rows_k, values), f"forward batch {b} reads another batch's V"
    assert (launches > 1) == (S % 128 != 0)
    pb = bwd.plan_bwd(*bwd_dense(B, S, S, H, H, 192, 128), None, None, None, None, 0.1, False, False, False)
    chunk = pb["chunk_batches"]
    assert pb["problem_shape"][0][1] == chunk * S and pb["problem_shape"][1][1] == chunk * S
    for tile in (64, 128):  # MLA backward: query tiles of 64 rows (q, dO), key tiles of 128 (k, v)
        assert _tiles_finite(0, S, tile, 0, chunk * S, values), f"backward batch 0 reads batch 1 in a {tile}-row tile"
    assert pb["isolated_batches"] == (S % 64 != 0 or S % 128 != 0)


def test_bad_varlen_cases_on_sm100(fwd):
    """testing.BAD_VARLEN_CASES through the SM100 sanitiser: the sequences it launches are the ranges of the
    SM90 rule (an empty range anywhere is the same as any other empty range), except in the two places the
    docs name: a sequence longer than max_seqlen is not cut, and overlapping sequences are made to follow
    each other."""
    from mla_autograd import testing as T
    tq, tk = T.BAD_VARLEN_ROWS
    for case in T.BAD_VARLEN_CASES:
        cq, ck = (torch.tensor(c, dtype=torch.int32) for c in (case.cu_q, case.cu_k))
        sq, sk = fwd.sanitize_cu_host(cq, ck, tq, tk, 0)
        got = [[(a, b) if b > a else None for a, b in zip(c.tolist(), c.tolist()[1:])] for c in (sq, sk)]
        want = [[(a, b) if b > a else None for a, b in r] for r in (case.ranges_q, case.ranges_k)]
        cut = [[r and (r[0], min(r[1], r[0] + m)) for r in g] for g, m in zip(got, (case.max_q, case.max_k))]
        if case.overlapping:
            assert got == [[(0, 30), None, (30, 40)], [(0, 40), None, (40, 48)]]
        else:
            assert cut == want, case.name  # the SM90 ranges but for the cut at max_seqlen
        if case.name == "longer than max_seqlen":
            assert got == [[(0, 10), (10, 25), (25, 40)], [(0, 12), (12, 30), (30, 48)]]  # not cut
