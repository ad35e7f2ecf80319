"""nn layers: DeepSeek Multi-head Latent Attention and its paged latent cache."""
from .cache import MLACache
from .mla import MultiHeadLatentAttention, RMSNorm
from .rope import RotaryEmbedding, apply_rotary, mla_softmax_scale, rope_parameters, yarn_get_mscale

__all__ = [
    "MultiHeadLatentAttention",
    "MLACache",
    "RMSNorm",
    "RotaryEmbedding",
    "apply_rotary",
    "mla_softmax_scale",
    "rope_parameters",
    "yarn_get_mscale",
]
