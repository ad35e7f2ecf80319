"""MultiHeadLatentAttention on CPU: cached absorbed path vs training path, varlen, gradients."""
import math

import pytest
import torch

from mla_autograd.nn import MLACache, MultiHeadLatentAttention
from mla_autograd.testing import compiled_backward_graphs, graph_cats

YARN = {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16, "mscale": 0.707,
        "mscale_all_dim": 0.707}


def make_layer(q_lora_rank=None, rope_scaling=None, bias=False, dtype=torch.float64, seed=0, **kw):
    torch.manual_seed(seed)
    dims = dict(kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12)
    dims.update(kw)
    m = MultiHeadLatentAttention(48, 4, q_lora_rank, rope_scaling=rope_scaling, attention_bias=bias, **dims)
    with torch.no_grad():
        for name, p in m.named_parameters():
            if "layernorm" in name:
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            else:
                p.normal_(0.0, 0.2)
    return m.to(dtype)


@pytest.mark.parametrize("q_lora_rank", [None, 20])
@pytest.mark.parametrize("rope_scaling", [None, YARN], ids=["rope", "yarn"])
@pytest.mark.parametrize("page_size", [1, 4, 16])
def test_prefill_then_decode_matches_training_path(q_lora_rank, rope_scaling, page_size):
    m = make_layer(q_lora_rank, rope_scaling)
    B, S, P = 3, 37, 10
    x = torch.randn(B, S, 48, dtype=torch.float64)
    full = m(x)
    cache = m.new_cache(num_pages=B * math.ceil(S / page_size) + 2, page_size=page_size, batch=B)
    with torch.inference_mode():
        outs = [m(x[:, :P], cache=cache)]               # prefill into an empty cache (expanded path)
        outs.append(m(x[:, P:P + 11], cache=cache))      # long chunk: expanded over the gathered cache
        outs.append(m(x[:, P + 11:P + 17], cache=cache))  # short chunk: absorbed decode, Sq > 1, causal
        for t in range(P + 17, S):                       # token-by-token decode (absorbed path)
            outs.append(m(x[:, t:t + 1], cache=cache))
    assert cache.lengths == [S] * B
    assert cache.seqlens.tolist() == [S] * B
    torch.testing.assert_close(torch.cat(outs, 1), full, atol=1e-10, rtol=1e-10)


def test_cache_holds_normalized_latent_and_roped_key():
    m = make_layer(20, YARN)
    x = torch.randn(2, 9, 48, dtype=torch.float64)
    cache = m.new_cache(num_pages=8, page_size=4, batch=2)
    with torch.no_grad():
        m(x[:, :5], cache=cache)
        m(x[:, 5:], cache=cache)
        _, c, k_pe = m._project(x, torch.arange(9))
    for b in range(2):
        ckv, kpe = cache.gather(b)
        torch.testing.assert_close(ckv, c[b], atol=1e-13, rtol=1e-13)
        torch.testing.assert_close(kpe, k_pe[b], atol=1e-13, rtol=1e-13)


def test_packed_prefill_then_dense_decode_different_lengths():
    m = make_layer(20, YARN)
    lens, extra = [5, 1, 12], 4
    xs = [torch.randn(L + extra, 48, dtype=torch.float64) for L in lens]
    refs = [m(t[None])[0] for t in xs]
    cu = torch.tensor([0, 5, 6, 18], dtype=torch.int32)
    cache = m.new_cache(num_pages=20, page_size=3, batch=3)
    with torch.inference_mode():
        y = m(torch.cat([t[:L] for t, L in zip(xs, lens)]), cu_seqlens=cu, max_seqlen=12, cache=cache)
        torch.testing.assert_close(y, torch.cat([r[:L] for r, L in zip(refs, lens)]), atol=1e-10, rtol=1e-10)
        for i in range(extra):
            step = torch.stack([t[L + i] for t, L in zip(xs, lens)])[:, None]
            y = m(step, cache=cache)
            for b, L in enumerate(lens):
                torch.testing.assert_close(y[b, 0], refs[b][L + i], atol=1e-10, rtol=1e-10)
    assert cache.lengths == [L + extra for L in lens]


def test_packed_continuation_of_different_lengths():
    """Packed chunks appended to a non-empty cache (expanded over the gathered cache)."""
    m = make_layer(None, YARN)
    a, b = [4, 9, 1], [3, 1, 12]
    xs = [torch.randn(p + q, 48, dtype=torch.float64) for p, q in zip(a, b)]
    refs = [m(t[None])[0] for t in xs]
    cache = m.new_cache(num_pages=16, page_size=2, batch=3)

    def cu(lens):
        return torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32)

    with torch.inference_mode():
        m(torch.cat([t[:p] for t, p in zip(xs, a)]), cu_seqlens=cu(a), max_seqlen=max(a), cache=cache)
        y = m(torch.cat([t[p:] for t, p in zip(xs, a)]), cu_seqlens=cu(b), max_seqlen=max(b), cache=cache)
    torch.testing.assert_close(y, torch.cat([r[p:] for r, p in zip(refs, a)]), atol=1e-10, rtol=1e-10)
    assert cache.lengths == [p + q for p, q in zip(a, b)]


def test_cache_reset_reuse_and_errors():
    m = make_layer()
    x = torch.randn(2, 6, 48, dtype=torch.float64)
    cache = m.new_cache(num_pages=4, page_size=2, batch=2)
    with torch.no_grad():
        with pytest.raises(RuntimeError, match="out of pages"):  # 2 x 6 tokens need 6 pages > 4
            m(x, cache=cache)
        cache.reset()
        a = m(x[:, :4], cache=cache)
        cache.reset([1])
        assert cache.lengths == [4, 0]
        cache.reset()
        b = m(x[:, :4], cache=cache)
    torch.testing.assert_close(a, b, atol=0, rtol=0)
    with pytest.raises(RuntimeError, match="inference only"):
        m(x, cache=cache)  # grad mode on, parameters require grad
    with pytest.raises(RuntimeError, match="allocate"):
        MLACache(32, 8).ckv


def test_absorbed_weights_refresh_after_update():
    m = make_layer(20)
    x = torch.randn(2, 8, 48, dtype=torch.float64)
    opt = torch.optim.SGD(m.parameters(), lr=0.5)
    for _ in range(2):
        with torch.no_grad():
            cache = m.new_cache(num_pages=8, page_size=4, batch=2)
            m(x[:, :7], cache=cache)
            y = m(x[:, 7:], cache=cache)
        full = m(x)
        torch.testing.assert_close(y, full[:, 7:].detach(), atol=1e-10, rtol=1e-10)
        full.pow(2).sum().backward()
        opt.step()
        opt.zero_grad()
    # load_state_dict (in-place copy) refreshes as well
    other = make_layer(20, seed=5)
    m.load_state_dict(other.state_dict())
    with torch.no_grad():
        cache = m.new_cache(num_pages=8, page_size=4, batch=2)
        m(x[:, :7], cache=cache)
        y = m(x[:, 7:], cache=cache)
        torch.testing.assert_close(y, other(x)[:, 7:], atol=1e-10, rtol=1e-10)


@pytest.mark.parametrize("q_lora_rank", [None, 20])
def test_varlen_matches_separate_calls(q_lora_rank):
    m = make_layer(q_lora_rank, YARN, bias=True)
    lens = [7, 1, 16, 3]
    xs = [torch.randn(L, 48, dtype=torch.float64, requires_grad=True) for L in lens]
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32)
    packed = torch.cat(xs).detach().requires_grad_(True)
    y = m(packed, cu_seqlens=cu, max_seqlen=max(lens))
    g = torch.randn_like(y)
    (y * g).sum().backward()
    grads_packed = {n: p.grad.clone() for n, p in m.named_parameters()}
    m.zero_grad()
    ys = [m(t[None])[0] for t in xs]
    torch.testing.assert_close(y, torch.cat(ys), atol=1e-10, rtol=1e-10)
    (torch.cat(ys) * g).sum().backward()
    torch.testing.assert_close(packed.grad, torch.cat([t.grad for t in xs]), atol=1e-10, rtol=1e-10)
    for n, p in m.named_parameters():
        torch.testing.assert_close(grads_packed[n], p.grad, atol=1e-10, rtol=1e-10, msg=n)


def test_batched_matches_per_sequence_and_explicit_positions():
    m = make_layer(20, YARN)
    x = torch.randn(3, 11, 48, dtype=torch.float64)
    y = m(x)
    for b in range(3):
        torch.testing.assert_close(y[b:b + 1], m(x[b:b + 1]), atol=1e-12, rtol=1e-12)
    torch.testing.assert_close(m(x, position_ids=torch.arange(11)[None].expand(3, 11)), y, atol=0, rtol=0)


def test_default_position_tables_are_reused_and_trainable():
    """The cos/sin tables of positions 0..S-1 are made once per (S, device) and reused; made under inference_mode
    first, they still serve a training forward + backward (they are normal tensors); converting the layer drops
    them."""
    m = make_layer(20, YARN)
    x = torch.randn(2, 7, 48, dtype=torch.float64)
    with torch.inference_mode():
        y0 = m(x)
    (tables,) = m._rope_tables.values()
    assert not any(t.is_inference() for t in tables)
    xg = x.clone().requires_grad_(True)
    y = m(xg)
    assert m._rope_tables[(7, x.device)] is tables  # reused, not rebuilt
    torch.testing.assert_close(y.detach(), y0, atol=0, rtol=0)
    y.sum().backward()
    assert xg.grad is not None and torch.isfinite(xg.grad).all()
    m.to(torch.float32)
    assert not m._rope_tables


@pytest.mark.parametrize("q_lora_rank", [None, 20])
def test_gradients_reach_every_parameter(q_lora_rank):
    m = make_layer(q_lora_rank, YARN, bias=True, dtype=torch.float32)
    x = torch.randn(2, 9, 48, requires_grad=True)
    m(x).square().mean().backward()
    assert x.grad is not None and x.grad.abs().sum() > 0
    for n, p in m.named_parameters():
        assert p.grad is not None, n
        assert torch.isfinite(p.grad).all() and p.grad.abs().sum() > 0, n


def test_gradcheck_tiny_layer():
    torch.manual_seed(0)
    m = MultiHeadLatentAttention(8, 2, 6, kv_lora_rank=4, qk_nope_head_dim=2, qk_rope_head_dim=2, v_head_dim=3,
                                 rope_scaling=YARN, attention_bias=True).double()
    names = [n for n, _ in m.named_parameters()]
    params = [p.detach().clone().requires_grad_(True) for p in m.parameters()]
    x = torch.randn(2, 5, 8, dtype=torch.float64, requires_grad=True)

    def f(x, *ps):
        return torch.func.functional_call(m, dict(zip(names, ps)), (x,))

    assert torch.autograd.gradcheck(f, (x, *params), eps=1e-6, atol=1e-5, rtol=1e-4)


def test_input_validation():
    m = make_layer()
    with pytest.raises(ValueError, match="hidden_size"):
        m(torch.randn(1, 3, 47, dtype=torch.float64))
    with pytest.raises(ValueError, match="max_seqlen"):
        m(torch.randn(3, 48, dtype=torch.float64), cu_seqlens=torch.tensor([0, 3], dtype=torch.int32))
    with pytest.raises(ValueError, match="B, S, hidden"):
        m(torch.randn(3, 48, dtype=torch.float64))


@pytest.mark.parametrize("kw,name", [
    (dict(num_heads=0), "num_heads"),
    (dict(num_heads=-2), "num_heads"),
    (dict(hidden_size=0), "hidden_size"),
    (dict(q_lora_rank=0), "q_lora_rank"),
    (dict(kv_lora_rank=-1), "kv_lora_rank"),
    (dict(qk_nope_head_dim=0), "qk_nope_head_dim"),
    (dict(qk_rope_head_dim=0), "qk_rope_head_dim"),
    (dict(v_head_dim=0), "v_head_dim"),
    (dict(max_position_embeddings=0), "max_position_embeddings"),
    (dict(num_heads=2.0), "num_heads"),
    (dict(num_heads=True), "num_heads"),
])
def test_constructor_rejects_bad_sizes(kw, name):
    args = dict(hidden_size=48, num_heads=4, q_lora_rank=None, kv_lora_rank=32, qk_nope_head_dim=16,
                qk_rope_head_dim=8, v_head_dim=12)
    args.update(kw)
    with pytest.raises(ValueError, match=rf"MultiHeadLatentAttention: {name} must be a positive int, got "
                                         rf"{kw[name]!r}"):
        MultiHeadLatentAttention(**args)


def test_constructor_rejects_odd_rope_dim_and_bad_theta():
    with pytest.raises(ValueError, match="qk_rope_head_dim must be even"):
        MultiHeadLatentAttention(48, 4, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=7, v_head_dim=12)
    for theta in (0.0, -1.0, float("inf"), float("nan")):
        with pytest.raises(ValueError, match="rope_theta must be a positive finite number"):
            MultiHeadLatentAttention(48, 4, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12,
                                     rope_theta=theta)


def test_input_dtype_and_device_must_match_the_layer():
    m = make_layer(dtype=torch.float32)
    x = torch.randn(2, 5, 48, dtype=torch.float64)
    with pytest.raises(TypeError, match=r"hidden_states has dtype float64 but the layer's weights are float32: "
                                        r"pass hidden_states.to\(torch.float32\)"):
        m(x)
    cache = m.new_cache(num_pages=8, page_size=4, batch=2)
    with torch.no_grad(), pytest.raises(TypeError, match="hidden_states has dtype float64"):
        m(x, cache=cache)
    assert cache.is_empty()  # nothing was written
    with pytest.raises(TypeError, match="hidden_states has dtype int64"):
        m(torch.zeros(2, 5, 48, dtype=torch.long))
    with pytest.raises(ValueError, match="hidden_states is on meta but the layer's weights are on cpu"):
        m(torch.empty(2, 5, 48, device="meta"))
    other = MLACache(32, 8).allocate(num_pages=8, page_size=4, batch=2, device="meta", dtype=torch.float32)
    with torch.no_grad(), pytest.raises(ValueError, match="cache is on meta but hidden_states is on cpu"):
        m(x.float(), cache=other)
    # under autocast a mixed dtype is what autocast does: accepted, and the output is autocast's
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = m(x.to(torch.bfloat16))
    ref = m(x.float())
    assert torch.isfinite(y.float()).all()
    torch.testing.assert_close(y.float(), ref, atol=0.1, rtol=0.1)


def test_compiled_backward_hands_the_projections_their_gradients_whole():
    """Under torch.compile the training step's backward gives kv_b_proj its gradient as the attention's backward
    leaves it, with no concatenation of dk_nope and dv (nor of dq_nope and dq_pe for the query): the
    concatenations left are the latent row's [c | k_pe] and, on this CPU path only, one of the query's that the
    rotary's torch ops make in their backward (the CUDA rotary op makes none)."""
    m = make_layer(20, dtype=torch.float32)
    x = torch.randn(2, 5, 48, requires_grad=True)
    cats = graph_cats(compiled_backward_graphs(lambda x_: m(x_).sum(), x))
    assert sorted(cats) == [(2, 5, 4, 16 + 8), (2, 5, 32 + 8)], cats
