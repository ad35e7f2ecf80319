"""MultiHeadLatentAttention against transformers' DeepseekV3Attention (identical weights), on CPU."""
import pytest
import torch

from mla_autograd.nn import MultiHeadLatentAttention, mla_softmax_scale, rope_parameters

from mla_hf_helpers import YARN, hf_attention, hf_config, hf_forward, hf_rotary

# transformers computes its RMSNorm statistics in float32 even for float64 inputs (we keep float64),
# so float64 agreement is at float32 resolution; float32 agreement is at float32 resolution too.
TOL = {torch.float64: 2e-6, torch.float32: 2e-5}


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("q_lora_rank", [None, 24])
@pytest.mark.parametrize("rope", [None, YARN], ids=["rope", "yarn"])
@pytest.mark.parametrize("interleave", [True, False])
def test_matches_transformers(dtype, q_lora_rank, rope, interleave):
    cfg = hf_config(q_lora_rank=q_lora_rank, rope=rope, interleave=interleave)
    hf = hf_attention(cfg, dtype)
    ours = MultiHeadLatentAttention.from_config(cfg).to(dtype)
    res = ours.load_state_dict(hf.state_dict(), strict=True)
    assert not res.missing_keys and not res.unexpected_keys
    assert ours.softmax_scale == pytest.approx(hf.scaling, rel=1e-12)
    torch.manual_seed(1)
    x = torch.randn(2, 37, cfg.hidden_size, dtype=dtype)
    ref = hf_forward(hf, cfg, x)
    out = ours(x)
    assert out.shape == ref.shape and out.dtype == dtype
    torch.testing.assert_close(out, ref, atol=TOL[dtype], rtol=TOL[dtype])


def test_matches_transformers_offset_positions_and_bias():
    cfg = hf_config(q_lora_rank=24, rope=YARN, bias=True)
    hf = hf_attention(cfg, torch.float64)
    ours = MultiHeadLatentAttention.from_config(cfg).double()
    ours.load_state_dict(hf.state_dict(), strict=True)
    assert ours.q_a_proj.bias is not None and ours.o_proj.bias is not None and ours.q_b_proj.bias is None
    x = torch.randn(3, 20, cfg.hidden_size, dtype=torch.float64)
    pos = torch.arange(20)[None] + torch.tensor([[0], [7], [300]])
    torch.testing.assert_close(ours(x, position_ids=pos), hf_forward(hf, cfg, x, pos), atol=2e-6, rtol=2e-6)


def test_matches_transformers_sdpa_and_reverse_load():
    cfg = hf_config(q_lora_rank=None, attn="sdpa")
    ours = MultiHeadLatentAttention.from_config(cfg).float()
    hf = hf_attention(cfg, torch.float32)
    hf.load_state_dict(ours.state_dict(), strict=True)  # ours -> transformers too
    x = torch.randn(2, 33, cfg.hidden_size)
    torch.testing.assert_close(ours(x), hf_forward(hf, cfg, x), atol=2e-5, rtol=2e-5)


def test_state_dict_keys_and_shapes():
    for q_lora in (None, 24):
        cfg = hf_config(q_lora_rank=q_lora)
        hf = hf_attention(cfg, torch.float32)
        ours = MultiHeadLatentAttention.from_config(cfg)
        a = {k: tuple(v.shape) for k, v in hf.state_dict().items()}
        b = {k: tuple(v.shape) for k, v in ours.state_dict().items()}
        assert a == b


def test_direct_constructor_deepseek_v3_dims():
    """The positional signature with DeepSeek-V3's real dims gives transformers' shapes and scale."""
    ys = {"type": "yarn", "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0, "beta_fast": 32, "beta_slow": 1,
          "original_max_position_embeddings": 4096}
    m = MultiHeadLatentAttention(256, 2, 64, 512, 128, 64, 128, 10000.0, 163840, ys, False, device="meta")
    shapes = {k: tuple(v.shape) for k, v in m.state_dict().items()}
    assert shapes == {"q_a_proj.weight": (64, 256), "q_a_layernorm.weight": (64,), "q_b_proj.weight": (384, 64),
                      "kv_a_proj_with_mqa.weight": (576, 256), "kv_a_layernorm.weight": (512,),
                      "kv_b_proj.weight": (512, 512), "o_proj.weight": (256, 256)}
    # DeepSeek-V3: 192**-0.5 * (0.1 * ln 40 + 1)**2
    import math
    assert m.softmax_scale == pytest.approx(192 ** -0.5 * (0.1 * math.log(40) + 1) ** 2, rel=1e-12)


@pytest.mark.parametrize("rope", [None, YARN, dict(YARN, mscale=1.0, mscale_all_dim=1.0, factor=40.0,
                                                   original_max_position_embeddings=4096)])
def test_rope_tables_match_transformers(rope):
    cfg = hf_config(rope=rope, rope_dim=64, max_pos=163840)
    rot = hf_rotary(cfg)
    inv, factor = rope_parameters(64, 10000.0, 163840, rope)
    torch.testing.assert_close(inv, rot.inv_freq, atol=0, rtol=0)
    assert factor == pytest.approx(rot.attention_scaling, rel=1e-12)
    hf = hf_attention(cfg, torch.float32)
    assert mla_softmax_scale(cfg.qk_nope_head_dim + 64, rope) == pytest.approx(hf.scaling, rel=1e-12)
