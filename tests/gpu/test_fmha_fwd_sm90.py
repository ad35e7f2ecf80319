"""GPU tests of the fmha_fwd_sm90 kernel family (SM90 fused attention forward: TMA, wgmma, warp
specialization).

Reference: mla_autograd.reference.attention_forward in float32 on the same 16-bit inputs.
Tolerance: FlashAttention's rule, kernel error <= 2 x the error of plain PyTorch in the same dtype
(mla_autograd.testing.naive_attention) + eps. out and lse are NaN-poisoned before every call so
unwritten elements fail. lse is compared with an absolute tolerance (fp32 on both sides) and must
be -inf exactly where the reference is.

Launch options (the L2 launch grouping) go through the module's test-only entry fwd_with_options(..., options);
fwd itself is what mla_autograd calls. bench/bench_kernels.py fwd times the kernel beside SDPA cuDNN;
tools/kernel_smoke.py fwd runs one small case per head-dim pair and mask.
"""
from __future__ import annotations

import itertools
import math
import random
import sys

import pytest
import torch

pytestmark = pytest.mark.gpu

_CAP_OK = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)
if not _CAP_OK:
    pytest.skip("fmha_fwd_sm90 needs an SM90 GPU (compute capability 9.0)", allow_module_level=True)

from mla_autograd import reference  # noqa: E402
from mla_autograd.testing import assert_error_within, naive_attention  # noqa: E402
from mla_parts import cu_seqlens  # noqa: E402

DEV = "cuda"
DIMS = [(192, 128), (128, 128), (64, 64)]
DTYPES = [torch.bfloat16, torch.float16]
MASKS = [(False, False), (True, False), (True, True)]  # (causal, bottom_right)
# (Sq, Sk, Hq, Hkv): lengths 1/17/113/1023, Sq != Sk both ways, Hq/Hkv in {1,2,8}
SHAPES = [(1, 1, 1, 1), (17, 113, 2, 1), (113, 17, 8, 2), (1023, 1023, 8, 8), (113, 1023, 2, 2),
          (1023, 17, 8, 1), (1, 1023, 8, 2), (1023, 1, 2, 1)]
EPS = 1e-4
LSE_ATOL = 2e-3


def _load():
    try:
        from mla_autograd._build import load_family
        return load_family("fmha_fwd_sm90")
    except ImportError:  # pragma: no cover - before the package's builder existed
        import os
        from torch.utils.cpp_extension import load
        import cutlass_library
        root = os.path.join(os.path.dirname(__file__), "..", "..", "csrc")
        inc = os.path.join(os.path.dirname(cutlass_library.__file__), "source", "include")
        srcs = [os.path.join(root, "sm90", "fmha_fwd", f) for f in sorted(os.listdir(os.path.join(root, "sm90", "fmha_fwd")))
                if f.startswith("fmha_fwd_sm90") and f.endswith((".cu", ".cpp"))]
        return load("fmha_fwd_sm90", srcs, extra_include_paths=[root, inc],
                    extra_cuda_cflags=["-gencode=arch=compute_90a,code=sm_90a", "--expt-relaxed-constexpr",
                                       "-std=c++20", "-O3"])


@pytest.fixture(scope="module")
def ext():
    return _load()


def _mask_id(m):
    return {(False, False): "nomask", (True, False): "causal_tl", (True, True): "causal_br"}[m]


def _rand(shape, dtype, g):
    return torch.randn(shape, device=DEV, dtype=torch.float32, generator=g).to(dtype)


def _varlen(lq, lk, hq, hkv, d, dv, dtype, g):
    """A packed varlen batch of sequences with lq[i] queries and lk[i] keys: q (sum(lq), hq, d), k (sum(lk), hkv, d)
    and v (sum(lk), hkv, dv) drawn from g, and _check's varlen arguments {cu_q, cu_k, msq, msk}."""
    q = _rand((sum(lq), hq, d), dtype, g)
    k = _rand((sum(lk), hkv, d), dtype, g)
    v = _rand((sum(lk), hkv, dv), dtype, g)
    return q, k, v, dict(cu_q=cu_seqlens(lq), cu_k=cu_seqlens(lk), msq=max(lq), msk=max(lk))


def _check(ext, q, k, v, *, scale, causal, bottom_right, cu_q=None, cu_k=None, msq=None, msk=None, name="",
           options=None):
    """Run the kernel (ext.fwd, or ext.fwd_with_options when `options` is a dict) on NaN-poisoned out/lse and
    compare with the reference; returns (out, lse)."""
    dtype = q.dtype
    dv = v.shape[-1]
    if cu_q is None:
        B, Sq, Hq, _ = q.shape
        out = torch.full((B, Sq, Hq, dv), float("nan"), device=DEV, dtype=dtype)
        lse = torch.full((B, Hq, Sq), float("nan"), device=DEV, dtype=torch.float32)
    else:
        Tq, Hq, _ = q.shape
        out = torch.full((Tq, Hq, dv), float("nan"), device=DEV, dtype=dtype)
        lse = torch.full((Hq, Tq), float("nan"), device=DEV, dtype=torch.float32)
    if options is None:
        ext.fwd(q, k, v, out, lse, cu_q, cu_k, msq, msk, scale, causal, bottom_right)
    else:
        ext.fwd_with_options(q, k, v, out, lse, cu_q, cu_k, msq, msk, scale, causal, bottom_right, options)
    torch.cuda.synchronize()
    kw = dict(cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=msq, max_seqlen_k=msk,
              softmax_scale=scale, causal=causal, bottom_right=bottom_right)
    ref_o, ref_lse = reference.attention_forward(q.float(), k.float(), v.float(), **kw)
    base_o = naive_attention(q, k, v, softmax_scale=scale, causal=causal, bottom_right=bottom_right,
                             cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)
    assert_error_within(out, ref_o, base_o, eps=EPS, name=f"out {name}")
    ref_lse = ref_lse.float()
    fin = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse), fin), f"lse {name}: finite pattern differs"
    assert torch.all(lse[~fin] == ref_lse[~fin]), f"lse {name}: non-finite values differ"
    if fin.any():
        err = (lse[fin] - ref_lse[fin]).abs().max().item()
        assert err <= LSE_ATOL, f"lse {name}: max error {err:.3e} > {LSE_ATOL}"
    return out, lse


@pytest.mark.parametrize("dims", DIMS, ids=lambda d: f"d{d[0]}_{d[1]}")
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda t: str(t).split(".")[-1])
@pytest.mark.parametrize("mask", MASKS, ids=_mask_id)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_dense(ext, dims, dtype, mask, shape):
    d, dv = dims
    sq, sk, hq, hkv = shape
    g = torch.Generator(device=DEV).manual_seed(hash((d, sq, sk, hq, hkv, mask)) % (2**31))
    B = 2
    q = _rand((B, sq, hq, d), dtype, g)
    k = _rand((B, sk, hkv, d), dtype, g)
    v = _rand((B, sk, hkv, dv), dtype, g)
    _check(ext, q, k, v, scale=1.0 / math.sqrt(d), causal=mask[0], bottom_right=mask[1],
           name=f"{dims} {dtype} {mask} {shape}")


@pytest.mark.parametrize("dims", [(192, 128), (128, 128)], ids=lambda d: f"d{d[0]}_{d[1]}")
@pytest.mark.parametrize("mask", MASKS, ids=_mask_id)
@pytest.mark.parametrize("lens", [(4224, 4224), (4224, 1023), (1023, 4224)], ids=lambda s: f"{s[0]}x{s[1]}")
def test_dense_long(ext, dims, mask, lens):
    d, dv = dims
    sq, sk = lens
    g = torch.Generator(device=DEV).manual_seed(7)
    q = _rand((1, sq, 2, d), torch.bfloat16, g)
    k = _rand((1, sk, 1, d), torch.bfloat16, g)
    v = _rand((1, sk, 1, dv), torch.bfloat16, g)
    _check(ext, q, k, v, scale=1.0 / math.sqrt(d), causal=mask[0], bottom_right=mask[1], name=f"{dims} {mask} {lens}")


@pytest.mark.parametrize("dims", DIMS, ids=lambda d: f"d{d[0]}_{d[1]}")
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda t: str(t).split(".")[-1])
@pytest.mark.parametrize("mask", MASKS, ids=_mask_id)
def test_strided(ext, dims, dtype, mask):
    """Non-contiguous q/k/v (padded rows, transposed batch/seq storage): strides multiples of 8."""
    d, dv = dims
    g = torch.Generator(device=DEV).manual_seed(11)
    B, sq, sk, hq, hkv = 3, 200, 333, 4, 2
    q = _rand((B, sq, hq, d + 24), dtype, g)[..., 8:8 + d]  # row padding, offset by 16 bytes
    k = _rand((sk, B, hkv, d), dtype, g).transpose(0, 1)  # (B, Sk, H, D) view with batch stride hkv*d
    v = _rand((B, hkv, sk, dv), dtype, g).transpose(1, 2)  # head-major storage
    _check(ext, q, k, v, scale=0.37, causal=mask[0], bottom_right=mask[1], name=f"strided {dims} {dtype} {mask}")


VARLEN_CASES = [
    ([0, 17, 1, 300, 0, 129], [5, 0, 1, 257, 3, 128]),
    ([128, 129, 127, 1], [128, 127, 129, 1000]),
    ([1000, 0, 33], [17, 0, 4224]),
    ([0, 0], [0, 0]),
]


@pytest.mark.parametrize("dims", DIMS, ids=lambda d: f"d{d[0]}_{d[1]}")
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda t: str(t).split(".")[-1])
@pytest.mark.parametrize("mask", MASKS, ids=_mask_id)
@pytest.mark.parametrize("case", range(len(VARLEN_CASES)))
@pytest.mark.parametrize("heads", [(8, 2), (2, 2)], ids=lambda h: f"h{h[0]}_{h[1]}")
def test_varlen(ext, dims, dtype, mask, case, heads):
    d, dv = dims
    hq, hkv = heads
    lq, lk = VARLEN_CASES[case]
    g = torch.Generator(device=DEV).manual_seed(100 + case)
    q, k, v, kw = _varlen(lq, lk, hq, hkv, d, dv, dtype, g)
    _check(ext, q, k, v, scale=1.0 / math.sqrt(d), causal=mask[0], bottom_right=mask[1], **kw,
           name=f"varlen {dims} {dtype} {mask} {lq} {lk}")


_REJECT_SCRIPT = r"""
import sys, torch
sys.path.insert(0, sys.argv[1])
import test_fmha_fwd_sm90 as t
ext = t._load()
dev = "cuda"
q = torch.randn(1, 16, 2, 96, device=dev, dtype=torch.bfloat16)
out = torch.empty(1, 16, 2, 96, device=dev, dtype=torch.bfloat16)
lse = torch.empty(1, 2, 16, device=dev)
try:
    ext.fwd(q, q, q, out, lse, None, None, None, None, 0.1, False, False)
    print("NO-ERROR dims")
except RuntimeError as e:
    print("RAISED dims:", "Dqk" in str(e))
q = torch.randn(1, 16, 3, 128, device=dev, dtype=torch.bfloat16)
k = torch.randn(1, 16, 2, 128, device=dev, dtype=torch.bfloat16)
out = torch.empty(1, 16, 3, 128, device=dev, dtype=torch.bfloat16)
lse = torch.empty(1, 3, 16, device=dev)
try:
    ext.fwd(q, k, k, out, lse, None, None, None, None, 0.1, False, False)
    print("NO-ERROR heads")
except RuntimeError as e:
    print("RAISED heads:", "Hkv" in str(e))
q = torch.randn(1, 16, 2, 128, device=dev, dtype=torch.bfloat16)
out = torch.empty(1, 16, 2, 128, device=dev, dtype=torch.bfloat16)
lse = torch.empty(1, 2, 16, device=dev)
for name, opts, word in [("key", {"l2_grup": 1}, "l2_grup"), ("value", {"l2_group": -1}, "l2_group"),
                         ("type", {"l2_group": True}, "l2_group")]:
    try:
        ext.fwd_with_options(q, q, q, out, lse, None, None, None, None, 0.1, False, False, opts)
        print(f"NO-ERROR option {name}")
    except RuntimeError as e:
        print(f"RAISED option {name}:", word in str(e))
"""


def test_rejects_bad_input(ext):
    """Invalid shapes and launch options raise RuntimeError naming the argument or option. Run in a subprocess:
    a crash in the host error path (seen once on the device toolchain) must not take the whole session down."""
    import os
    import subprocess
    r = subprocess.run([sys.executable, "-X", "faulthandler", "-c", _REJECT_SCRIPT, os.path.dirname(os.path.abspath(__file__))],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, f"subprocess died (rc={r.returncode}): {r.stdout[-2000:]} {r.stderr[-2000:]}"
    assert "RAISED dims: True" in r.stdout and "RAISED heads: True" in r.stdout, r.stdout + r.stderr
    for name in ("key", "value", "type"):
        assert f"RAISED option {name}: True" in r.stdout, r.stdout + r.stderr


@pytest.mark.parametrize("group", [1, 3])
def test_l2_group_launch_order(ext, group):
    """The launch order takes (head, batch) pairs in L2-sized groups (grouped_tile, sm90_attn_common.cuh); the other
    tests' shapes fit one group, so force smaller ones through fwd_with_options: 8 pairs in groups of 3 (3, 3, 2:
    a smaller last group) and of 1, dense and varlen, every dims pair and mask."""
    options = {"l2_group": group}
    g = torch.Generator(device=DEV).manual_seed(3)
    for (d, dv), (causal, br) in itertools.product(DIMS, MASKS):
        # dense: 2 x 4 = 8 (head, batch) pairs, GQA 4:2
        q = _rand((2, 300, 4, d), torch.bfloat16, g)
        k = _rand((2, 517, 2, d), torch.bfloat16, g)
        v = _rand((2, 517, 2, dv), torch.bfloat16, g)
        _check(ext, q, k, v, scale=1 / math.sqrt(d), causal=causal, bottom_right=br, options=options,
               name=f"l2 {group} dense {d} {causal} {br}")
        # varlen: 4 sequences (one empty) x 2 heads (varlen tiles are a list of the sequences' own M-blocks,
        # which the grouping does not reorder: the same results under every group size)
        q, k, v, kw = _varlen([129, 0, 300, 17], [200, 5, 300, 640], 2, 2, d, dv, torch.bfloat16, g)
        _check(ext, q, k, v, scale=1 / math.sqrt(d), causal=causal, bottom_right=br, **kw, options=options,
               name=f"l2 {group} varlen {d} {causal} {br}")


@pytest.mark.parametrize("ctas", [1, 3, 7])
@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic"])
def test_persistent_grid_is_bit_identical(ext, ctas, dynamic):
    """The persistent grid: each CTA runs a sequence of tiles (static: blockIdx.x, + gridDim.x, ...; dynamic: the
    next one of a counter) with its K/V ring and Q barrier carried from tile to tile. Forced to 1, 3 and 7 CTAs
    (many tiles each, with empty ones: rows that see no key under a bottom-right mask, a sequence with no
    queries) it gives bit-identical outputs to the default launch and passes the
    reference check, every dims pair and mask, dense (GQA) and varlen."""
    g = torch.Generator(device=DEV).manual_seed(5)
    for (d, dv), (causal, br) in itertools.product(DIMS, MASKS):
        scale = 1 / math.sqrt(d)
        q = _rand((2, 333, 4, d), torch.bfloat16, g)
        k = _rand((2, 200, 2, d), torch.bfloat16, g)
        v = _rand((2, 200, 2, dv), torch.bfloat16, g)
        want = _check(ext, q, k, v, scale=scale, causal=causal, bottom_right=br, options={"ctas": 0})
        got = _check(ext, q, k, v, scale=scale, causal=causal, bottom_right=br,
                     options={"ctas": ctas, "dynamic": dynamic}, name=f"ctas {ctas} dense {d} {causal} {br}")
        assert all(torch.equal(a, b) for a, b in zip(got, want)), f"ctas {ctas} dense {d} {causal} {br}"
        q, k, v, kw = _varlen([129, 0, 300, 17, 1], [200, 5, 300, 640, 1], 2, 2, d, dv, torch.bfloat16, g)
        kw.update(scale=scale, causal=causal, bottom_right=br)
        want = _check(ext, q, k, v, **kw, options={"ctas": 0})
        got = _check(ext, q, k, v, **kw, options={"ctas": ctas, "dynamic": dynamic},
                     name=f"ctas {ctas} varlen {d} {causal} {br}")
        assert all(torch.equal(a, b) for a, b in zip(got, want)), f"ctas {ctas} varlen {d} {causal} {br}"


@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp16"])
def test_staged_epilogue_matches_register_stores(ext, dtype):
    """O leaves through the consumer warps' staging rows in smem (the default) or by 4-byte stores straight from
    the accumulator layout (options["staged_epilogue"] False): the same bits, both dtypes, every dims pair and
    mask, dense (Sq = 205: the last tile's rows end inside a warp's 16) and varlen sequences that end inside a
    warp's rows; both pass the reference check on NaN-poisoned outputs."""
    g = torch.Generator(device=DEV).manual_seed(21)
    for (d, dv), (causal, br) in itertools.product(DIMS, MASKS):
        scale = 1 / math.sqrt(d)
        q = _rand((2, 205, 4, d), dtype, g)
        k = _rand((2, 150, 2, d), dtype, g)
        v = _rand((2, 150, 2, dv), dtype, g)
        kw = dict(scale=scale, causal=causal, bottom_right=br)
        want = _check(ext, q, k, v, **kw, options={"staged_epilogue": False}, name=f"registers {d} {causal} {br}")
        got = _check(ext, q, k, v, **kw, name=f"staged {d} {causal} {br}")
        assert all(torch.equal(a, b) for a, b in zip(got, want)), f"dense {d} {causal} {br}"
        q, k, v, vkw = _varlen([1, 15, 17, 0, 130, 64, 191], [9, 15, 300, 4, 130, 1, 191], 2, 1, d, dv, dtype, g)
        vkw.update(kw)
        want = _check(ext, q, k, v, **vkw, options={"staged_epilogue": False}, name=f"registers varlen {d} {causal}")
        got = _check(ext, q, k, v, **vkw, name=f"staged varlen {d} {causal} {br}")
        assert all(torch.equal(a, b) for a, b in zip(got, want)), f"varlen {d} {causal} {br}"


@pytest.mark.parametrize("grid", [{"ctas": 1}, {"ctas": 5, "dynamic": False}, {"ctas": 5, "dynamic": True},
                                  {"ctas": 1 << 30, "dynamic": False}, {}, {"longest_first": False},
                                  {"ctas": 5, "dynamic": True, "longest_first": False}],
                         ids=["1cta", "5static", "5dynamic", "percta", "default", "cu_order", "5dynamic_cu_order"])
def test_varlen_tile_list_over_many_sequences(ext, grid):
    """Varlen tiles are numbered over the sequences' own M-blocks (no tile past a sequence's end), longest sequence
    first, decoded by a warp-wide scan 32 sequences at a time that each CTA resumes where it stopped. 75 sequences
    (three scan chunks) of random lengths with runs of empty ones, one with queries but no keys, the longest in the
    last chunk, 3 query heads over 1 K/V head, every dims pair and mask: each grid (one CTA, five static or dynamic,
    one per tile, the default, and the default and five dynamic CTAs in cu_seqlens order) passes the reference check
    and gives the default's bits."""
    rng = random.Random(11)
    lq = [rng.choice([0, 0, 1, 63, 64, 65, 127, 128, 129, rng.randint(1, 400)]) for _ in range(74)] + [517]
    lk = [x if rng.random() < 0.7 else rng.randint(0, 300) for x in lq]
    lq[5], lk[5] = 70, 0  # queries with no key: O = 0, LSE = -inf, no load
    g = torch.Generator(device=DEV).manual_seed(12)
    for (d, dv), (causal, br) in itertools.product(DIMS, MASKS):
        q, k, v, kw = _varlen(lq, lk, 3, 1, d, dv, torch.bfloat16, g)
        kw.update(scale=1 / math.sqrt(d), causal=causal, bottom_right=br)
        want = _check(ext, q, k, v, **kw)
        got = _check(ext, q, k, v, **kw, options=grid, name=f"tile list {grid} {d} {causal} {br}")
        assert all(torch.equal(a, b) for a, b in zip(got, want)), f"tile list {grid} {d} {causal} {br}"


def _seq_order_reference(cu_q, cu_k, rows_q, rows_k, msq, msk):
    """The longest-first order of the varlen schedules, from the lengths as every kernel reads them (varlen_rows:
    cu clamped into [0, rows], the end at least the start, the length capped at max_seqlen): sequences by
    len_q + len_k descending, ties by index."""
    def lens(cu, rows, cap):
        out = []
        for b in range(len(cu) - 1):
            s = min(max(cu[b], 0), rows)
            e = min(max(cu[b + 1], s), rows)
            out.append(min(e - s, cap))
        return out
    key = [a + b for a, b in zip(lens(cu_q, rows_q, msq), lens(cu_k, rows_k, msk))]
    return sorted(range(len(key)), key=lambda b: (-key[b], b))


def test_seq_order_longest_first(ext):
    """The order in which the varlen schedules take a packed batch's sequences (the test-only entry seq_order,
    the kernel both families' launchers run): longest first (len_q + len_k), ties by index, a permutation for any
    cu_seqlens values (decreasing, negative, past the tensor, longer than max_seqlen). A wrong order costs only
    time, which no output check sees."""
    rng = random.Random(21)
    cases = [([0, 5], [0, 7], 5, 7, 5, 7), ([0, 0, 0], [0, 0, 0], 0, 0, 0, 0)]
    for batch in (2, 31, 75, 256):
        lq = [rng.choice([0, 1, 64, 65, 300, rng.randint(0, 5000)]) for _ in range(batch)]
        lk = [x if rng.random() < 0.7 else rng.randint(0, 5000) for x in lq]
        cq, ck = [0], [0]
        for a, b in zip(lq, lk):
            cq.append(cq[-1] + a)
            ck.append(ck[-1] + b)
        cases.append((cq, ck, cq[-1], ck[-1], max(lq), max(lk)))
        cases.append((cq, ck, cq[-1], ck[-1], 200, 300))  # lengths capped at max_seqlen: ties
    bad = [rng.randint(-50, 4000) for _ in range(41)]  # neither sorted nor inside the tensor
    cases.append((bad, list(reversed(bad)), 1000, 2000, 700, 3000))
    for cq, ck, rq, rk, msq, msk in cases:
        got = ext.seq_order(torch.tensor(cq, dtype=torch.int32, device=DEV),
                            torch.tensor(ck, dtype=torch.int32, device=DEV), rq, rk, msq, msk)
        want = _seq_order_reference(cq, ck, rq, rk, msq, msk)
        assert got.tolist() == want, f"batch {len(cq) - 1}: {got.tolist()[:12]} != {want[:12]}"
    with pytest.raises(RuntimeError, match="256"):
        ext.seq_order(torch.zeros(258, dtype=torch.int32, device=DEV), torch.zeros(258, dtype=torch.int32, device=DEV),
                      0, 0, 0, 0)


@pytest.mark.parametrize("batch", [256, 257])
def test_varlen_at_the_order_cap(ext, batch):
    """Up to kSeqOrderMaxBatch (256) sequences take the longest-first order, more keep cu_seqlens order: at 256
    and 257 sequences of random lengths (empty ones among them), both causal alignments and no mask, the default
    launch passes the reference check and gives the bits of the cu_seqlens order."""
    rng = random.Random(batch)
    lq = [rng.choice([0, 1, 17, 64, 65, 129, rng.randint(1, 300)]) for _ in range(batch)]
    lk = [x if rng.random() < 0.8 else rng.randint(0, 300) for x in lq]
    g = torch.Generator(device=DEV).manual_seed(batch)
    d, dv = 128, 128
    q, k, v, kw = _varlen(lq, lk, 2, 1, d, dv, torch.bfloat16, g)
    for causal, br in MASKS:
        kw.update(scale=1 / math.sqrt(d), causal=causal, bottom_right=br)
        want = _check(ext, q, k, v, **kw, options={"longest_first": False})
        got = _check(ext, q, k, v, **kw, name=f"{batch} sequences {causal} {br}")
        assert all(torch.equal(a, b) for a, b in zip(got, want)), f"{batch} sequences {causal} {br}"


@pytest.mark.parametrize("dims", DIMS, ids=lambda d: f"d{d[0]}_{d[1]}")
@pytest.mark.parametrize("varlen", [False, True], ids=["dense", "varlen"])
def test_narrow_key_block_without_mask(ext, dims, varlen):
    """{'wide_keys': False}: an unmasked problem on the causal tile's key block (at 128/128 the 128-wide kernel,
    which a plain call runs only under a causal mask, instead of the 176-wide one): passes the reference check at
    lengths that end inside a block of either width (176 * 3 + 5 keys, 333 queries)."""
    d, dv = dims
    g = torch.Generator(device=DEV).manual_seed(13)
    if varlen:
        q, k, v, kw = _varlen([333, 0, 129, 17], [533, 7, 176, 300], 4, 2, d, dv, torch.bfloat16, g)
    else:
        q = _rand((2, 333, 4, d), torch.bfloat16, g)
        k = _rand((2, 176 * 3 + 5, 2, d), torch.bfloat16, g)
        v = _rand((2, 176 * 3 + 5, 2, dv), torch.bfloat16, g)
        kw = {}
    _check(ext, q, k, v, scale=1.0 / math.sqrt(d), causal=False, bottom_right=False, options={"wide_keys": False},
           name=f"narrow keys {dims} varlen={varlen}", **kw)


@pytest.mark.parametrize("dims", DIMS, ids=lambda d: f"d{d[0]}_{d[1]}")
@pytest.mark.parametrize("mask", MASKS, ids=_mask_id)
def test_options_empty(ext, dims, mask):
    """fwd_with_options with no options (fwd's defaults), 16 heads at S=2048: two L2 groups at Dqk >= 128 on the H200."""
    d, dv = dims
    g = torch.Generator(device=DEV).manual_seed(9)
    q = _rand((1, 2048, 16, d), torch.bfloat16, g)
    k = _rand((1, 2048, 16, d), torch.bfloat16, g)
    v = _rand((1, 2048, 16, dv), torch.bfloat16, g)
    _check(ext, q, k, v, scale=1.0 / math.sqrt(d), causal=mask[0], bottom_right=mask[1], options={},
           name=f"options {{}} {dims} {mask}")


try:
    from hypothesis import given, settings, strategies as st, HealthCheck

    @settings(max_examples=12, deadline=None, suppress_health_check=list(HealthCheck))
    @given(sq=st.integers(1, 700), sk=st.integers(1, 700), dims=st.sampled_from(DIMS),
           heads=st.sampled_from([(1, 1), (2, 1), (8, 2), (8, 8)]), mask=st.sampled_from(MASKS),
           dtype=st.sampled_from(DTYPES), seed=st.integers(0, 2**20))
    def test_hypothesis(sq, sk, dims, heads, mask, dtype, seed):
        ext_ = _load()
        d, dv = dims
        g = torch.Generator(device=DEV).manual_seed(seed)
        q = _rand((1, sq, heads[0], d), dtype, g)
        k = _rand((1, sk, heads[1], d), dtype, g)
        v = _rand((1, sk, heads[1], dv), dtype, g)
        _check(ext_, q, k, v, scale=1.0 / math.sqrt(d), causal=mask[0], bottom_right=mask[1], name="hypothesis")
except ImportError:  # pragma: no cover
    pass


def _public_api():
    try:
        import mla_autograd
        return (getattr(mla_autograd, "attention", None), getattr(mla_autograd, "attention_varlen", None),
                getattr(mla_autograd, "explain", None))
    except Exception:  # pragma: no cover
        return None, None, None


def _first(x):
    return x[0] if isinstance(x, tuple) else x


@pytest.mark.parametrize("dims", DIMS, ids=lambda d: f"d{d[0]}_{d[1]}")
@pytest.mark.parametrize("mask", MASKS, ids=_mask_id)
def test_public_attention(dims, mask):
    """Through mla_autograd.attention / attention_varlen: the dispatch table must pick this kernel."""
    attention, attention_varlen, explain = _public_api()
    if attention is None:
        pytest.skip("mla_autograd.attention is not available yet")
    d, dv = dims
    causal, br = mask
    align = "bottom_right" if br else "top_left"
    g = torch.Generator(device=DEV).manual_seed(5)
    q = _rand((2, 300, 4, d), torch.bfloat16, g)
    k = _rand((2, 257, 2, d), torch.bfloat16, g)
    v = _rand((2, 257, 2, dv), torch.bfloat16, g)
    if explain is not None:
        assert explain(q, k, v, causal=causal).forward.backend == "sm90", str(explain(q, k, v, causal=causal))
    scale = 1.0 / math.sqrt(d)
    out = _first(attention(q, k, v, softmax_scale=scale, causal=causal, causal_align=align))
    ref_o, _ = reference.attention_forward(q.float(), k.float(), v.float(), softmax_scale=scale, causal=causal,
                                           bottom_right=br)
    base = naive_attention(q, k, v, softmax_scale=scale, causal=causal, bottom_right=br)
    assert_error_within(out, ref_o, base, eps=EPS, name="public attention")
    if attention_varlen is not None:
        lq, lk = [0, 17, 300], [5, 0, 257]
        cu_q = torch.tensor([0, 0, 17, 317], device=DEV, dtype=torch.int32)
        cu_k = torch.tensor([0, 5, 5, 262], device=DEV, dtype=torch.int32)
        qv = _rand((317, 4, d), torch.bfloat16, g)
        kv = _rand((262, 2, d), torch.bfloat16, g)
        vv = _rand((262, 2, dv), torch.bfloat16, g)
        o = _first(attention_varlen(qv, kv, vv, cu_q, cu_k, max(lq), max(lk), softmax_scale=scale, causal=causal,
                                    causal_align=align))
        kw = dict(cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, softmax_scale=scale, causal=causal, bottom_right=br)
        ref_o, _ = reference.attention_forward(qv.float(), kv.float(), vv.float(), max_seqlen_q=max(lq),
                                               max_seqlen_k=max(lk), **kw)
        base = naive_attention(qv, kv, vv, **kw)
        assert_error_within(o, ref_o, base, eps=EPS, name="public attention_varlen")
