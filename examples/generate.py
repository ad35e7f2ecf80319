#!/usr/bin/env python
"""Generate text with a model trained by examples/train_mla.py, using the paged latent cache.

The prompts are prefilled together as one packed (varlen) batch, which writes each layer's
normalized latent and roped key into its MLACache; then every new token is one weight-absorbed
decode step over the cache (mla_autograd.decode: the decode kernel on a GPU with bf16 and
kv_lora_rank 512 / rope 64 / 8..128 heads, the reference path elsewhere).

    python examples/generate.py --prompt "The river " --prompt "Bread is " --max-new-tokens 200
    python examples/generate.py --verify     # check cached decoding against full recomputation
"""
from __future__ import annotations

import argparse
import os
import sys
import time
import warnings

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))

from train_mla import CharTokenizer, LMConfig, MLALM  # noqa: E402


def load(path: str, device: torch.device, dtype: torch.dtype):
    ckpt = torch.load(path, map_location="cpu", weights_only=False)
    cfg = LMConfig(**ckpt["config"])
    model = MLALM(cfg)
    model.load_state_dict(ckpt["model"])
    model.to(device=device, dtype=dtype).eval()
    return model, CharTokenizer(ckpt["vocab"]), ckpt


def sample(logits: torch.Tensor, temperature: float, top_k: int, gen: torch.Generator) -> torch.Tensor:
    """logits (B, V) -> next ids (B,)."""
    logits = logits.float()
    if temperature <= 0:
        return logits.argmax(-1)
    logits = logits / temperature
    if top_k > 0:
        kth = torch.topk(logits, min(top_k, logits.shape[-1]), dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, -1)
    return torch.multinomial(probs.cpu(), 1, generator=gen).squeeze(-1).to(logits.device)


@torch.inference_mode()
def generate(model: MLALM, prompts: list[list[int]], max_new: int, *, temperature: float = 0.8, top_k: int = 20,
             page_size: int = 64, seed: int = 0):
    """Returns (the new ids per prompt, the logits of every generated step (B, max_new, V), seconds)."""
    device = model.embed_tokens.weight.device
    B = len(prompts)
    lens = [len(p) for p in prompts]
    caches = model.new_caches(B, max(lens) + max_new, page_size=page_size)
    gen = torch.Generator().manual_seed(seed)
    t0 = time.time()
    # prefill: all prompts packed into one varlen batch
    cu = torch.tensor([0] + list(torch.tensor(lens).cumsum(0).tolist()), dtype=torch.int32, device=device)
    ids = torch.tensor([t for p in prompts for t in p], dtype=torch.long, device=device)
    logits = model(ids, caches, cu_seqlens=cu, max_seqlen=max(lens))[cu[1:].long() - 1]  # (B, V)
    steps = [logits]
    out = [sample(logits, temperature, top_k, gen)]
    for _ in range(max_new - 1):
        logits = model(out[-1][:, None], caches)[:, 0]  # one decode step per layer over the paged cache
        steps.append(logits)
        out.append(sample(logits, temperature, top_k, gen))
    if device.type == "cuda":
        torch.cuda.synchronize()
    secs = time.time() - t0
    new = torch.stack(out, 1).tolist()
    return new, torch.stack(steps, 1), secs


@torch.inference_mode()
def verify(model: MLALM, prompts: list[list[int]], new: list[list[int]], step_logits: torch.Tensor) -> float:
    """Recompute every sequence without a cache; return the max |logit difference| of the generated steps."""
    worst = 0.0
    for b, (p, n) in enumerate(zip(prompts, new)):
        seq = torch.tensor(p + n[:-1], dtype=torch.long, device=step_logits.device)[None]
        full = model(seq)[0, len(p) - 1:].float()
        worst = max(worst, (full - step_logits[b].float()).abs().max().item())
    return worst


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--checkpoint", default=os.path.join(HERE, "out", "mla_lm.pt"))
    ap.add_argument("--prompt", action="append", help="prompt text (repeat for a batch)")
    ap.add_argument("--max-new-tokens", type=int, default=200)
    ap.add_argument("--temperature", type=float, default=0.8)
    ap.add_argument("--top-k", type=int, default=20)
    ap.add_argument("--page-size", type=int, default=64)
    ap.add_argument("--device", default=None)
    ap.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"],
                    help="default: bfloat16 on CUDA, float32 on CPU")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--verify", action="store_true", help="compare cached decoding with full recomputation")
    args = ap.parse_args(argv)

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = getattr(torch, args.dtype) if args.dtype else (torch.bfloat16 if device.type == "cuda" else torch.float32)
    if not os.path.exists(args.checkpoint):
        sys.exit(f"no checkpoint at {args.checkpoint}: run examples/train_mla.py first (e.g. --tiny)")
    model, tok, ckpt = load(args.checkpoint, device, dtype)
    cfg = model.cfg
    prompts_text = args.prompt or ["The ", "In the morning ", "A map is "]
    prompts = [tok.encode(p) for p in prompts_text]
    print(f"model: {ckpt.get('preset')} preset, {sum(p.numel() for p in model.parameters()) / 1e6:.2f}M params, "
          f"{cfg.num_layers} layers, {cfg.num_heads} heads, latent {cfg.kv_lora_rank}, trained {ckpt.get('steps')} steps; "
          f"device {device}, {str(dtype).replace('torch.', '')}")
    import mla_autograd
    qn = torch.empty(len(prompts), 1, cfg.num_heads, cfg.kv_lora_rank, device=device, dtype=dtype)
    qp = torch.empty(len(prompts), 1, cfg.num_heads, cfg.qk_rope_head_dim, device=device, dtype=dtype)
    ckv = torch.empty(1, args.page_size, cfg.kv_lora_rank, device=device, dtype=dtype)
    d = mla_autograd.explain_decode(qn, qp, ckv).decode
    print(f"decode backend: {d.backend}" + ("" if d.family else f" ({d.reason})"))
    warnings.filterwarnings("ignore", message=r"mla_autograd: .* reference path")  # said once just above

    new, step_logits, secs = generate(model, prompts, args.max_new_tokens, temperature=args.temperature,
                                      top_k=args.top_k, page_size=args.page_size, seed=args.seed)
    for text, ids in zip(prompts_text, new):
        print("-" * 60)
        print(text + tok.decode(ids))
    print("-" * 60)
    n_tok = len(prompts) * args.max_new_tokens
    print(f"generated {n_tok} tokens ({len(prompts)} x {args.max_new_tokens}) in {secs:.2f}s "
          f"({n_tok / secs:.1f} tokens/s, prefill included)")
    if args.verify:
        err = verify(model, prompts, new, step_logits)
        # float32: rounding only; bf16/fp16: the cached (absorbed) and recomputed (expanded) paths round
        # differently, so allow a few percent of the logit range
        tol = 1e-3 if dtype == torch.float32 else 0.05 * max(1.0, step_logits.float().abs().max().item())
        print(f"verify: max |cached - recomputed| logit difference {err:.3e} "
              f"({'OK' if err <= tol else 'LARGER THAN EXPECTED'}, tolerance {tol:g})")
        if not err <= tol:
            sys.exit(1)


if __name__ == "__main__":
    main()
