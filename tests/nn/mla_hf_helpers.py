"""Helpers to build a transformers DeepseekV3Attention twin of our layer (test-only dependency)."""
from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="transformers is a test-only dependency")
from transformers import DeepseekV3Config  # noqa: E402
from transformers.models.deepseek_v3.modeling_deepseek_v3 import (  # noqa: E402
    DeepseekV3Attention,
    DeepseekV3RotaryEmbedding,
)

YARN = {"rope_type": "yarn", "factor": 40.0, "original_max_position_embeddings": 16, "beta_fast": 32,
        "beta_slow": 1, "mscale": 0.707, "mscale_all_dim": 0.707}


def hf_config(*, q_lora_rank=None, rope=None, interleave=True, bias=False, attn="eager", hidden=64, heads=4,
              kv_lora_rank=32, nope=16, rope_dim=8, v=16, theta=10000.0, max_pos=640):
    rp = {"rope_type": "default", "rope_theta": theta} if rope is None else dict(rope, rope_theta=theta)
    return DeepseekV3Config(hidden_size=hidden, num_attention_heads=heads, num_key_value_heads=heads,
                            q_lora_rank=q_lora_rank, kv_lora_rank=kv_lora_rank, qk_nope_head_dim=nope,
                            qk_rope_head_dim=rope_dim, v_head_dim=v, max_position_embeddings=max_pos,
                            rope_parameters=rp, rope_interleave=interleave, attention_bias=bias,
                            attn_implementation=attn)


def hf_attention(cfg, dtype, seed=0):
    torch.manual_seed(seed)
    hf = DeepseekV3Attention(cfg, layer_idx=0).to(dtype)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "layernorm" in name:
                p.copy_(1.0 + 0.2 * torch.randn_like(p))  # non-trivial norm weights
            else:
                p.normal_(0.0, 0.15)
    return hf


def hf_forward(hf, cfg, x, position_ids=None):
    """Causal forward of the transformers layer on (B, S, hidden)."""
    B, S, _ = x.shape
    if position_ids is None:
        position_ids = torch.arange(S, device=x.device)[None].expand(B, S)
    rot = DeepseekV3RotaryEmbedding(cfg).to(x.device)
    cos, sin = rot(x, position_ids)
    if cfg._attn_implementation == "eager":
        mask = torch.full((S, S), float("-inf"), dtype=x.dtype, device=x.device).triu(1)[None, None]
    else:
        mask = None  # sdpa: is_causal
    out, _ = hf(x, (cos, sin), mask)
    return out


def hf_rotary(cfg):
    return DeepseekV3RotaryEmbedding(cfg)
