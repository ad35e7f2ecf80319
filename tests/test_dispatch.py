"""The dispatch table: which backend is chosen and why, with faked devices."""
import dataclasses

import pytest
import torch

import mla_autograd as M
from mla_autograd import _build, _dispatch
from mla_autograd._dispatch import Call, explain_call


def call(op="attn_fwd", cap=(9, 0), dtype=torch.bfloat16, dims=(192, 128), **kw):
    c = Call(op=op, device=torch.device("cuda", 0), dtype=dtype, dims=dims, num_heads=16, num_kv_heads=16,
             seqlen_q=128, **kw)
    return c, cap


@pytest.fixture
def fake_gpu(monkeypatch):
    """Pretend to be on a GPU of a given capability with every kernel family buildable."""
    state = {"cap": (9, 0), "smem": 232448}
    monkeypatch.setattr(Call, "capability", property(lambda self: state["cap"]))
    monkeypatch.setattr(Call, "smem_per_block", property(lambda self: state["smem"]))
    monkeypatch.setattr(_build, "family_available", lambda name: (True, ""))
    return state


@pytest.mark.parametrize("cap,dims,dtype,expect", [
    ((9, 0), (192, 128), torch.bfloat16, "sm90"),
    ((9, 0), (128, 128), torch.float16, "sm90"),
    ((9, 0), (64, 64), torch.bfloat16, "sm90"),
    ((10, 0), (192, 128), torch.bfloat16, "sm100"),
    ((10, 0), (128, 128), torch.float16, "sm100"),
    ((10, 0), (64, 64), torch.bfloat16, "reference"),
    ((9, 0), (256, 256), torch.bfloat16, "reference"),
    ((9, 0), (192, 128), torch.float32, "reference"),
    ((8, 0), (192, 128), torch.bfloat16, "reference"),
    ((12, 0), (192, 128), torch.bfloat16, "reference"),
])
@pytest.mark.parametrize("op", ["attn_fwd", "attn_bwd"])
def test_attention_routes(fake_gpu, cap, dims, dtype, expect, op):
    fake_gpu["cap"] = cap
    c, _ = call(op=op, dims=dims, dtype=dtype)
    d = explain_call(c)
    assert d.backend == expect, str(d)


@pytest.mark.parametrize("cap,dims,dtype,expect", [
    ((9, 0), (128, 64, 128), torch.bfloat16, "sm90"),
    ((9, 0), (128, 64, 128), torch.float16, "sm90"),
    ((9, 0), (128, 64, 128), torch.float32, "concat"),
    ((9, 0), (64, 64, 128), torch.bfloat16, "concat"),
    ((9, 0), (192, 128), torch.bfloat16, "concat"),
    ((10, 0), (128, 64, 128), torch.bfloat16, "concat"),
    ((8, 0), (128, 64, 128), torch.bfloat16, "concat"),
])
def test_mla_fwd_routes(fake_gpu, cap, dims, dtype, expect):
    """MLA's parts are read in place only by the SM90 forward at (Dn, Dr, Dv) = (128, 64, 128); anything else is
    handed on, concatenated, to attn_fwd's rows."""
    fake_gpu["cap"] = cap
    d = explain_call(call(op="mla_fwd", dims=dims, dtype=dtype)[0])
    assert d.backend == expect, str(d)
    assert (d.family == "fmha_fwd_sm90") == (expect == "sm90")
    if dims == (64, 64, 128):
        assert "part head dims (Dn, Dr, Dv) (64, 64, 128) not in [(128, 64, 128)]" in str(d)


def test_mla_fwd_hand_over_announces_no_fallback(monkeypatch):
    """mla_fwd's last row hands the call to attn_fwd, whose select announces (or, strict, refuses) a reference
    fallback: the hand-over itself neither warns nor raises."""
    import warnings
    monkeypatch.setattr(_dispatch, "_decisions", {})
    monkeypatch.setattr(_dispatch, "_warned", set())
    monkeypatch.setenv("MLA_AUTOGRAD_STRICT", "1")
    c = Call(op="mla_fwd", device=torch.device("cpu"), dtype=torch.float32, dims=(128, 64, 128))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        d = _dispatch.select(c)
    assert d.backend == "concat" and d.family is None
    assert "not sm90: tensors are on cpu, kernels need CUDA" in str(d)
    with pytest.raises(RuntimeError, match="MLA_AUTOGRAD_STRICT=1 forbids the fallback"):
        _dispatch.select(dataclasses.replace(c, op="attn_fwd", dims=(192, 128)))


def test_reasons_name_the_condition(fake_gpu):
    fake_gpu["cap"] = (8, 6)
    d = explain_call(call(dims=(192, 128))[0])
    text = str(d)
    assert "not sm90: needs compute capability 9.0, device has 8.6" in text
    assert "not sm100: needs compute capability 10.0-10.x, device has 8.6 (its build: sm_100f)" in text
    fake_gpu["cap"] = (9, 0)
    d = explain_call(call(dims=(96, 96))[0])
    assert "head dims (96, 96) not in" in str(d)


@pytest.mark.parametrize("cap,heads,sq,page,expect", [
    ((8, 0), 128, 1, 64, "sm80_decode"),
    ((9, 0), 16, 4, 1, "sm80_decode"),
    ((8, 9), 8, 8, 256, "sm80_decode"),
    ((10, 0), 64, 2, 16, "sm80_decode"),
    ((12, 0), 16, 1, 64, "sm80_decode"),
    ((7, 5), 16, 1, 64, "reference"),
    ((9, 0), 12, 1, 64, "reference"),
    ((9, 0), 16, 9, 64, "reference"),
    ((9, 0), 16, 1, 48, "reference"),
])
def test_decode_routes(fake_gpu, cap, heads, sq, page, expect):
    fake_gpu["cap"] = cap
    c = Call(op="decode", device=torch.device("cuda", 0), dtype=torch.bfloat16, dims=(512, 64), causal=True,
             num_heads=heads, num_kv_heads=1, seqlen_q=sq, page_size=page)
    assert explain_call(c).backend == expect


def test_forced_reference_and_strict(fake_gpu, monkeypatch):
    c, _ = call()
    monkeypatch.setenv("MLA_AUTOGRAD_BACKEND", "reference")
    d = explain_call(c)
    assert d.backend == "reference" and "MLA_AUTOGRAD_BACKEND=reference" in str(d)
    monkeypatch.setenv("MLA_AUTOGRAD_STRICT", "1")
    with pytest.raises(RuntimeError, match="MLA_AUTOGRAD_STRICT=1 forbids"):
        _dispatch.select(c)


def test_cpu_explain_and_warning_once(monkeypatch):
    q, k, v = torch.randn(1, 3, 2, 8), torch.randn(1, 3, 2, 8), torch.randn(1, 3, 2, 8)
    e = M.explain(q, k, v, causal=True)
    assert e.forward.backend == "reference" and e.backward.backend == "reference"
    assert "kernels need CUDA" in str(e)
    monkeypatch.setattr(_dispatch, "_warned", set())
    with pytest.warns(UserWarning, match="reference path: .*kernels need CUDA"):
        M.attention(q, k, v)
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        M.attention(q, k, v)  # announced once per reason


def test_missing_family_falls_back_with_reason(monkeypatch):
    monkeypatch.setattr(Call, "capability", property(lambda self: (9, 0)))
    monkeypatch.setattr(_build, "family_available",
                        lambda name: (False, f"kernel family {name} has no sources in csrc/sm90/fmha_fwd/"))
    d = explain_call(call()[0])
    assert d.backend == "reference" and "fmha_fwd_sm90 has no sources" in str(d)


def test_sm100_deterministic_backward_goes_elsewhere(fake_gpu):
    fake_gpu["cap"] = (10, 0)
    d = explain_call(call(op="attn_bwd", deterministic=True)[0])
    assert d.backend == "reference" and "deterministic=True" in str(d)
    assert explain_call(call(op="attn_fwd", deterministic=True)[0]).backend == "sm100"


def test_sm90_backward_serves_deterministic(fake_gpu):
    """fmha_bwd_sm90 orders its dQ sums with semaphores, so deterministic=True stays on the kernel."""
    fake_gpu["cap"] = (9, 0)
    d = explain_call(call(op="attn_bwd", deterministic=True)[0])
    assert d.backend == "sm90", str(d)


# Where code built for an nvcc target loads, written out independently of _kernels.Target: the rule the
# registry must follow (SASS sm_XY on X.Z for Z >= Y, sm_XYa on X.Y only, sm_XYf on X.Z for Z >= Y,
# PTX compute_XY on anything >= X.Y through the driver's JIT).
def _loads(target: str, cap: tuple[int, int]) -> bool:
    kind, num = target.split("_")
    suffix = num[-1] if num[-1] in "af" else ""
    num = num.rstrip("af")
    major, minor = int(num[:-1]), int(num[-1])
    if kind == "compute":
        return cap >= (major, minor)
    if suffix == "a":
        return cap == (major, minor)
    return cap[0] == major and cap[1] >= minor


CAPS = [(8, 0), (8, 6), (8, 9), (9, 0), (10, 0), (10, 3), (12, 0)]
EXPECTED = {  # op -> backend per capability of CAPS
    "attn_fwd": ["reference", "reference", "reference", "sm90", "sm100", "sm100", "reference"],
    "attn_bwd": ["reference", "reference", "reference", "sm90", "sm100", "sm100", "reference"],
    "decode": ["sm80_decode"] * 7,
}


@pytest.mark.parametrize("op", sorted(EXPECTED))
@pytest.mark.parametrize("i", range(len(CAPS)))
def test_routed_family_has_an_image_for_the_capability(fake_gpu, op, i):
    """A call is routed to a family only where its build has SASS or PTX that loads (a module without a
    loadable image fails at the first call, e.g. an sm_80/sm_90-only module on a B200)."""
    cap = fake_gpu["cap"] = CAPS[i]
    if op == "decode":
        c = Call(op="decode", device=torch.device("cuda", 0), dtype=torch.bfloat16, dims=(512, 64), causal=True,
                 num_heads=16, num_kv_heads=1, seqlen_q=1, page_size=64)
    else:
        c = call(op=op, dims=(128, 128))[0]
    d = explain_call(c)
    assert d.backend == EXPECTED[op][i], str(d)
    if d.family is not None:
        targets = _build.FAMILIES[d.family].targets
        assert any(_loads(t, cap) for t in targets), f"{d.family} ({targets}) has no image for {cap}"
        flags = _build.FAMILIES[d.family].gencode_flags()
        assert len(flags) == len(targets) and all(f.startswith("-gencode=arch=compute_") for f in flags)


def test_every_target_rule_matches_the_registry():
    from mla_autograd._kernels import Target
    for fam in _build.FAMILIES.values():
        for t in fam.targets:
            for cap in CAPS + [(7, 5), (9, 9), (11, 0)]:
                assert Target(t).loads_on(cap) == _loads(t, cap), (t, cap)


def test_decode_gets_ptx_that_enables_its_pdl_path():
    """The decode host layer turns on programmatic dependent launch on >= 9.0; only code compiled for
    >= 9.0 waits for the prerequisite grid, so the PTX that newer GPUs JIT must be compute_90 or later."""
    ptx = [t for t in _build.FAMILIES["mla_decode_sm80"].targets if t.startswith("compute_")]
    assert ptx and all(int(t.split("_")[1]) >= 90 for t in ptx)
    assert "-gencode=arch=compute_90,code=compute_90" in _build.FAMILIES["mla_decode_sm80"].gencode_flags()


@pytest.mark.parametrize("sq,sk,align,dims,varlen_same_cu,expect", [
    (256, 256, "top_left", (192, 128), None, "sm100"),       # Sq == Sk: top-left == bottom-right
    (256, 384, "top_left", (192, 128), None, "reference"),   # the kernel's top-left mask is wrong here
    (384, 256, "top_left", (192, 128), None, "reference"),
    (256, 384, "bottom_right", (192, 128), None, "sm100"),
    (256, 384, "top_left", (128, 128), None, "sm100"),       # the 128x128 kernel's mask is right
    (300, 300, "top_left", (192, 128), True, "sm100"),       # varlen, one cu_seqlens tensor
    (300, 300, "top_left", (192, 128), False, "reference"),  # varlen, two tensors (lengths unknown)
])
def test_sm100_mla_backward_top_left_only_where_it_is_right(fake_gpu, sq, sk, align, dims, varlen_same_cu, expect):
    from mla_autograd._ops import attention_call
    fake_gpu["cap"] = (10, 0)
    q = torch.empty(2, sq, 4, dims[0], dtype=torch.bfloat16, device="meta")
    k = torch.empty(2, sk, 4, dims[0], dtype=torch.bfloat16, device="meta")
    v = torch.empty(2, sk, 4, dims[1], dtype=torch.bfloat16, device="meta")
    kw = {}
    if varlen_same_cu is not None:
        q, k, v = q.flatten(0, 1), k.flatten(0, 1), v.flatten(0, 1)
        cu = torch.tensor([0, sq, 2 * sq], dtype=torch.int32)
        kw = dict(cu_seqlens_q=cu, cu_seqlens_k=cu if varlen_same_cu else cu.clone(), max_seqlen_q=sq)
    c = attention_call("attn_bwd", q, k, v, causal=True, bottom_right=align == "bottom_right", **kw)
    c = dataclasses.replace(c, device=torch.device("cuda", 0))
    d = explain_call(c)
    assert d.backend == expect, str(d)
    if expect == "reference":
        assert "top-left diagonal masking is wrong" in str(d)
    # the forward kernel's masks are right: it serves every case
    assert explain_call(dataclasses.replace(c, op="attn_fwd")).backend == "sm100"


def test_sm100_forward_refuses_an_int32_overflowing_output_offset(fake_gpu):
    """max_seqlen_q * Hq * Dv >= 2^31 overflows example 77's int32 output-pointer offset (it would store
    about 8 GiB away): e.g. 128/128, Hq = 128, max_seqlen_q = 131072."""
    from mla_autograd._ops import attention_call
    fake_gpu["cap"] = (10, 0)
    for sq, expect in ((131072, "reference"), (131071, "sm100")):
        q = torch.empty(1, sq, 128, 128, dtype=torch.bfloat16, device="meta")
        c = dataclasses.replace(attention_call("attn_fwd", q, q, q, causal=False, bottom_right=True),
                                device=torch.device("cuda", 0))
        d = explain_call(c)
        assert d.backend == expect, str(d)
        if expect == "reference":
            assert "2^31" in str(d)
    tq = torch.empty(131072 + 5, 128, 128, dtype=torch.bfloat16, device="meta")
    cu = torch.tensor([0, 5, 131077], dtype=torch.int32)
    c = attention_call("attn_fwd", tq, tq, tq, causal=False, bottom_right=True, cu_seqlens_q=cu, cu_seqlens_k=cu,
                       max_seqlen_q=131072)
    assert explain_call(dataclasses.replace(c, device=torch.device("cuda", 0))).backend == "reference"


def test_dispatch_memo_does_not_grow_with_lengths(fake_gpu, monkeypatch):
    """The decision memo is keyed on what the rows read: packed batches with a new token count or a new
    longest sequence each step reuse one entry."""
    from mla_autograd._ops import attention_call
    monkeypatch.setattr(_dispatch, "_decisions", {})
    for total in (1000, 1001, 2047, 4096):
        q = torch.empty(total, 4, 192, dtype=torch.bfloat16, device="meta")
        v = torch.empty(total, 4, 128, dtype=torch.bfloat16, device="meta")
        cu = torch.tensor([0, total], dtype=torch.int32)
        c = attention_call("attn_fwd", q, q, v, causal=True, bottom_right=True, cu_seqlens_q=cu, cu_seqlens_k=cu,
                           max_seqlen_q=total)
        _dispatch.select(dataclasses.replace(c, device=torch.device("cuda", 0)))
    assert len(_dispatch._decisions) == 1


# Values for every Call field that reach each branch of the rows (capabilities, dtypes, dims served or not,
# each check's conditions on both sides).
_FIELD_VALUES = dict(
    device=(torch.device("cuda", 0), torch.device("cpu")), dtype=(torch.bfloat16, torch.float32),
    dims=((192, 128), (128, 128), (64, 64), (512, 64), (96, 96), (128, 64, 128)), causal=(False, True), bottom_right=(False, True),
    varlen=(False, True), num_heads=(16, 128, 12), num_kv_heads=(16, 1), seqlen_q=(1, 9), page_size=(64, 48),
    deterministic=(False, True), seqlens_equal=(False, True), out_rows_over_int32=(False, True))


def test_field_values_cover_every_call_field():
    assert set(_FIELD_VALUES) == {f.name for f in dataclasses.fields(Call)} - {"op"}


def _route_gpu(monkeypatch, reads):
    """A GPU of capability state["cap"] and shared memory state["smem"] with every family buildable, and a Call
    whose field reads are added to `reads` while state["record"] is set (capability and smem_per_block read
    device)."""
    state = {"cap": (9, 0), "smem": 232448, "record": False}

    class Recording(Call):
        def __getattribute__(self, name):
            if name in _FIELD_VALUES and state["record"]:
                reads.add(name)
            return super().__getattribute__(name)

    monkeypatch.setattr(Call, "capability", property(
        lambda self: state["cap"] if self.device.type == "cuda" else None))
    monkeypatch.setattr(Call, "smem_per_block", property(
        lambda self: state["smem"] if self.device.type == "cuda" else 0))
    monkeypatch.setattr(_build, "family_available", lambda name: (True, ""))
    monkeypatch.delenv("MLA_AUTOGRAD_BACKEND", raising=False)
    return state, Recording


@pytest.mark.parametrize("op", sorted(_dispatch.ROUTE_FIELDS))
def test_routes_read_exactly_their_route_fields(monkeypatch, op):
    """Every field a row of the op reads, over calls that take each branch of its rows, is one of
    ROUTE_FIELDS[op] (so the memo keyed on them is right), and each of those is read (so it is no larger
    than the rows need); calls equal in those fields get the same decision."""
    import itertools
    reads: set[str] = set()
    state, Recording = _route_gpu(monkeypatch, reads)
    fields = _dispatch.ROUTE_FIELDS[op]
    decisions: dict = {}
    for cap, smem in ((8, 0), 166912), ((8, 6), 101376), ((9, 0), 232448), ((10, 0), 232448):
        state["cap"], state["smem"] = cap, smem
        for values in itertools.product(*(_FIELD_VALUES[f] for f in fields)):
            for other in ({}, {f: vs[-1] for f, vs in _FIELD_VALUES.items() if f not in fields}):
                c = Recording(op=op, **dict(zip(fields, values)), **other)
                state["record"] = True
                d = explain_call(c)
                state["record"] = False
                assert decisions.setdefault((cap, c.route_key()), d) == d, (c, d, decisions[(cap, c.route_key())])
    assert reads == set(fields)


@pytest.mark.parametrize("op", sorted(_dispatch.ROUTE_FIELDS))
def test_memo_has_one_entry_per_route_key(monkeypatch, op):
    """Calls that differ only in fields no row of the op reads share one memo entry and decision; a call
    that differs in any one field the rows read has its own entry."""
    _route_gpu(monkeypatch, set())
    monkeypatch.setattr(_dispatch, "_decisions", {})
    monkeypatch.setattr(_dispatch, "_warned", set())
    base = Call(op=op, device=torch.device("cuda", 0), dtype=torch.bfloat16,
                dims=(512, 64) if op == "decode" else (192, 128), num_heads=16, seqlen_q=1, page_size=64)
    first = _dispatch.select(base)
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # some of the varied calls go to the reference path
        for name, values in _FIELD_VALUES.items():
            other = next(v for v in values if v != getattr(base, name))
            before = len(_dispatch._decisions)
            d = _dispatch.select(dataclasses.replace(base, **{name: other}))
            if name in _dispatch.ROUTE_FIELDS[op]:
                assert len(_dispatch._decisions) == before + 1, name
            else:
                assert len(_dispatch._decisions) == before and d is first, name
    assert len(_dispatch._decisions) == 1 + len(_dispatch.ROUTE_FIELDS[op])


@pytest.mark.parametrize("smem,heads,sq,expect", [
    (101376, 16, 1, "sm80_decode"),   # 8.6 / 8.9 / 12.0 (99 KB per block): the 16-row tile fits
    (101376, 8, 2, "sm80_decode"),
    (101376, 32, 1, "reference"),     # 32 rows need 115 KB
    (101376, 128, 1, "reference"),
    (166912, 128, 1, "sm80_decode"),  # 8.0 (163 KB)
    (232448, 128, 8, "sm80_decode"),  # 9.0 (227 KB)
])
def test_decode_routes_by_shared_memory(fake_gpu, smem, heads, sq, expect):
    fake_gpu["cap"], fake_gpu["smem"] = (8, 6), smem
    c = Call(op="decode", device=torch.device("cuda", 0), dtype=torch.bfloat16, dims=(512, 64), causal=True,
             num_heads=heads, num_kv_heads=1, seqlen_q=sq, page_size=64)
    d = explain_call(c)
    assert d.backend == expect, str(d)
    if expect == "reference":
        assert "shared memory per block" in str(d)


def test_decode_smem_formula_matches_the_config():
    """TileConfig<M>::smem_bytes(2) + the static slot, from csrc/sm80/mla_decode/mla_decode_sm80_config.h's constants
    (kRowBytes 1152, kBlockN 32, P stride 40, two reduction buffers, a ring of 10 page-id tiles)."""
    assert _dispatch.decode_min_smem_bytes(16) == 16 * 1152 + 2 * 32 * 1152 + 16 * 40 * 2 + 2 * 4 * 16 * 4 + 1280 + 128
    assert _dispatch.decode_min_smem_bytes(33) == 64 * 1152 + 2 * 32 * 1152 + 64 * 40 * 2 + 2 * 2 * 64 * 4 + 1280 + 128
    text = (_build.csrc_dir() / "sm80" / "mla_decode" / "mla_decode_sm80_config.h").read_text()
    for const in ("kDimQK = kDimCkv + kDimKpe", "kBlockN = 32", "kStaticSmemBytes = 128", "kMinStages = 2",
                  "kPageRing = 2 * kMaxStages", "kMaxStages = 5"):
        assert const in text, f"decode_min_smem_bytes mirrors {const!r}: update it with the config"


# ---- the reference-path warning: once per reason, at the caller's line ----

def _fallbacks(record):
    return [w for w in record if "reference path" in str(w.message)]


def _lineno_of(fn, text):
    import inspect
    lines, start = inspect.getsourcelines(fn)
    (i,) = [i for i, line in enumerate(lines) if line.rstrip().endswith(text)]
    return start + i


def test_warning_once_per_reason_at_the_callers_line(monkeypatch):
    """A CPU script using every op, several dtypes and dims, forward and backward, is told once, at its
    first call (not in mla_autograd, not in torch's autograd)."""
    import warnings
    from mla_autograd.testing import random_paged_cache

    monkeypatch.setattr(_dispatch, "_warned", set())
    monkeypatch.delenv("MLA_AUTOGRAD_BACKEND", raising=False)
    q = torch.randn(1, 3, 2, 8, requires_grad=True)
    lens = torch.tensor([3], dtype=torch.int32)
    ckv, kpe, table = random_paged_cache(lens, page_size=4, dim_ckv=8, dim_kpe=4, dtype=torch.float32)
    cu = torch.tensor([0, 3], dtype=torch.int32)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        out = M.attention(q, q, q, causal=True)  # the first call
        out.sum().backward()
        M.attention(q.double(), q.double(), q.double())
        M.attention(q[..., :4], q[..., :4], q[..., :4]).sum().backward()
        M.attention_varlen(q[0], q[0], q[0], cu, cu, 3, 3).sum().backward()
        with torch.no_grad():
            M.decode(torch.randn(1, 1, 2, 8), torch.randn(1, 1, 2, 4), ckv, kpe, table, lens, softmax_scale=0.3)
    (w,) = _fallbacks(record)
    assert w.category is UserWarning and w.filename == __file__
    assert w.lineno == _lineno_of(test_warning_once_per_reason_at_the_callers_line, "# the first call")
    assert "attn_fwd on cpu" in str(w.message) and "sm100, sm90: tensors are on cpu, kernels need CUDA" in str(w.message)


def test_warning_through_the_nn_layer_points_at_the_users_line(monkeypatch):
    import warnings
    from mla_autograd.nn import MultiHeadLatentAttention

    m = MultiHeadLatentAttention(16, 2, None, kv_lora_rank=8, qk_nope_head_dim=4, qk_rope_head_dim=4, v_head_dim=4)
    monkeypatch.setattr(_dispatch, "_warned", set())
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        m(torch.randn(1, 5, 16))  # the layer call
    (w,) = _fallbacks(record)
    assert w.filename == __file__
    assert w.lineno == _lineno_of(test_warning_through_the_nn_layer_points_at_the_users_line, "# the layer call")


def test_backward_warning_points_at_the_backward_call(monkeypatch):
    """A reason first met in the backward: with the backward run from this thread (CPU), the warning points at
    the line that started it and says it is the backward."""
    import warnings

    q = torch.randn(1, 3, 2, 8, requires_grad=True)
    out = M.attention(q, q, q)
    monkeypatch.setattr(_dispatch, "_warned", set())
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        out.sum().backward()  # the backward call
    (w,) = _fallbacks(record)
    assert w.filename == __file__
    assert w.lineno == _lineno_of(test_backward_warning_points_at_the_backward_call, "# the backward call")
    assert "attn_bwd on cpu" in str(w.message) and "(in the backward of an mla_autograd attention call)" in str(w.message)


def test_backward_warning_without_a_python_caller_points_at_the_forward(monkeypatch):
    """An autograd engine device thread runs the backward with no frame outside torch and mla_autograd: the
    warning then goes to the forward's call site, which the autograd Function recorded. Simulated here by
    hiding every frame during the backward."""
    import warnings

    q, cu = torch.randn(1, 3, 2, 8, requires_grad=True), torch.tensor([0, 3], dtype=torch.int32)
    out = M.attention_varlen(q[0], q[0], q[0], cu, cu, 3, 3)  # the forward call
    monkeypatch.setattr(_dispatch, "_warned", set())
    monkeypatch.setattr(_dispatch, "_internal", lambda filename: True)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        out.sum().backward()
    (w,) = _fallbacks(record)
    assert w.filename == __file__
    assert w.lineno == _lineno_of(test_backward_warning_without_a_python_caller_points_at_the_forward,
                                  "# the forward call")
    assert "(in the backward of the mla_autograd varlen attention call on this line)" in str(w.message)
    assert getattr(_dispatch._backward, "site", None) is None  # cleared after the backward

    # no recorded site either (the forward, too, saw no caller): the outermost frame, said plainly
    out = M.attention(q, q, q)
    monkeypatch.setattr(_dispatch, "_warned", set())
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        out.sum().backward()
    (w,) = _fallbacks(record)
    assert "run by the autograd engine without a Python caller" in str(w.message)


def test_forward_records_no_call_site_without_grad(monkeypatch):
    calls = []
    real = _dispatch.call_site
    monkeypatch.setattr(_dispatch, "call_site", lambda *a: calls.append(1) or real(*a))
    q = torch.randn(1, 3, 2, 8)
    M.attention(q, q, q)
    with torch.no_grad():
        M.attention(q.requires_grad_(), q, q)
    assert calls == []
    M.attention(q, q, q)
    assert calls == [1]


def test_every_kernel_row_names_a_family_that_implements_its_op():
    for row in _dispatch.TABLE:
        if row.family is not None:
            assert row.op in _build.FAMILIES[row.family].ops, (row.backend, row.family)
    served = {row.op for row in _dispatch.TABLE if row.family is not None}
    assert served == {op for fam in _build.FAMILIES.values() for op in fam.ops}
