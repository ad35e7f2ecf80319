#!/usr/bin/env python
"""Benchmark mla_autograd.nn.MultiHeadLatentAttention against transformers' DeepseekV3Attention.

Two measurements, median of CUDA-event timings:

1. train step: forward + backward of one attention layer (DeepSeek-V3 dims by default: hidden 7168,
   128 heads, q_lora_rank 1536, latent 512, qk 128+64, v 128, YaRN) at batch 1 x seqlen 4096, causal,
   bf16. Ours (expanded latent + mla_autograd.attention) vs transformers eager and sdpa, same weights.
2. decode step: one new token per request for --decode-batch requests with --decode-len cached
   tokens each, under inference_mode. Ours: paged latent cache + weight-absorbed mla_autograd.decode;
   transformers: its latent DynamicCache (expand_kv over the whole cache every step), eager and sdpa.

Without transformers only our rows run; a row that fails (e.g. out of memory) is recorded with its
error and the rest go on. A GPU run is added to the results store bench/results/layer.json (bench/store.py:
one row per measurement and implementation, keyed by gpu, torch, commit and date) and bench/results/layer.png
is redrawn from it; --out FILE writes the run alone to FILE (and its .png) instead, which a CPU smoke run
needs to write anything (it never goes to the store). Results are printed as well.

    python bench/bench_layer.py                        # GPU, defaults above
    python bench/bench_layer.py --device cpu --small   # smoke test on a CPU
    python bench/bench_layer.py --compile              # also each train row under torch.compile

With --compile, the train rows are repeated with the whole layer call under torch.compile (rows
`<name>+compile`, ours and transformers sdpa): our ops are torch.library ops with fake kernels, so the
projections, RoPE, norms and concatenations around them fuse like any other PyTorch code. Compilation
happens in the warmup calls and is not timed.
"""
from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import mla_autograd  # noqa: E402
from mla_autograd.nn import MultiHeadLatentAttention  # noqa: E402

sys.path.insert(0, os.path.join(ROOT, "bench"))
from common import stamp  # noqa: E402
from store import latest_rows, load, record, store_path  # noqa: E402

try:
    import transformers
    from transformers import DeepseekV3Config
    from transformers.cache_utils import DynamicCache
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3Attention, DeepseekV3RotaryEmbedding
except Exception as e:  # noqa: BLE001 - any import problem means "no transformers rows"
    transformers = None
    _HF_ERR = f"{type(e).__name__}: {e}"


def timeit(fn, *, warmup: int, iters: int, device: torch.device) -> dict:
    """Median / min / max milliseconds of fn() over iters calls after warmup calls."""
    for _ in range(warmup):
        fn()
    times = []
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        for _ in range(iters):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            torch.cuda.synchronize(device)
            times.append(a.elapsed_time(b))
    else:
        for _ in range(iters):
            t = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t) * 1e3)
    return {"median_ms": statistics.median(times), "min_ms": min(times), "max_ms": max(times), "iters": iters}


def hf_config(a, attn: str):
    rope = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0, "original_max_position_embeddings": 4096,
            "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0}
    return DeepseekV3Config(hidden_size=a.hidden, num_attention_heads=a.heads, num_key_value_heads=a.heads,
                            q_lora_rank=a.q_lora_rank or None, kv_lora_rank=a.kv_lora_rank,
                            qk_nope_head_dim=a.nope, qk_rope_head_dim=a.rope, v_head_dim=a.v,
                            max_position_embeddings=163840, rope_parameters=rope, rope_interleave=True,
                            attn_implementation=attn)


def make_ours(a, device, dtype, state=None):
    rope = {"type": "yarn", "factor": 40.0, "original_max_position_embeddings": 4096, "beta_fast": 32,
            "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0}
    m = MultiHeadLatentAttention(a.hidden, a.heads, a.q_lora_rank or None, a.kv_lora_rank, a.nope, a.rope, a.v,
                                 10000.0, 163840, rope)
    if state is not None:
        m.load_state_dict(state)
    else:
        with torch.no_grad():
            for n, p in m.named_parameters():
                if "layernorm" not in n:
                    p.normal_(0.0, 1.0 / math.sqrt(p.shape[-1]))
    return m.to(device, dtype)


def attn_flops(b, s, h, dqk, dv, causal=True):
    f = 2 * b * h * s * s * (dqk + dv)
    return f / 2 if causal else f


def bench_train(a, device, dtype, results, backends):
    B, S = a.batch, a.seqlen
    torch.manual_seed(0)
    ours = make_ours(a, device, dtype)
    x = torch.randn(B, S, a.hidden, device=device, dtype=dtype)
    dy = torch.randn_like(x)
    fl = attn_flops(B, S, a.heads, a.nope + a.rope, a.v)
    q = torch.empty(B, S, a.heads, a.nope + a.rope, device=device, dtype=dtype)
    v = torch.empty(B, S, a.heads, a.v, device=device, dtype=dtype)
    ex = mla_autograd.explain(q, q, v, causal=True)
    backends["train"] = {"forward": ex.forward.backend, "backward": ex.backward.backend}
    print(f"ours attention backend: forward {ex.forward.backend}, backward {ex.backward.backend}")

    def run_rows(name, layer, call):
        xg = x.detach().requires_grad_(True)

        def fwd():
            with torch.no_grad():
                call(layer, x)

        def step():
            layer.zero_grad(set_to_none=True)
            xg.grad = None
            call(layer, xg).backward(dy)

        for kind, fn in (("fwd", fwd), ("fwd_bwd", step)):
            key = f"train_{kind}/{name}"
            try:
                r = timeit(fn, warmup=a.warmup, iters=a.iters, device=device)
                r["attention_tflops_fwd_equiv"] = None
                if kind == "fwd":
                    r["attention_tflops_fwd_equiv"] = fl / (r["median_ms"] * 1e-3) / 1e12
                results[key] = r
                print(f"{key:32s} {r['median_ms']:9.3f} ms (min {r['min_ms']:.3f})")
            except Exception as e:  # noqa: BLE001
                results[key] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
                print(f"{key:32s} FAILED {results[key]['error']}")
            finally:
                if device.type == "cuda":
                    torch.cuda.empty_cache()

    run_rows("mla_autograd", ours, lambda m, h: m(h))
    if a.compile:
        run_rows("mla_autograd+compile", ours, torch.compile(lambda m, h: m(h)))
    state = {k: v.detach().clone() for k, v in ours.state_dict().items()}
    if transformers is None:
        return
    del ours
    for attn in ("eager", "sdpa"):
        try:
            cfg = hf_config(a, attn)
            hf = DeepseekV3Attention(cfg, layer_idx=0).to(device, dtype)
            hf.load_state_dict(state, strict=True)
            rot = DeepseekV3RotaryEmbedding(cfg).to(device)
            pos = torch.arange(S, device=device)[None].expand(B, S)
            mask = None
            if attn == "eager":
                mask = torch.full((S, S), float("-inf"), device=device, dtype=dtype).triu(1)[None, None]

            def call(m, h, rot=rot, pos=pos, mask=mask):
                return m(h, rot(h, pos), mask)[0]

            run_rows(f"transformers_{attn}", hf, call)
            if a.compile and attn == "sdpa":
                run_rows(f"transformers_{attn}+compile", hf, torch.compile(call))
            del hf
        except Exception as e:  # noqa: BLE001
            results[f"train/transformers_{attn}"] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
            print(f"transformers {attn} setup FAILED: {e}")
        if device.type == "cuda":
            torch.cuda.empty_cache()


@torch.inference_mode()
def bench_decode(a, device, dtype, results, backends):
    B, L = a.decode_batch, a.decode_len
    torch.manual_seed(0)
    ours = make_ours(a, device, dtype)
    state = {k: v.detach().clone() for k, v in ours.state_dict().items()}
    x = torch.randn(B, 1, a.hidden, device=device, dtype=dtype)
    total = a.warmup + a.iters + 1
    page = a.page_size
    cache = ours.new_cache(num_pages=B * math.ceil((L + total) / page), page_size=page, batch=B)
    ckv = torch.randn(B, L, a.kv_lora_rank, device=device, dtype=dtype)
    kpe = torch.randn(B, L, a.rope, device=device, dtype=dtype)
    cache.append(ckv, kpe)  # prefilled latents (content does not matter for timing)
    qn = torch.empty(B, 1, a.heads, a.kv_lora_rank, device=device, dtype=dtype)
    qp = torch.empty(B, 1, a.heads, a.rope, device=device, dtype=dtype)
    d = mla_autograd.explain_decode(qn, qp, cache.ckv).decode
    backends["decode"] = d.backend
    print(f"ours decode backend: {d.backend}")
    key = "decode_step/mla_autograd"
    try:
        r = timeit(lambda: ours(x, cache=cache), warmup=a.warmup, iters=a.iters, device=device)
        results[key] = r
        print(f"{key:32s} {r['median_ms']:9.3f} ms (min {r['min_ms']:.3f})  [B={B}, cache {L} tokens, page {page}]")
    except Exception as e:  # noqa: BLE001
        results[key] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
        print(f"{key:32s} FAILED {results[key]['error']}")
    ours = cache = None  # free the memory before the transformers rows
    if transformers is None:
        return
    for attn in ("eager", "sdpa"):
        key = f"decode_step/transformers_{attn}"
        try:
            cfg = hf_config(a, attn)
            hf = DeepseekV3Attention(cfg, layer_idx=0).to(device, dtype)
            hf.load_state_dict(state, strict=True)
            rot = DeepseekV3RotaryEmbedding(cfg).to(device)
            hcache = DynamicCache(config=cfg)
            hcache.update(ckv[:, None], kpe[:, None], 0)  # the latent cache transformers keeps
            n = [L]

            # transformers renamed past_key_values -> cache (5.2x); an unknown keyword is swallowed by
            # **kwargs and the step silently runs without the cache, so pick the one forward takes.
            import inspect
            kw = "cache" if "cache" in inspect.signature(hf.forward).parameters else "past_key_values"

            def step():
                pos = torch.full((B, 1), n[0], device=device, dtype=torch.long)
                hf(x, rot(x, pos), None, **{kw: hcache})
                n[0] += 1

            r = timeit(step, warmup=a.warmup, iters=a.iters, device=device)
            grown = hcache.get_seq_length(0)
            if grown != L + a.warmup + a.iters:
                raise RuntimeError(f"transformers' cache holds {grown} tokens after the steps, expected "
                                   f"{L + a.warmup + a.iters}: the steps did not use it")
            results[key] = r
            print(f"{key:32s} {r['median_ms']:9.3f} ms (min {r['min_ms']:.3f})")
            hf = hcache = None
        except Exception as e:  # noqa: BLE001
            results[key] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
            print(f"{key:32s} FAILED {results[key]['error']}")
        if device.type == "cuda":
            torch.cuda.empty_cache()


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default=None)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    ap.add_argument("--small", action="store_true", help="small sizes for a CPU smoke test")
    ap.add_argument("--hidden", type=int, default=7168)
    ap.add_argument("--heads", type=int, default=128)
    ap.add_argument("--q-lora-rank", type=int, default=1536, help="0 for a full-rank q_proj")
    ap.add_argument("--kv-lora-rank", type=int, default=512)
    ap.add_argument("--nope", type=int, default=128)
    ap.add_argument("--rope", type=int, default=64)
    ap.add_argument("--v", type=int, default=128)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--seqlen", type=int, default=4096)
    ap.add_argument("--decode-batch", type=int, default=16)
    ap.add_argument("--decode-len", type=int, default=4096)
    ap.add_argument("--page-size", type=int, default=64)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--skip-train", action="store_true")
    ap.add_argument("--skip-decode", action="store_true")
    ap.add_argument("--compile", action="store_true", help="also time the train rows under torch.compile")
    ap.add_argument("--out", default=None, help="write this run alone to this JSON file (and its .png), not to the store")
    ap.add_argument("--results", default=None, help="the results store's folder (default bench/results)")
    ap.add_argument("--replot", nargs="?", const="", default=None, metavar="FILE",
                    help="only redraw the PNG of the latest run in a results file (default the layer store)")
    a = ap.parse_args(argv)
    if a.replot is not None:
        src = Path(a.replot) if a.replot else store_path("layer", a.results)
        st = load(src)
        _plot(latest_rows(st), src.with_suffix(".png"), _title(st["runs"][-1]))
        return 0

    device = torch.device(a.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type != "cuda" and not a.small:
        print("no CUDA device: run with --device cpu --small for a smoke test; nothing to measure")
        return 0
    if a.small:
        a.hidden, a.heads, a.q_lora_rank, a.seqlen = 256, 8, 64, 128
        a.decode_batch, a.decode_len, a.page_size, a.warmup, a.iters = 2, 100, 16, 1, 3
    dtype = getattr(torch, a.dtype)
    if device.type == "cpu" and dtype != torch.float32:
        dtype = torch.float32
    if transformers is None:
        print(f"transformers not available ({_HF_ERR}): measuring mla_autograd only")
    import warnings
    warnings.filterwarnings("ignore", message=r"mla_autograd: .* reference path")  # backends are printed

    out = stamp()  # at the start: the run's date is when it began
    results, backends = {}, {}
    if not a.skip_train:
        bench_train(a, device, dtype, results, backends)
    if not a.skip_decode:
        bench_decode(a, device, dtype, results, backends)

    for what in ("train_fwd", "train_fwd_bwd", "decode_step"):
        ours = results.get(f"{what}/mla_autograd", {}).get("median_ms")
        for attn in ("eager", "sdpa"):
            other = results.get(f"{what}/transformers_{attn}", {}).get("median_ms")
            if ours and other:
                print(f"{what}: speedup of mla_autograd over transformers {attn}: {other / ours:.2f}x")
        ours_c = results.get(f"{what}/mla_autograd+compile", {}).get("median_ms")
        for other_key in ("transformers_sdpa", "transformers_sdpa+compile"):
            other = results.get(f"{what}/{other_key}", {}).get("median_ms")
            if ours_c and other:
                print(f"{what}: speedup of mla_autograd+compile over {other_key}: {other / ours_c:.2f}x")
    out.update({
        "bench": "bench_layer",
        "transformers": getattr(transformers, "__version__", None),
        "dtype": str(dtype).replace("torch.", ""),
        "config": {k: getattr(a, k) for k in ("hidden", "heads", "q_lora_rank", "kv_lora_rank", "nope", "rope", "v",
                                              "batch", "seqlen", "decode_batch", "decode_len", "page_size",
                                              "warmup", "iters", "compile")},
        "backends": backends,
    })
    if device.type != "cuda":
        out["gpu"] = "cpu"
        if a.out is None:  # a CPU smoke run: its numbers mean nothing beside the GPU runs of the store
            print("not written (a CPU run goes to a file only with --out)")
            return 0
    rows = result_rows(results)
    path = record("layer", out, rows, out=a.out, results=a.results)
    _plot(rows, path.with_suffix(".png"), _title(out))
    print(f"wrote {path}")
    return 0


def result_rows(results: dict) -> list[dict]:
    """{"<measure>/<impl>": {median_ms, ...}} -> rows {"measure", "impl", median_ms, ...} (the store's layout)."""
    return [{"measure": k.split("/", 1)[0], "impl": k.split("/", 1)[1], **v} for k, v in results.items()]


def _title(run: dict) -> str:
    return f"{run['gpu']}, torch {run['torch']}, commit {run['commit']}"


def _plot(rows: list, path, title: str) -> None:
    """Median ms per implementation, one panel per measurement."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib missing: no plot")
        return
    whats = [w for w in ("train_fwd", "train_fwd_bwd", "decode_step") if any(r["measure"] == w for r in rows)]
    if not whats:
        return
    fig, axes = plt.subplots(1, len(whats), figsize=(4.5 * len(whats), 4), squeeze=False)
    for ax, w in zip(axes[0], whats):
        bars = [(r["impl"], r["median_ms"]) for r in rows if r["measure"] == w and "median_ms" in r]
        ax.bar([n for n, _ in bars], [t for _, t in bars])
        ax.set_title(w)
        ax.set_ylabel("median ms (lower is better)")
        ax.tick_params(axis="x", labelsize=7, rotation=15)
    fig.suptitle(title, fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    try:
        sys.exit(main())
    except Exception:  # noqa: BLE001
        traceback.print_exc()
        sys.exit(1)
