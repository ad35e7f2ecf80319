"""The dispatch table: which backend is chosen and why, with faked devices."""
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
    state = {"cap": (9, 0)}
    monkeypatch.setattr(Call, "capability", property(lambda self: state["cap"]))
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


def test_reasons_name_the_condition(fake_gpu):
    fake_gpu["cap"] = (8, 6)
    d = explain_call(call(dims=(192, 128))[0])
    text = str(d)
    assert "not sm90: needs compute capability 9.0, device has 8.6" in text
    assert "not sm100: needs compute capability 10.x" in text
    fake_gpu["cap"] = (9, 0)
    d = explain_call(call(dims=(96, 96))[0])
    assert "head dims (96, 96) not in" in str(d)


@pytest.mark.parametrize("cap,heads,sq,page,expect", [
    ((8, 0), 128, 1, 64, "sm80_decode"),
    ((9, 0), 16, 4, 1, "sm80_decode"),
    ((8, 9), 8, 8, 256, "sm80_decode"),
    ((10, 0), 64, 2, 16, "sm80_decode"),
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
                        lambda name: (False, f"kernel family {name} has no sources in csrc/sm90/"))
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
    assert "attn_bwd on cpu" in str(w.message) and "(in the backward of mla_autograd.attention)" in str(w.message)


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
    assert "(in the backward of the mla_autograd.attention_varlen call on this line)" in str(w.message)
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
