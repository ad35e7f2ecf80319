#!/usr/bin/env python
"""Train a small DeepSeek-V3-style transformers model on mla_autograd's attention, beside SDPA.

Builds a DeepseekV3ForCausalLM from a config (nothing is downloaded), trains it a few steps on the
text shipped in examples/data/ (character-level, as examples/train_mla.py tokenizes it) once with
``attn_implementation=<mla_autograd's name>`` and once with ``"sdpa"`` from the same initial weights,
prints loss and tokens/s of both, then saves the mla_autograd-trained model with save_pretrained and
reloads it with from_pretrained(..., attn_implementation=<name>), checking that the logits agree.

    python examples/hf_train.py                         # CPU: tiny dims, a few seconds
    python examples/hf_train.py --device cuda           # GPU: DeepSeek head dims (192/128), bf16 kernels
    python examples/hf_train.py --packed                # padding-free rows (DataCollatorWithFlattening)

On a GPU the default preset has qk 192 = 128 + 64 and v 128, the dims the kernels serve; on a CPU both
implementations run plain PyTorch (ours through mla_autograd's reference path).
"""
from __future__ import annotations

import argparse
import copy
import os
import sys
import tempfile
import time
import warnings

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))  # run from a source checkout without installing

from transformers import AutoModelForCausalLM, DataCollatorWithFlattening, DeepseekV3Config  # noqa: E402

from mla_autograd.integrations.transformers import register  # noqa: E402

DEFAULT_DATA = os.path.join(HERE, "data", "corpus.txt")

PRESETS = {
    # DeepSeek head dims (qk 128 + 64, v 128; latent 512): the shapes the kernels serve.
    "default": dict(hidden_size=512, num_attention_heads=8, q_lora_rank=256, kv_lora_rank=512, qk_nope_head_dim=128,
                    qk_rope_head_dim=64, v_head_dim=128, intermediate_size=1024, num_hidden_layers=4),
    # Small enough for a CPU in seconds.
    "tiny": dict(hidden_size=64, num_attention_heads=4, q_lora_rank=None, kv_lora_rank=32, qk_nope_head_dim=32,
                 qk_rope_head_dim=16, v_head_dim=32, intermediate_size=128, num_hidden_layers=2),
}


def make_config(preset: str, vocab_size: int, max_len: int) -> DeepseekV3Config:
    # Dense MLPs in every layer (first_k_dense_replace = layers): the example is about attention.
    p = PRESETS[preset]
    return DeepseekV3Config(vocab_size=vocab_size, num_key_value_heads=p["num_attention_heads"],
                            first_k_dense_replace=p["num_hidden_layers"], n_routed_experts=4, num_experts_per_tok=2,
                            n_group=1, topk_group=1, moe_intermediate_size=64, max_position_embeddings=max_len,
                            tie_word_embeddings=False, **p)


def encode_corpus(path: str):
    with open(path, encoding="utf-8") as f:
        text = f.read()
    chars = sorted(set(text))
    index = {c: i for i, c in enumerate(chars)}
    return chars, torch.tensor([index[c] for c in text], dtype=torch.long)


def batch_stream(data: torch.Tensor, batch: int, seq: int, packed: bool, seed: int):
    """Dense (batch, seq) windows, or with ``packed`` one padding-free row of ``batch`` documents of
    random lengths (<= seq) flattened by DataCollatorWithFlattening (position_ids restart per
    document; cu_seq_lens_q/k and max_length_q/k passed along)."""
    gen = torch.Generator().manual_seed(seed)
    collate = DataCollatorWithFlattening(return_flash_attn_kwargs=True)
    while True:
        if not packed:
            ix = torch.randint(0, data.numel() - seq - 1, (batch,), generator=gen).tolist()
            x = torch.stack([data[i:i + seq] for i in ix])
            yield {"input_ids": x, "labels": x.clone()}
        else:
            lens = torch.randint(seq // 4, seq + 1, (batch,), generator=gen).tolist()
            ix = torch.randint(0, data.numel() - seq - 1, (batch,), generator=gen).tolist()
            yield collate([{"input_ids": data[i:i + n].tolist()} for i, n in zip(ix, lens)])


def to_device(batch: dict, device) -> dict:
    return {k: (v.to(device) if torch.is_tensor(v) else v) for k, v in batch.items()}


def train(model, batches, steps: int, lr: float, device) -> tuple[list[float], float, int]:
    """Train ``steps`` steps; returns (losses, seconds for the timed steps, tokens in them). The first
    two steps warm up (kernel builds and first-call allocations) and are not timed."""
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.0)
    losses, seconds, tokens = [], 0.0, 0
    for step in range(steps):
        b = to_device(next(batches), device)
        if device.type == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        loss = model(**b, use_cache=False).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())  # a host sync: the step is done
        if step >= 2:
            seconds += time.perf_counter() - t
            tokens += b["input_ids"].numel()
    return losses, seconds, tokens


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default=None, help="cpu or cuda (default: cuda if available)")
    ap.add_argument("--preset", choices=sorted(PRESETS), default=None,
                    help="model dims (default: 'default' on a GPU, 'tiny' on a CPU)")
    ap.add_argument("--steps", type=int, default=None,
                    help="training steps per implementation (default 8 CPU / 30 GPU)")
    ap.add_argument("--batch-size", type=int, default=None, help="sequences per step (default 4 CPU / 16 GPU)")
    ap.add_argument("--seq-len", type=int, default=None, help="tokens per sequence (default 64 CPU / 1024 GPU)")
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--packed", action="store_true", help="padding-free packed rows instead of dense windows")
    ap.add_argument("--name", default="mla_autograd", help="implementation name to register")
    ap.add_argument("--out", default=None, help="save_pretrained directory (default: a temporary one)")
    ap.add_argument("--data", default=DEFAULT_DATA)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: 1 on a CPU)")
    args = ap.parse_args(argv)

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    gpu = device.type == "cuda"
    if not gpu:
        torch.set_num_threads(args.threads or 1)  # tiny matrices: more threads only add overhead
    preset = args.preset or ("default" if gpu else "tiny")
    steps = args.steps or (30 if gpu else 8)
    batch = args.batch_size or (16 if gpu else 4)
    seq = args.seq_len or (1024 if gpu else 64)
    dtype = torch.bfloat16 if gpu else torch.float32

    name = register(args.name)
    chars, data = encode_corpus(args.data)
    cfg = make_config(preset, len(chars), seq)
    torch.manual_seed(args.seed)
    # dtype= at construction, as from_pretrained builds (a later .to(dtype) would also cast the rotary
    # embedding's inv_freq buffer, which transformers keeps in float32, and the reloaded model would differ)
    init = AutoModelForCausalLM.from_config(copy.deepcopy(cfg), dtype=dtype)
    n_params = sum(p.numel() for p in init.parameters())
    print(f"preset={preset} device={device} dtype={str(dtype).replace('torch.', '')} params={n_params / 1e6:.2f}M "
          f"vocab={len(chars)} layers={cfg.num_hidden_layers} heads={cfg.num_attention_heads} "
          f"qk={cfg.qk_nope_head_dim}+{cfg.qk_rope_head_dim} v={cfg.v_head_dim} seq={seq} batch={batch} "
          f"steps={steps} {'packed' if args.packed else 'dense'}")
    # On a CPU our attention runs mla_autograd's reference path; it says so once per reason.
    warnings.filterwarnings("ignore", message=r"mla_autograd: .* reference path")

    results = {}
    for impl in (name, "sdpa"):
        model = AutoModelForCausalLM.from_config(copy.deepcopy(cfg), attn_implementation=impl, dtype=dtype).to(device)
        model.load_state_dict(init.state_dict())
        losses, seconds, tokens = train(model, batch_stream(data, batch, seq, args.packed, args.seed), steps,
                                        args.lr, device)
        tps = tokens / seconds if seconds > 0 else float("nan")
        results[impl] = (model, losses, tps)
        print(f"{impl:>14}: loss {losses[0]:.3f} -> {losses[-1]:.3f}   {tps:,.0f} tokens/s "
              f"(steps 3..{steps}, fwd+bwd+AdamW)")
    model, losses, tps = results[name]
    print(f"{'':>14}  {name} / sdpa tokens/s: {tps / results['sdpa'][2]:.2f}x; "
          f"max |loss difference| {max(abs(a - b) for a, b in zip(losses, results['sdpa'][1])):.2e}")

    out_dir = args.out or tempfile.mkdtemp(prefix="mla_hf_")
    model.save_pretrained(out_dir)
    reloaded = AutoModelForCausalLM.from_pretrained(out_dir, attn_implementation=name, dtype=dtype).to(device)
    assert reloaded.config._attn_implementation == name
    probe = data[:seq][None].to(device)
    model.eval()
    reloaded.eval()
    with torch.no_grad():
        diff = (model(probe).logits.float() - reloaded(probe).logits.float()).abs().max().item()
    print(f"saved to {out_dir}; reloaded with attn_implementation={name!r}: max |logits difference| {diff:.2e}")
    if diff != 0.0:
        raise SystemExit("the reloaded model's logits differ from the trained model's")
    return losses[0], losses[-1], diff


if __name__ == "__main__":
    main()
