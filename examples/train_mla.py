#!/usr/bin/env python
"""Train a small decoder-only language model built on mla_autograd's MultiHeadLatentAttention.

Character-level model on the text shipped in examples/data/ (nothing is downloaded). Each block is
RMSNorm -> MLA -> residual, RMSNorm -> SwiGLU MLP -> residual; the output head is tied to the
embedding unless --untied. On a GPU the attention runs on mla_autograd's kernels automatically (the
dispatch table picks them for bf16 with DeepSeek head dims, which the default preset uses); on the
CPU it runs on the pure-PyTorch reference path.

    python examples/train_mla.py --tiny                # CPU, a few minutes
    python examples/train_mla.py --device cuda         # GPU preset (DeepSeek head dims, bf16 autocast)
    python examples/generate.py --checkpoint examples/out/mla_lm.pt --prompt "The "

Writes the checkpoint (model, config, vocabulary, loss history) and, if matplotlib is installed,
a PNG of the loss curve next to it.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
import warnings
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from torch import nn

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))  # run from a source checkout without installing

from mla_autograd.nn import MLACache, MultiHeadLatentAttention, RMSNorm  # noqa: E402

DEFAULT_DATA = os.path.join(HERE, "data", "corpus.txt")


# --------------------------------------------------------------------------- model
@dataclass
class LMConfig:
    vocab_size: int = 96
    hidden_size: int = 512
    num_layers: int = 4
    num_heads: int = 8
    q_lora_rank: int | None = 256
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128
    intermediate_size: int = 1024
    max_seq_len: int = 256
    rope_theta: float = 10000.0
    tie_embeddings: bool = True


PRESETS = {
    # DeepSeek head dims (192/128, latent 512, rope 64): the shapes the kernels serve.
    "default": LMConfig(),
    # Small enough for a CPU in a few minutes.
    "tiny": LMConfig(hidden_size=96, num_layers=2, num_heads=4, q_lora_rank=None, kv_lora_rank=32,
                     qk_nope_head_dim=16, qk_rope_head_dim=16, v_head_dim=16, intermediate_size=256,
                     max_seq_len=64),
}


class MLP(nn.Module):
    def __init__(self, hidden: int, inter: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, inter, bias=False)
        self.up_proj = nn.Linear(hidden, inter, bias=False)
        self.down_proj = nn.Linear(inter, hidden, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Block(nn.Module):
    def __init__(self, cfg: LMConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size)
        self.self_attn = MultiHeadLatentAttention(
            cfg.hidden_size, cfg.num_heads, q_lora_rank=cfg.q_lora_rank, kv_lora_rank=cfg.kv_lora_rank,
            qk_nope_head_dim=cfg.qk_nope_head_dim, qk_rope_head_dim=cfg.qk_rope_head_dim,
            v_head_dim=cfg.v_head_dim, rope_theta=cfg.rope_theta, max_position_embeddings=cfg.max_seq_len)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size)
        self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size)

    def forward(self, x, cache=None, **kw):
        x = x + self.self_attn(self.input_layernorm(x), cache=cache, **kw)
        return x + self.mlp(self.post_attention_layernorm(x))


class MLALM(nn.Module):
    def __init__(self, cfg: LMConfig):
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.apply(self._init)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    @staticmethod
    def _init(mod):
        if isinstance(mod, (nn.Linear, nn.Embedding)):
            nn.init.normal_(mod.weight, std=0.02)

    def forward(self, ids: torch.Tensor, caches: list[MLACache] | None = None,
                cu_seqlens: torch.Tensor | None = None, max_seqlen: int | None = None) -> torch.Tensor:
        """ids (B, S) -> logits (B, S, vocab); or packed ids (T,) with cu_seqlens/max_seqlen -> (T, vocab).

        With caches (one per layer, see new_caches) the tokens continue the cached sequences.
        """
        x = self.embed_tokens(ids)
        for i, layer in enumerate(self.layers):
            x = layer(x, cache=None if caches is None else caches[i], cu_seqlens=cu_seqlens, max_seqlen=max_seqlen)
        return self.lm_head(self.norm(x))

    def new_caches(self, batch: int, max_len: int, page_size: int = 64, device=None, dtype=None):
        pages = batch * math.ceil(max_len / page_size)
        return [layer.self_attn.new_cache(pages, page_size, batch, device=device, dtype=dtype)
                for layer in self.layers]


# --------------------------------------------------------------------------- data
class CharTokenizer:
    def __init__(self, chars: list[str]):
        self.chars = chars
        self.index = {c: i for i, c in enumerate(chars)}

    @classmethod
    def from_text(cls, text: str) -> "CharTokenizer":
        return cls(sorted(set(text)))

    def encode(self, s: str) -> list[int]:
        unk = self.index.get(" ", 0)
        return [self.index.get(c, unk) for c in s]

    def decode(self, ids) -> str:
        return "".join(self.chars[i] for i in ids)


def batches(data: torch.Tensor, batch: int, seq: int, gen: torch.Generator):
    while True:
        ix = torch.randint(0, data.numel() - seq - 1, (batch,), generator=gen)
        x = torch.stack([data[i:i + seq] for i in ix.tolist()])
        y = torch.stack([data[i + 1:i + seq + 1] for i in ix.tolist()])
        yield x, y


# --------------------------------------------------------------------------- progress
class Progress:
    """A plain-text progress bar (in place on a terminal, a line every 10% otherwise)."""

    def __init__(self, total: int, width: int = 30, stream=sys.stdout):
        self.total, self.width, self.stream = total, width, stream
        self.tty = stream.isatty()
        self.t0 = time.time()
        self.last_pct = -1

    def update(self, step: int, msg: str) -> None:
        frac = step / self.total
        el = time.time() - self.t0
        eta = el / max(step, 1) * (self.total - step)
        filled = int(self.width * frac)
        line = (f"[{'#' * filled}{'.' * (self.width - filled)}] {step}/{self.total} {msg} "
                f"{step / max(el, 1e-9):.1f} it/s, eta {eta:.0f}s")
        if self.tty:
            self.stream.write("\r" + line)
            if step == self.total:
                self.stream.write("\n")
        else:
            pct = int(frac * 10)
            if pct != self.last_pct or step == self.total:
                self.last_pct = pct
                self.stream.write(line + "\n")
        self.stream.flush()


def save_plot(losses, val_points, path) -> bool:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: skipping the loss-curve plot (pip install matplotlib)")
        return False
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(range(1, len(losses) + 1), losses, lw=0.8, alpha=0.5, label="train (per step)")
    k = max(1, len(losses) // 50)
    if len(losses) >= k:
        sm = [sum(losses[i:i + k]) / k for i in range(len(losses) - k + 1)]
        ax.plot(range(k, len(losses) + 1), sm, lw=1.5, label=f"train ({k}-step mean)")
    if val_points:
        ax.plot([s for s, _ in val_points], [v for _, v in val_points], "o-", label="validation")
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats/char)")
    ax.set_title("MLA char-level LM")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


@torch.no_grad()
def evaluate(model, data, args, device, amp, gen, n_batches=8):
    model.eval()
    it = batches(data, args.batch_size, model.cfg.max_seq_len, gen)
    tot = 0.0
    for _ in range(n_batches):
        x, y = next(it)
        x, y = x.to(device), y.to(device)
        with amp():
            logits = model(x)
        tot += F.cross_entropy(logits.float().view(-1, logits.shape[-1]), y.view(-1)).item()
    model.train()
    return tot / n_batches


# --------------------------------------------------------------------------- main
def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tiny", action="store_true", help="small CPU-friendly preset (a few minutes)")
    ap.add_argument("--device", default=None, help="cpu, cuda, cuda:1 ... (default: cuda if available)")
    ap.add_argument("--steps", type=int, default=None, help="training steps (tiny: 400, default: 1500)")
    ap.add_argument("--batch-size", type=int, default=None)
    ap.add_argument("--seq-len", type=int, default=None)
    ap.add_argument("--lr", type=float, default=None)
    ap.add_argument("--data", default=DEFAULT_DATA)
    ap.add_argument("--out", default=os.path.join(HERE, "out"), help="output folder")
    ap.add_argument("--untied", action="store_true", help="untied output head")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--eval-every", type=int, default=None)
    ap.add_argument("--threads", type=int, default=None,
                    help="torch CPU threads (default: 1 for --tiny on a CPU, where more only add overhead)")
    args = ap.parse_args(argv)

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if args.threads or (args.tiny and device.type == "cpu"):
        torch.set_num_threads(args.threads or 1)
    torch.manual_seed(args.seed)
    preset = "tiny" if args.tiny else "default"
    cfg = LMConfig(**asdict(PRESETS[preset]))
    steps = args.steps or (400 if args.tiny else 1500)
    args.batch_size = args.batch_size or (16 if args.tiny else 32)
    args.lr = args.lr or (3e-3 if args.tiny else 1e-3)
    if args.seq_len:
        cfg.max_seq_len = args.seq_len
    cfg.tie_embeddings = not args.untied

    with open(args.data, encoding="utf-8") as f:
        text = f.read()
    tok = CharTokenizer.from_text(text)
    cfg.vocab_size = len(tok.chars)
    data = torch.tensor(tok.encode(text), dtype=torch.long)
    n_val = max(len(data) // 10, cfg.max_seq_len + 2)
    train_data, val_data = data[:-n_val], data[-n_val:]

    model = MLALM(cfg).to(device)
    n_params = sum(p.numel() for p in model.parameters())
    use_amp = device.type == "cuda"
    amp = (lambda: torch.autocast("cuda", dtype=torch.bfloat16)) if use_amp else (lambda: torch.autocast("cpu", enabled=False))
    print(f"preset={preset} device={device} params={n_params / 1e6:.2f}M vocab={cfg.vocab_size} "
          f"text={len(text)} chars layers={cfg.num_layers} hidden={cfg.hidden_size} heads={cfg.num_heads} "
          f"qk={cfg.qk_nope_head_dim}+{cfg.qk_rope_head_dim} v={cfg.v_head_dim} latent={cfg.kv_lora_rank} "
          f"seq={cfg.max_seq_len} batch={args.batch_size} steps={steps} amp={'bf16' if use_amp else 'off'}")
    import mla_autograd
    H, D = cfg.num_heads, cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
    dt = torch.bfloat16 if use_amp else torch.float32
    q = torch.empty(1, cfg.max_seq_len, H, D, device=device, dtype=dt)
    v = torch.empty(1, cfg.max_seq_len, H, cfg.v_head_dim, device=device, dtype=dt)
    ex = mla_autograd.explain(q, q, v, causal=True)
    print(f"attention backend: forward {ex.forward.backend}, backward {ex.backward.backend}"
          + ("" if ex.forward.family else f" ({ex.forward.reason})"))
    warnings.filterwarnings("ignore", message=r"mla_autograd: .* reference path")  # said once just above

    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
    warmup = max(1, steps // 20)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / warmup) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, s / steps)))))
    gen = torch.Generator().manual_seed(args.seed)
    val_gen = torch.Generator().manual_seed(args.seed + 1)
    it = batches(train_data, args.batch_size, cfg.max_seq_len, gen)
    eval_every = args.eval_every or max(1, steps // 5)

    losses, val_points = [], []
    prog = Progress(steps)
    t0 = time.time()
    for step in range(1, steps + 1):
        x, y = next(it)
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        with amp():
            logits = model(x)
        loss = F.cross_entropy(logits.float().view(-1, cfg.vocab_size), y.view(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        losses.append(loss.item())
        if step % eval_every == 0 or step == steps:
            val_points.append((step, evaluate(model, val_data, args, device, amp, val_gen)))
        recent = sum(losses[-20:]) / len(losses[-20:])
        msg = f"loss {recent:.3f}" + (f" val {val_points[-1][1]:.3f}" if val_points else "")
        prog.update(step, msg)
    elapsed = time.time() - t0

    first = sum(losses[:10]) / min(10, len(losses))
    last = sum(losses[-10:]) / min(10, len(losses))
    print(f"done: {steps} steps in {elapsed:.1f}s; train loss {first:.3f} -> {last:.3f} "
          f"(mean of first/last 10 steps), val loss {val_points[-1][1]:.3f}; "
          f"uniform baseline ln({cfg.vocab_size}) = {math.log(cfg.vocab_size):.3f}")

    os.makedirs(args.out, exist_ok=True)
    ckpt = os.path.join(args.out, "mla_lm.pt")
    torch.save({"config": asdict(cfg), "model": model.state_dict(), "vocab": tok.chars, "losses": losses,
                "val": val_points, "preset": preset, "steps": steps}, ckpt)
    print(f"checkpoint: {ckpt}")
    with open(os.path.join(args.out, "train_log.json"), "w") as f:
        json.dump({"preset": preset, "device": str(device), "steps": steps, "seconds": elapsed,
                   "loss_first10": first, "loss_last10": last, "val": val_points}, f, indent=1)
    png = os.path.join(args.out, "loss.png")
    if save_plot(losses, val_points, png):
        print(f"loss curve: {png}")
    return first, last


if __name__ == "__main__":
    main()
