"""MultiHeadLatentAttention on the GPU (bf16, DeepSeek head dims, so the kernels are used through the
dispatch table): training path and cached absorbed path against a float64 CPU twin, with
FlashAttention's tolerance rule (error <= factor x the error of the same layer run with plain
PyTorch bf16 attention)."""
import math

import pytest
import torch

from mla_autograd.nn import MultiHeadLatentAttention
from mla_autograd.nn import mla as mla_mod
from mla_autograd.testing import init_layer_weights

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

DIMS = dict(q_lora_rank=192, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
            rope_scaling={"type": "yarn", "factor": 40.0, "original_max_position_embeddings": 128,
                          "mscale": 1.0, "mscale_all_dim": 1.0, "beta_fast": 32, "beta_slow": 1})


class _NaiveAPI:
    """Plain PyTorch attention in the inputs' dtype (the baseline of the tolerance rule)."""

    @staticmethod
    def attention(q, k, v, *, causal=False, causal_align="bottom_right", softmax_scale=None, **_):
        from mla_autograd.testing import naive_attention
        return naive_attention(q, k, v, softmax_scale=softmax_scale, causal=causal, bottom_right=True)

    @staticmethod
    def mla_attention(q_nope, q_pe, k_nope, k_pe, v, **kw):
        k_pe = k_pe.expand(*k_nope.shape[:-1], k_pe.shape[-1])
        return _NaiveAPI.attention(torch.cat([q_nope, q_pe], -1), torch.cat([k_nope, k_pe], -1), v, **kw)

    @staticmethod
    def mla_attention_packed(q, kv, k_pe, **kw):
        dn = q.shape[-1] - k_pe.shape[-1]
        return _NaiveAPI.mla_attention(q[..., :dn], q[..., dn:], kv[..., :dn], k_pe, kv[..., dn:], **kw)


def _layers(hidden=512, heads=16, seed=0):
    torch.manual_seed(seed)
    ref = MultiHeadLatentAttention(hidden, heads, **DIMS).double()
    init_layer_weights(ref)
    m = MultiHeadLatentAttention(hidden, heads, **DIMS).to("cuda", torch.bfloat16)
    m.load_state_dict(ref.state_dict())
    return ref, m


def _err(a, b):
    return (a.double().cpu() - b.double().cpu()).abs().max().item()


def test_training_path_bf16_vs_float64(monkeypatch):
    from mla_autograd.testing import assert_error_within
    ref, m = _layers()
    B, S = 2, 301
    x64 = torch.randn(B, S, 512, dtype=torch.float64)
    dy = torch.randn(B, S, 512, dtype=torch.float64)
    x64.requires_grad_(True)
    y_ref = ref(x64)
    y_ref.backward(dy)

    def run():
        m.zero_grad()
        x = x64.detach().to("cuda", torch.bfloat16).requires_grad_(True)
        y = m(x)
        y.backward(dy.to("cuda", torch.bfloat16))
        return y, x.grad, {n: p.grad.clone() for n, p in m.named_parameters()}

    y, dx, grads = run()
    with monkeypatch.context() as mp:
        mp.setattr(mla_mod, "_api", lambda: _NaiveAPI)
        y_b, dx_b, grads_b = run()
    assert torch.isfinite(y).all()
    assert_error_within(y.cpu(), y_ref, y_b.cpu(), factor=2.0, eps=1e-4, name="out")
    assert_error_within(dx.cpu(), x64.grad, dx_b.cpu(), factor=3.0, eps=1e-4, name="dx")
    for n, p in ref.named_parameters():
        assert_error_within(grads[n].cpu(), p.grad, grads_b[n].cpu(), factor=3.0, eps=1e-4, name=f"d{n}")


@pytest.mark.parametrize("page_size", [64, 16])
def test_cached_path_bf16_vs_float64(monkeypatch, page_size):
    from mla_autograd.testing import assert_error_within
    ref, m = _layers()
    B, S, P, C, D = 3, 257, 170, 5, 21
    x64 = torch.randn(B, S, 512, dtype=torch.float64)
    with torch.no_grad():
        y_ref = ref(x64)
    x = x64.to("cuda", torch.bfloat16)
    with torch.inference_mode():
        cache = m.new_cache(num_pages=B * math.ceil(S / page_size) + 1, page_size=page_size, batch=B)
        outs = [m(x[:, :P], cache=cache),                   # prefill: expanded, attention kernel
                m(x[:, P:P + D], cache=cache),               # long chunk: expanded over the gathered cache
                m(x[:, P + D:P + D + C], cache=cache)]       # short chunk: decode kernel, Sq = 5
        for t in range(P + D + C, S):                        # decode kernel, Sq = 1
            outs.append(m(x[:, t:t + 1], cache=cache))
        y = torch.cat(outs, 1)
        with monkeypatch.context() as mp:
            mp.setattr(mla_mod, "_api", lambda: _NaiveAPI)
            y_b = m(x)  # the same bf16 layer, expanded, with plain bf16 attention
    assert torch.isfinite(y).all()
    # the absorbed path rounds the latent query and output to bf16 as well: allow 3x
    assert_error_within(y.cpu(), y_ref, y_b.cpu(), factor=3.0, eps=1e-4, name="cached out")
    assert cache.lengths == [S] * B


def test_varlen_bf16_matches_dense_per_sequence():
    _, m = _layers()
    lens = [1, 130, 77]
    xs = [torch.randn(L, 512, device="cuda", dtype=torch.bfloat16) for L in lens]
    cu = torch.tensor([0, 1, 131, 208], dtype=torch.int32, device="cuda")
    with torch.no_grad():
        y = m(torch.cat(xs), cu_seqlens=cu, max_seqlen=130)
        ys = torch.cat([m(t[None])[0] for t in xs])
    assert torch.isfinite(y).all()
    assert _err(y, ys) <= 2e-2 * max(1.0, ys.abs().max().item())


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0),
                    reason="needs an SM90 GPU")
def test_layer_shapes_dispatch_to_kernels():
    """The layer's calls (bf16, DeepSeek dims, 16 heads) are served by the kernels, not the reference."""
    import mla_autograd
    q = torch.empty(2, 301, 16, 192, device="cuda", dtype=torch.bfloat16)
    v = torch.empty(2, 301, 16, 128, device="cuda", dtype=torch.bfloat16)
    ex = mla_autograd.explain(q, q, v, causal=True)
    assert ex.forward.backend == "sm90", str(ex)
    assert ex.backward.backend == "sm90", str(ex)
    qn = torch.empty(3, 1, 16, 512, device="cuda", dtype=torch.bfloat16)
    qp = torch.empty(3, 1, 16, 64, device="cuda", dtype=torch.bfloat16)
    ckv = torch.empty(10, 64, 512, device="cuda", dtype=torch.bfloat16)
    exd = mla_autograd.explain_decode(qn, qp, ckv)
    assert exd.decode.backend == "sm80_decode", str(exd)
