#!/usr/bin/env python
"""Benchmark transformers models on mla_autograd's attention against transformers' own sdpa and eager.

Models, built from configs (nothing downloaded), with dense MLPs only (first_k_dense_replace =
num_hidden_layers: MoE routing is unrelated to attention):

- tiny: a DeepseekV3ForCausalLM with DeepSeek head dims (hidden 1024, 8 heads, q_lora_rank 512, latent 512,
  qk 128 + 64, v 128), 4 layers, intermediate 2816, vocab 32000.
- dsv3-layer: one decoder layer with DeepSeek-V3's attention (hidden 7168, 128 heads, q_lora_rank 1536,
  latent 512, qk 128 + 64, v 128, YaRN), a dense MLP of intermediate 4096, vocab 32000.

Every implementation runs the same model, so the same weights (bf16 on a GPU): it is built once and
switched with model.set_attn_implementation(...). Measurements, each the median of CUDA-event timings of
single calls (host work included, a synchronisation after each), warmup calls untimed:

- train_step: forward + backward of the causal LM loss on B x S tokens (tiny 4 x 2048, dsv3-layer 1 x 4096),
  use_cache=False; the gradients are set to None before each step (untimed).
- prefill: the forward generate runs on a prompt of B x S tokens, under inference_mode: a fresh
  DynamicCache filled, the logits of the last position only (logits_to_keep=1).
- decode_step: one greedy next-token step (forward of one token per sequence, then argmax) with
  transformers' own DynamicCache after a prefill of S tokens (tiny: B 8, S 2048; dsv3-layer: B 1 to 4,
  S 4096). Every timed step starts from the same cache state: the token the previous step appended is
  cropped off (cache.crop(-1), untimed), so each step attends to S + 1 tokens and pays the DynamicCache's
  own concatenation, as a real step does. The steps' input token is drawn once per batch size and shared
  by the implementations.

Before the timings, a cross-check against sdpa (run first), recorded in the rows as
max_abs_diff_vs_sdpa: for train_step and prefill rows, the max |difference| of the full logits of the
train_step batch; for decode_step rows, of the first step's logits, each implementation after its own
prefill of the same prompt.

Rows: model, measurement, impl, B, S, dtype, ms (median; min_ms, max_ms), tokens_per_s (B x S tokens per
call; B for decode_step), peak_mem_gb (torch.cuda.max_memory_allocated during the row's calls, in 1e9
bytes, the weights included; for decode_step the steps' with their cache, not the prefill's),
speedup_vs_sdpa (our rows: sdpa's ms over ours), max_abs_diff_vs_sdpa (our and eager rows). A row that
fails (out of memory, unsupported) is recorded with its error and the rest go on. On a GPU our rows run
under MLA_AUTOGRAD_STRICT=1: a call that no kernel serves fails its row instead of timing a fallback path.
--small runs both models at a few dozen tokens (float32 on a CPU, through mla_autograd's reference path).

A GPU run is added to the results store bench/results/transformers.json (bench/store.py) and
bench/results/transformers.png is redrawn from it; --out FILE writes the run alone to FILE (and its .png)
instead, which a CPU smoke run needs to write anything (it never goes to the store).

    python bench/bench_transformers.py                                  # GPU: both models, every measurement
    python bench/bench_transformers.py --models tiny --measurements train_step,decode_step
    python bench/bench_transformers.py --device cpu --small --out run.json   # smoke test on a CPU
"""
from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import time
import traceback
import warnings
from pathlib import Path

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import mla_autograd  # noqa: E402

sys.path.insert(0, os.path.join(ROOT, "bench"))
from common import stamp  # noqa: E402
from store import latest_rows, load, record, store_path  # noqa: E402

try:
    import transformers
    from transformers import AutoModelForCausalLM, DeepseekV3Config

    from mla_autograd.integrations.transformers import register
except Exception as e:  # noqa: BLE001 - any import problem means "nothing to measure"
    transformers = None
    _HF_ERR = f"{type(e).__name__}: {e}"

BENCH = "transformers"
OURS = "mla_autograd"  # the name register() gives our attention in transformers
IMPLS = ("sdpa", OURS, "eager")  # in run order: sdpa first, the reference of the cross-check and of the speedups
MEASUREMENTS = ("train_step", "prefill", "decode_step")

DEEPSEEK_HEADS = dict(kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128)
YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0, "original_max_position_embeddings": 4096,
        "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0}

# config: DeepseekV3Config fields; train: (B, S) of train_step, prefill and the cross-check;
# decode: (batch sizes, cached tokens S) of decode_step.
MODELS = {
    "tiny": dict(config=dict(hidden_size=1024, num_attention_heads=8, q_lora_rank=512, intermediate_size=2816,
                             num_hidden_layers=4, vocab_size=32000, max_position_embeddings=4096, **DEEPSEEK_HEADS),
                 train=(4, 2048), decode=((8,), 2048)),
    "dsv3-layer": dict(config=dict(hidden_size=7168, num_attention_heads=128, q_lora_rank=1536,
                                   intermediate_size=4096, num_hidden_layers=1, vocab_size=32000,
                                   max_position_embeddings=163840, rope_parameters=YARN, **DEEPSEEK_HEADS),
                       train=(1, 4096), decode=((1, 2, 3, 4), 4096)),
}
# --small: the same two models at sizes a CPU runs in seconds (through mla_autograd's reference path).
SMALL_HEADS = dict(kv_lora_rank=32, qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32)
SMALL_MODELS = {
    "tiny": dict(config=dict(hidden_size=64, num_attention_heads=4, q_lora_rank=24, intermediate_size=96,
                             num_hidden_layers=2, vocab_size=97, max_position_embeddings=256, **SMALL_HEADS),
                 train=(2, 32), decode=((2,), 24)),
    "dsv3-layer": dict(config=dict(hidden_size=96, num_attention_heads=4, q_lora_rank=32, intermediate_size=96,
                                   num_hidden_layers=1, vocab_size=97, max_position_embeddings=163840,
                                   rope_parameters=YARN, **SMALL_HEADS),
                       train=(1, 48), decode=((1, 2), 24)),
}


def make_config(fields: dict) -> "DeepseekV3Config":
    """A DeepseekV3Config with as many kv heads as query heads and dense MLPs in every layer (the MoE fields
    only have to be valid: no expert is built)."""
    layers = fields["num_hidden_layers"]
    return DeepseekV3Config(num_key_value_heads=fields["num_attention_heads"], first_k_dense_replace=layers,
                            n_routed_experts=4, num_experts_per_tok=2, n_group=1, topk_group=1,
                            moe_intermediate_size=64, tie_word_embeddings=False, **fields)


def build_model(cfg, device: torch.device, dtype: torch.dtype, seed: int):
    """The model every implementation runs, initialised on the device itself (seeded)."""
    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa", dtype=dtype)
    return model.to(device).eval()  # already there: to() only makes sure


def timeit(fn, *, warmup: int, iters: int, device: torch.device, before=None) -> dict:
    """Median / min / max milliseconds of fn() over iters calls after warmup calls; before() runs untimed
    ahead of every call."""
    for _ in range(warmup):
        if before is not None:
            before()
        fn()
    times = []
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.synchronize(device)
    for _ in range(iters):
        if before is not None:
            before()
        if cuda:
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            torch.cuda.synchronize(device)
            times.append(a.elapsed_time(b))
        else:
            t = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t) * 1e3)
    return {"ms": statistics.median(times), "min_ms": min(times), "max_ms": max(times), "iters": iters}


def _cache_keyword(model) -> str:
    # transformers renamed past_key_values -> cache (5.2x, the old name deprecated); pick the one forward takes
    import inspect
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def _output_cache(out):
    c = getattr(out, "cache", None)
    return c if c is not None else out.past_key_values


def _free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def _max_abs_diff(x, ref) -> float:
    return (x.float() - ref.float()).abs().max().item()


def train_step(model, ids, a, device) -> dict:
    model.train()

    def zero():
        model.zero_grad(set_to_none=True)

    def step():
        model(input_ids=ids, labels=ids, use_cache=False).loss.backward()

    try:
        return timeit(step, warmup=a.warmup, iters=a.iters, device=device, before=zero)
    finally:
        zero()
        model.eval()


@torch.inference_mode()
def prefill(model, ids, a, device) -> dict:
    return timeit(lambda: model(input_ids=ids, use_cache=True, logits_to_keep=1), warmup=a.warmup,
                  iters=a.iters, device=device)


@torch.inference_mode()
def decode_step(model, prompt, token, a, device) -> tuple[dict, torch.Tensor]:
    """(timing of one greedy step after a prefill of the prompt, the first step's logits)."""
    S = prompt.shape[1]
    kw = _cache_keyword(model)
    cache = _output_cache(model(input_ids=prompt, use_cache=True, logits_to_keep=1))

    def back_to_prompt():  # the state every step starts from: the prompt's S tokens cached
        n = cache.get_seq_length()
        if n != S:
            cache.crop(S - n)

    def step():
        return model(input_ids=token, use_cache=True, **{kw: cache}).logits[:, -1].argmax(-1)

    if cache.get_seq_length() != S:
        raise RuntimeError(f"the prefill cached {cache.get_seq_length()} tokens, expected {S}")
    if device.type == "cuda":  # the row's peak memory: the steps' (weights and cache included), not the prefill's
        torch.cuda.reset_peak_memory_stats(device)
    first = model(input_ids=token, use_cache=True, **{kw: cache}).logits[:, -1]
    r = timeit(step, warmup=a.warmup, iters=a.iters, device=device, before=back_to_prompt)
    if cache.get_seq_length() != S + 1:
        raise RuntimeError(f"transformers' cache holds {cache.get_seq_length()} tokens after a step, expected "
                           f"{S + 1}: the steps did not use it")
    return r, first


def run_row(rows, base, device, fn):
    """Append base + fn()'s timing (or its error) + peak memory to rows; returns fn()'s extra value or None."""
    row = dict(base)
    extra = None
    _free(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    try:
        r = fn()
        if isinstance(r, tuple):
            r, extra = r
        row.update(r)
        n = base["B"] if base["measurement"] == "decode_step" else base["B"] * base["S"]
        row["tokens_per_s"] = n / (r["ms"] * 1e-3)
    except Exception as e:  # noqa: BLE001 - recorded; the other rows go on
        row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
    row["peak_mem_gb"] = torch.cuda.max_memory_allocated(device) / 1e9 if device.type == "cuda" else None
    rows.append(row)
    what = f"{base['model']:10s} {base['measurement']:11s} {base['impl']:12s} B={base['B']:<2d} S={base['S']:<5d}"
    if "error" in row:
        print(f"{what} FAILED {row['error']}")
    else:
        mem = f", peak {row['peak_mem_gb']:.1f} GB" if row["peak_mem_gb"] is not None else ""
        print(f"{what} {row['ms']:9.3f} ms (min {row['min_ms']:.3f}), {row['tokens_per_s']:,.0f} tokens/s{mem}")
    _free(device)
    return extra


def explain_backends(cfg, train, decode, device, dtype) -> dict:
    """Which mla_autograd backend serves the model's attention calls (train_step / prefill, decode_step)."""
    H, dqk, dv = cfg.num_attention_heads, cfg.qk_nope_head_dim + cfg.qk_rope_head_dim, cfg.v_head_dim
    try:
        B, S = train
        q = torch.empty(B, S, H, dqk, device=device, dtype=dtype)
        ex = mla_autograd.explain(q, q, torch.empty(B, S, H, dv, device=device, dtype=dtype), causal=True)
        bd, sd = max(decode[0]), decode[1]
        qd = torch.empty(bd, 1, H, dqk, device=device, dtype=dtype)
        kd = torch.empty(bd, sd + 1, H, dqk, device=device, dtype=dtype)
        exd = mla_autograd.explain(qd, kd, torch.empty(bd, sd + 1, H, dv, device=device, dtype=dtype), causal=True)
        return {"forward": ex.forward.backend, "backward": ex.backward.backend, "decode_step": exd.forward.backend}
    except Exception as e:  # noqa: BLE001
        return {"error": f"{type(e).__name__}: {str(e)[:300]}"}


def bench_model(name: str, spec: dict, a, device, dtype, rows: list, backends: dict) -> None:
    cfg = make_config(spec["config"])
    B, S = spec["train"]
    decode_batches, decode_len = spec["decode"]
    impls = [i for i in IMPLS if i in a.impls]
    backends[name] = explain_backends(cfg, spec["train"], spec["decode"], device, dtype)
    print(f"{name}: mla_autograd backends {backends[name]}")
    try:
        model = build_model(cfg, device, dtype, a.seed)
    except Exception as e:  # noqa: BLE001
        err = f"{type(e).__name__}: {str(e)[:300]}"
        print(f"{name}: building the model FAILED {err}")
        for m in a.measurements:
            for b in (decode_batches if m == "decode_step" else (B,)):
                for impl in impls:
                    rows.append({"model": name, "measurement": m, "impl": impl, "B": b,
                                 "S": decode_len if m == "decode_step" else S, "dtype": _dtype(dtype), "error": err})
        return
    print(f"{name}: {sum(p.numel() for p in model.parameters()) / 1e6:.0f}M parameters")
    gen = torch.Generator().manual_seed(a.seed)
    vocab = cfg.vocab_size
    ids = torch.randint(0, vocab, (B, S), generator=gen).to(device)

    # cross-check: full logits of the train batch against sdpa's
    diffs, ref = {}, None
    for impl in impls:
        try:
            model.set_attn_implementation(impl)
            with torch.inference_mode():
                logits = model(input_ids=ids, use_cache=False).logits
            if impl == "sdpa":
                ref = logits
            elif ref is not None:
                diffs[impl] = _max_abs_diff(logits, ref)
                print(f"{name}: logits of {impl} vs sdpa: max |difference| {diffs[impl]:.3e}")
            del logits
        except Exception as e:  # noqa: BLE001
            print(f"{name}: cross-check of {impl} FAILED {type(e).__name__}: {str(e)[:300]}")
        _free(device)
    ref = None

    def under(impl, f):  # the row's implementation, then its measurement (inside the row: a failure is its error)
        model.set_attn_implementation(impl)
        return f()

    def base(m, impl, b, s):
        row = {"model": name, "measurement": m, "impl": impl, "B": b, "S": s, "dtype": _dtype(dtype)}
        if impl != "sdpa":
            row["max_abs_diff_vs_sdpa"] = diffs.get(impl)
        return row

    for m in a.measurements:
        if m in ("train_step", "prefill"):
            fn = train_step if m == "train_step" else prefill
            for impl in impls:
                run_row(rows, base(m, impl, B, S), device, lambda: under(impl, lambda: fn(model, ids, a, device)))
        else:
            for b in decode_batches:
                prompt = torch.randint(0, vocab, (b, decode_len), generator=gen).to(device)
                token = torch.randint(0, vocab, (b, 1), generator=gen).to(device)
                first_ref = None
                for impl in impls:
                    row = base(m, impl, b, decode_len)
                    first = run_row(rows, row, device,
                                    lambda: under(impl, lambda: decode_step(model, prompt, token, a, device)))
                    if impl == "sdpa":
                        first_ref = first
                    elif first is not None and first_ref is not None:
                        rows[-1]["max_abs_diff_vs_sdpa"] = _max_abs_diff(first, first_ref)
                    else:
                        rows[-1]["max_abs_diff_vs_sdpa"] = None
                    del first
                del first_ref
    model = None
    _free(device)


def add_speedups(rows: list) -> None:
    """speedup_vs_sdpa on our rows: sdpa's median ms over ours, same model, measurement, B and S."""
    sdpa = {(r["model"], r["measurement"], r["B"], r["S"]): r.get("ms") for r in rows if r["impl"] == "sdpa"}
    for r in rows:
        if r["impl"] == OURS:
            other = sdpa.get((r["model"], r["measurement"], r["B"], r["S"]))
            r["speedup_vs_sdpa"] = other / r["ms"] if other and r.get("ms") else None


def _dtype(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def _names(text: str, allowed, what: str) -> list[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    bad = [n for n in names if n not in allowed]
    if bad or not names:
        raise SystemExit(f"--{what}: unknown {bad or text!r}; choose from {', '.join(allowed)}")
    return names


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default=None)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    ap.add_argument("--small", action="store_true", help="small models and sizes for a CPU smoke test")
    ap.add_argument("--models", default=",".join(MODELS), help=f"comma-separated, of {', '.join(MODELS)}")
    ap.add_argument("--measurements", default=",".join(MEASUREMENTS),
                    help=f"comma-separated, of {', '.join(MEASUREMENTS)}")
    ap.add_argument("--impls", default=",".join(IMPLS), help=f"comma-separated, of {', '.join(IMPLS)}")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None, help="write this run alone to this JSON file (and its .png), not to the store")
    ap.add_argument("--results", default=None, help="the results store's folder (default bench/results)")
    ap.add_argument("--replot", nargs="?", const="", default=None, metavar="FILE",
                    help="only redraw the PNG of the latest run in a results file (default the transformers store)")
    a = ap.parse_args(argv)
    if a.replot is not None:
        src = Path(a.replot) if a.replot else store_path(BENCH, a.results)
        st = load(src)
        _plot(latest_rows(st), src.with_suffix(".png"), _title(st["runs"][-1]))
        return 0
    a.models = _names(a.models, MODELS, "models")
    a.measurements = _names(a.measurements, MEASUREMENTS, "measurements")
    a.impls = _names(a.impls, IMPLS, "impls")

    device = torch.device(a.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type != "cuda" and not a.small:
        print("no CUDA device: run with --device cpu --small for a smoke test; nothing to measure")
        return 0
    if transformers is None:
        print(f"transformers not available ({_HF_ERR}): nothing to measure")
        return 0
    if a.small:
        a.warmup, a.iters = 1, 2
    models = SMALL_MODELS if a.small else MODELS
    dtype = getattr(torch, a.dtype)
    if device.type == "cpu":
        dtype = torch.float32
    if device.type == "cuda":
        # a call no kernel serves fails its row rather than timing the fallback path
        os.environ.setdefault("MLA_AUTOGRAD_STRICT", "1")
        if device.index is not None:
            torch.cuda.set_device(device)
    else:
        warnings.filterwarnings("ignore", message=r"mla_autograd: .* reference path")  # backends are printed
    name = register()
    assert name == OURS, name

    out = stamp()  # at the start: the run's date is when it began
    rows, backends = [], {}
    threads = torch.get_num_threads()
    if device.type == "cpu":
        torch.set_num_threads(1)  # the small models' matrices: more threads only add overhead (and stalls)
    try:
        for m in a.models:
            bench_model(m, models[m], a, device, dtype, rows, backends)
    finally:
        torch.set_num_threads(threads)
    add_speedups(rows)
    for r in rows:
        if r.get("speedup_vs_sdpa"):
            print(f"{r['model']} {r['measurement']} B={r['B']} S={r['S']}: mla_autograd {r['speedup_vs_sdpa']:.2f}x "
                  f"sdpa")
    out.update({
        "bench": "bench_transformers",
        "transformers": transformers.__version__,
        "dtype": _dtype(dtype),
        "config": {"models": {m: models[m] for m in a.models}, "measurements": a.measurements, "impls": a.impls,
                   "warmup": a.warmup, "iters": a.iters, "seed": a.seed},
        "backends": backends,
    })
    if device.type != "cuda":
        out["gpu"] = "cpu"
        if a.out is None:  # a CPU smoke run: its numbers mean nothing beside the GPU runs of the store
            print("not written (a CPU run goes to a file only with --out)")
            return 0
    path = record(BENCH, out, rows, out=a.out, results=a.results)
    _plot(rows, path.with_suffix(".png"), _title(out))
    print(f"wrote {path}")
    return 0


def _title(run: dict) -> str:
    return f"transformers {run.get('transformers')}, {run['gpu']}, torch {run['torch']}, commit {run['commit']}"


def _plot(rows: list, path, title: str) -> None:
    """Median ms per implementation, one panel per model and measurement, a group of bars per batch size;
    our bars carry their speedup over sdpa."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib missing: no plot")
        return
    panels = []
    for model in dict.fromkeys(r["model"] for r in rows):
        for m in MEASUREMENTS:
            if any(r["model"] == model and r["measurement"] == m for r in rows):
                panels.append((model, m))
    if not panels:
        return
    cols = min(3, len(panels))
    nrows = (len(panels) + cols - 1) // cols
    fig, axes = plt.subplots(nrows, cols, figsize=(4.8 * cols, 3.8 * nrows), squeeze=False)
    colors = {"sdpa": "tab:blue", OURS: "tab:orange", "eager": "tab:gray"}
    for ax in axes.flat[len(panels):]:
        ax.axis("off")
    for ax, (model, m) in zip(axes.flat, panels):
        sel = [r for r in rows if r["model"] == model and r["measurement"] == m]
        groups = list(dict.fromkeys((r["B"], r["S"]) for r in sel))
        impls = [i for i in IMPLS if any(r["impl"] == i for r in sel)]
        width = 0.8 / max(1, len(impls))
        for j, impl in enumerate(impls):
            for g, key in enumerate(groups):
                r = next((r for r in sel if r["impl"] == impl and (r["B"], r["S"]) == key), None)
                x = g + (j - (len(impls) - 1) / 2) * width
                if r is None:
                    continue
                if r.get("ms") is None:
                    ax.text(x, 0, "failed", rotation=90, ha="center", va="bottom", fontsize=6)
                    continue
                ax.bar(x, r["ms"], width, color=colors.get(impl), label=impl if g == 0 else None)
                if r.get("speedup_vs_sdpa"):
                    ax.text(x, r["ms"], f"{r['speedup_vs_sdpa']:.2f}x", ha="center", va="bottom", fontsize=6)
        ax.set_xticks(range(len(groups)))
        ax.set_xticklabels([f"B={b} S={s}" for b, s in groups], fontsize=7)
        ax.set_title(f"{model}: {m}", fontsize=9)
        ax.set_ylabel("median ms (lower is better)", fontsize=8)
        ax.margins(y=0.12)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7)
    fig.suptitle(title, fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    try:
        sys.exit(main())
    except Exception:  # noqa: BLE001
        traceback.print_exc()
        sys.exit(1)
