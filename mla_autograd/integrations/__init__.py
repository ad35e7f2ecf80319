"""Integrations of mla_autograd's attention with other libraries.

    mla_autograd.integrations.transformers: Hugging Face transformers models (DeepseekV3ForCausalLM,
        DeepseekV2, any model that calls its attention through transformers' AttentionInterface) run
        their attention on `mla_autograd.attention` / `attention_varlen` after ``register()``.

Each integration is its own module and imports its library only when that module is imported, so
``import mla_autograd`` never imports transformers.
"""
__all__ = ["transformers"]


def __getattr__(name):
    if name == "transformers":  # imported on first use: it imports the transformers package
        import importlib
        return importlib.import_module(".transformers", __name__)
    raise AttributeError(f"module 'mla_autograd.integrations' has no attribute {name!r}")
