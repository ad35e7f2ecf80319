"""The public API under a default-device context (``with torch.device(...)``): every tensor the package
makes is made on the device of its inputs, so CPU inputs are computed on the CPU and give CPU results
under ``torch.device("meta")``, bit-identical to the same calls outside the context, and the value checks
still find bad entries. A gpu-marked test does the same with CUDA tensors under ``torch.device("cuda")``
(how FlashMLA's test suite calls decode)."""
import warnings

import pytest
import torch

import mla_autograd as M
from mla_autograd import reference as R
from mla_autograd.nn import MLACache, MultiHeadLatentAttention
from mla_autograd.testing import random_paged_cache


@pytest.fixture(autouse=True)
def _quiet():
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="mla_autograd.*reference path")
        yield


def _cu(lens, device="cpu"):
    out = [0]
    for n in lens:
        out.append(out[-1] + n)
    return torch.tensor(out, dtype=torch.int32, device=device)


def _same(a, b):
    """a, computed under the context, equals b and lives on b's device."""
    if isinstance(a, (tuple, list)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            _same(x, y)
        return
    assert a.device == b.device, (a.device, b.device)
    assert torch.equal(a, b)


def _attention_case(device="cpu", dtype=torch.float64):
    g = torch.Generator().manual_seed(3)
    q = torch.randn(2, 5, 4, 8, generator=g, dtype=dtype).to(device).requires_grad_()
    k = torch.randn(2, 7, 2, 8, generator=g, dtype=dtype).to(device).requires_grad_()
    v = torch.randn(2, 7, 2, 6, generator=g, dtype=dtype).to(device).requires_grad_()
    return q, k, v


def _run_attention(q, k, v):
    out, lse = M.attention(q, k, v, causal=True, return_lse=True)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), torch.ones_like(out))
    return out.detach(), lse, dq, dk, dv


def _run_varlen(q, k, v, cq, ck):
    out, lse = M.attention_varlen(q, k, v, cq, ck, 4, 5, causal=True, return_lse=True)
    return (out.detach(), lse, *torch.autograd.grad(out, (q, k, v), torch.ones_like(out)))


def _decode_case(device="cpu", dtype=torch.float64, H=4, Dc=32, Dr=8, page=4):
    lens = torch.tensor([5, 0, 17], dtype=torch.int32, device=device)
    ckv, kpe, table = random_paged_cache(lens, page_size=page, dim_ckv=Dc, dim_kpe=Dr, dtype=dtype, device=device,
                                         generator=torch.Generator().manual_seed(4))
    g = torch.Generator().manual_seed(5)
    q_nope = torch.randn(3, 1, H, Dc, generator=g).to(device, dtype)
    q_pe = torch.randn(3, 1, H, Dr, generator=g).to(device, dtype)
    return q_nope, q_pe, ckv, kpe, table, lens


def _run_decode(q_nope, q_pe, ckv, kpe, table, lens, **kw):
    with torch.inference_mode():
        s = M.decode_schedule(lens, seqlen_q=q_nope.shape[1], num_heads=q_nope.shape[2])
        a = M.decode(q_nope, q_pe, ckv, kpe, table, lens, softmax_scale=0.2, return_lse=True, **kw)
        b = M.decode(q_nope, q_pe, ckv, kpe, table, lens, softmax_scale=0.2, return_lse=True, schedule=s, **kw)
        return (*a, *b, s.tensor)


def test_attention_under_meta_default_device():
    q, k, v = _attention_case()
    want = _run_attention(q, k, v)
    with torch.device("meta"):
        got = _run_attention(q, k, v)
    _same(got, want)


def test_attention_varlen_under_meta_default_device():
    lq, lk = [3, 0, 4], [2, 5, 1]
    g = torch.Generator().manual_seed(6)
    q = torch.randn(sum(lq), 4, 8, generator=g, dtype=torch.float64).requires_grad_()
    k = torch.randn(sum(lk), 2, 8, generator=g, dtype=torch.float64).requires_grad_()
    v = torch.randn(sum(lk), 2, 6, generator=g, dtype=torch.float64).requires_grad_()
    cq, ck = _cu(lq), _cu(lk)
    want = _run_varlen(q, k, v, cq, ck)
    with torch.device("meta"):
        got = _run_varlen(q, k, v, cq, ck)
        with pytest.raises(ValueError, match=r"cu_seqlens_k\[-1\] = 8 must equal the number of packed tokens \(7\)"):
            M.attention_varlen(q[:, :, :], k[:7], v[:7], cq, ck, 4, 5, check_values=True)
        with pytest.raises(ValueError, match="max_seqlen_q = 3 is smaller than the longest sequence"):
            M.attention_varlen(q, k, v, cq, ck, 3, 5, check_values=True)
    _same(got, want)


def test_mla_attention_under_meta_default_device():
    g = torch.Generator().manual_seed(7)
    parts = [torch.randn(*shape, generator=g, dtype=torch.float64).requires_grad_()
             for shape in ((2, 5, 4, 8), (2, 5, 4, 4), (2, 6, 2, 8), (2, 6, 1, 4), (2, 6, 2, 6))]

    def run():
        out = M.mla_attention(*parts, causal=True)
        return (out.detach(), *torch.autograd.grad(out, parts, torch.ones_like(out)))

    want = run()
    with torch.device("meta"):
        got = run()
        assert M.explain_mla(*parts).forward.backend == "reference"
    _same(got, want)


@pytest.mark.parametrize("check_values", [True, False])
def test_decode_and_schedule_under_meta_default_device(check_values):
    args = _decode_case()
    want = _run_decode(*args, check_values=check_values)
    with torch.device("meta"):
        got = _run_decode(*args, check_values=check_values)
    _same(got, want)


def test_decode_value_errors_under_meta_default_device():
    q_nope, q_pe, ckv, kpe, table, lens = _decode_case()
    bad_table = table.clone()
    bad_table[2, 3] = 10_000
    with torch.device("meta"), torch.no_grad():
        with pytest.raises(ValueError, match=r"block_table\[2, 3\] = 10000 is not a page index"):
            M.decode(q_nope, q_pe, ckv, kpe, bad_table, lens, softmax_scale=0.2, check_values=True)
        with pytest.raises(ValueError, match=r"cache_seqlens\[0\] = 999 must be 0"):
            M.decode(q_nope, q_pe, ckv, kpe, table, torch.tensor([999, 0, 17], dtype=torch.int32, device="cpu"),
                     softmax_scale=0.2, check_values=True)


def test_explain_under_meta_default_device():
    q, k, v = _attention_case(dtype=torch.float32)
    q_nope, q_pe, ckv, _, _, _ = _decode_case(dtype=torch.float32)
    want = (str(M.explain(q, k, v, causal=True)), str(M.explain_decode(q_nope, q_pe, ckv)))
    with torch.device("meta"):
        got = (str(M.explain(q, k, v, causal=True)), str(M.explain_decode(q_nope, q_pe, ckv)))
    assert got == want and "kernels need CUDA" in got[0]


def test_reference_functions_under_meta_default_device():
    q, k, v = (t.detach() for t in _attention_case())
    kw = dict(softmax_scale=0.3, causal=True, bottom_right=False)
    out, lse = R.attention_forward(q, k, v, **kw)
    want = (out, lse, *R.attention_backward(torch.ones_like(out), q, k, v, out, lse, **kw))
    with torch.device("meta"):
        out_m, lse_m = R.attention_forward(q, k, v, **kw)
        got = (out_m, lse_m, *R.attention_backward(torch.ones_like(out), q, k, v, out_m, lse_m, **kw))
    _same(got, want)


def _layer(device=None, dtype=torch.float64):
    torch.manual_seed(0)
    m = MultiHeadLatentAttention(32, 4, 16, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8,
                                 rope_scaling={"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16,
                                               "mscale": 0.707, "mscale_all_dim": 0.707})
    with torch.no_grad():
        for p in m.parameters():
            p.normal_(0.0, 0.3)
    return m.to(device=device, dtype=dtype)


def _run_layer(m, x, device="cpu"):
    """Training forward + backward, then prefill, a short chunk and two decode steps through a cache, then a
    packed continuation through another cache."""
    y = m(x)
    (gx,) = torch.autograd.grad(y.square().sum(), x)
    outs = [y.detach(), gx]
    cache = m.new_cache(num_pages=12, page_size=4, batch=2)
    with torch.inference_mode():
        outs.append(m(x[:, :5], cache=cache))
        outs.append(m(x[:, 5:7], cache=cache))
        for t in (7, 8):
            outs.append(m(x[:, t:t + 1], cache=cache))
        cache2 = MLACache(16, 4).allocate(num_pages=12, page_size=2, batch=2, device=device, dtype=x.dtype)
        a, b = [3, 6], [4, 1]
        packed = torch.cat([x[0, :3], x[1, :6]])
        outs.append(m(packed, cu_seqlens=_cu(a, device), max_seqlen=6, cache=cache2))
        more = torch.cat([x[0, 3:7], x[1, 6:7]])
        outs.append(m(more, cu_seqlens=_cu(b, device), max_seqlen=4, cache=cache2))
        outs.append(cache2.gather_all()[0])
        cache2.reset([0])
        outs.append(cache2.seqlens.clone())
    return outs


def test_layer_forward_and_cached_decode_under_meta_default_device():
    m = _layer()
    x = torch.randn(2, 9, 32, dtype=torch.float64, requires_grad=True)
    want = _run_layer(m, x)
    with torch.device("meta"):
        got = _run_layer(m, x)
    _same(got, want)


@pytest.mark.gpu
def test_public_api_under_cuda_default_device():
    """FlashMLA's suite runs ``with torch.device("cuda"):``: CUDA calls (kernel shapes for decode) and CPU calls
    both run there, with the value checks on, and give what they give outside the context."""
    q, k, v = _attention_case("cuda", torch.bfloat16)
    want_attn = _run_attention(q, k, v)
    dargs = _decode_case("cuda", torch.bfloat16, H=16, Dc=512, Dr=64, page=64)
    want_dec = _run_decode(*dargs, check_values=True)
    cpu_q, cpu_k, cpu_v = _attention_case()
    want_cpu = _run_attention(cpu_q, cpu_k, cpu_v)
    cpu_dec = _decode_case()
    want_cpu_dec = _run_decode(*cpu_dec, check_values=True)
    m = _layer()
    x = torch.randn(2, 9, 32, dtype=torch.float64, requires_grad=True)
    want_layer = _run_layer(m, x)
    m_gpu = _layer("cuda", torch.float32)
    xg = x.detach().float().cuda().requires_grad_()
    want_layer_gpu = _run_layer(m_gpu, xg, "cuda")
    with torch.device("cuda"):
        _same(_run_attention(q, k, v), want_attn)
        _same(_run_decode(*dargs, check_values=True), want_dec)
        _same(_run_attention(cpu_q, cpu_k, cpu_v), want_cpu)
        _same(_run_decode(*cpu_dec, check_values=True), want_cpu_dec)
        _same(_run_layer(m, x), want_layer)
        _same(_run_layer(m_gpu, xg, "cuda"), want_layer_gpu)
        bad = dargs[4].clone()
        bad[2, 0] = -1
        with torch.no_grad(), pytest.raises(ValueError, match=r"block_table\[2, 0\] = -1 is not a page index"):
            M.decode(*dargs[:4], bad, dargs[5], softmax_scale=0.2, check_values=True)


def test_layer_built_under_meta_context_then_materialised():
    """Parameters follow the context (meta), the rotary tables stay real CPU tensors: after to_empty and
    load_state_dict the layer computes what a layer built on the CPU computes."""
    ref = _layer()
    with torch.device("meta"):
        m = MultiHeadLatentAttention(32, 4, 16, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8,
                                     rope_scaling=ref.rope_scaling, dtype=torch.float64)
    assert m.kv_b_proj.weight.is_meta
    m = m.to_empty(device="cpu")
    m.load_state_dict(ref.state_dict())
    x = torch.randn(2, 9, 32, dtype=torch.float64)
    _same(m(x), ref(x))


def _sync_warnings(fn) -> list[str]:
    """The synchronisations fn() makes on the GPU: torch's sync debug mode warns at each one."""
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as record:
            warnings.simplefilter("always")
            fn()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    return [str(w.message) for w in record if "synchronizing" in str(w.message)]


@pytest.mark.gpu
def test_value_checks_synchronise_once_on_cuda(monkeypatch):
    """On a GPU the default public calls never synchronise (decode, attention_varlen forward and backward,
    decode_schedule); a call that asks for value checks costs one synchronising copy (of one int64)."""
    from mla_autograd import _validate

    q_nope, q_pe, ckv, kpe, table, lens = _decode_case("cuda", torch.bfloat16, H=16, Dc=512, Dr=64, page=64)
    q, k, v = (torch.randn(9, 4, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    cq = _cu([4, 5], "cuda")

    def syncs(fn):
        return len(_sync_warnings(fn))

    monkeypatch.delenv("MLA_AUTOGRAD_CHECK_VALUES", raising=False)
    assert syncs(lambda: _validate.check_decode(q_nope, q_pe, ckv, kpe, table, lens, 0.2)) == 0
    assert syncs(lambda: _validate.check_decode(q_nope, q_pe, ckv, kpe, table, lens, 0.2, check_values=True)) == 1
    assert syncs(lambda: _validate.check_attention_varlen(q, k, v, cq, cq, 5, 5)) == 0
    assert syncs(lambda: _validate.check_attention_varlen(q, k, v, cq, cq, 5, 5, check_values=True)) == 1
    assert syncs(lambda: M.decode_schedule(lens, seqlen_q=1, num_heads=16)) == 0
    # the whole default calls, their kernels included (warm: the first call builds and loads the modules)
    with torch.inference_mode():
        M.decode(q_nope, q_pe, ckv, kpe, table, lens, softmax_scale=0.1)
        assert syncs(lambda: M.decode(q_nope, q_pe, ckv, kpe, table, lens, softmax_scale=0.1)) == 0
    qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))

    def varlen_step():
        out = M.attention_varlen(qg, kg, vg, cq, cq, 5, 5, causal=True)
        torch.autograd.grad(out, (qg, kg, vg), torch.ones_like(out))
    varlen_step()
    assert syncs(varlen_step) == 0


@pytest.mark.gpu
def test_layer_and_cache_do_not_synchronise_on_cuda():
    """The nn layer on a GPU: a packed training step, a packed prefill into the cache with cu_seqlens on the host,
    and cached decode steps that hand out new pages (host bookkeeping, block_table rows copied to the device)
    never synchronise with the device."""
    m = MultiHeadLatentAttention(256, 16, 64, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
                                 v_head_dim=128, device="cuda", dtype=torch.bfloat16)
    lens = [5, 70, 3]
    cu_host = _cu(lens)
    syncs = _sync_warnings
    x = torch.randn(sum(lens), 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)

    def train_step():
        m(x, cu_seqlens=cu_host, max_seqlen=max(lens)).float().square().mean().backward()
    train_step()
    assert syncs(train_step) == []
    cache = MLACache(512, 64).allocate(num_pages=16, page_size=64, batch=3, device="cuda", dtype=torch.bfloat16)
    with torch.inference_mode():
        xp = x.detach()
        assert syncs(lambda: m(xp, cu_seqlens=cu_host, max_seqlen=max(lens), cache=cache)) == []
        step = torch.randn(3, 1, 256, device="cuda", dtype=torch.bfloat16)
        m(step, cache=cache)  # warm: the decode route
        # lengths 6/71/4 -> 66/131/64: the first two sequences cross a page boundary (new pages handed out)
        for _ in range(60):
            assert syncs(lambda: m(step, cache=cache)) == []
    assert cache.lengths == [66, 131, 64]
