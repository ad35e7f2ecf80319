#!/usr/bin/env python
"""Benchmark mla_autograd.nn.MultiHeadLatentAttention against transformers' DeepseekV3Attention.

Measurements, median of CUDA-event timings, each with the peak memory of one more step:

1. train step: forward, and forward + backward, of one attention layer (DeepSeek-V3 dims by default: hidden
   7168, 128 heads, q_lora_rank 1536, latent 512, qk 128+64, v 128, YaRN) at batch 1 x each --seqlen
   (default 4096), causal, bf16. Ours (mla_autograd.nn.MultiHeadLatentAttention) vs transformers eager and
   sdpa, same weights. Transformers eager materializes the B x H x S x S scores (64 GiB a copy at S=16384 in
   bf16): above --eager-max-seqlen it is not run and writes no row. The implementations are timed in
   alternating rounds (--rounds, each --iters calls of every implementation in turn, the order reversed from
   one round to the next; median_ms is the median of the rounds' medians, median_ms_rounds lists them): the
   GPU's clock follows its power and temperature, and the rows compared share each round's conditions. Warmup
   and peak memory are measured before the rounds, with each layer's weights alone on the device.
2. the floor of our train step: one forward + backward under torch.profiler in each round (the round with the
   median floor is reported, floor_ms_rounds lists them all), its device time split into
   GEMMs (the projections, which any implementation of the layer pays), our attention kernels, and the rest
   (RoPE, norms, concatenations, copies). floor = GEMM + attention; step_over_floor = the step's median over
   the floor, what the glue and the gaps between kernels cost.
3. decode step: one new token per request for --decode-batch requests with --decode-len cached
   tokens each, under inference_mode. Ours: paged latent cache + weight-absorbed mla_autograd.decode;
   transformers: its latent DynamicCache (expand_kv over the whole cache every step), eager and sdpa.

Rows: measure (train_fwd, train_fwd_bwd, train_fwd_bwd_floor, decode_step), impl, seqlen (train rows),
compile, median_ms / min_ms / max_ms / iters (calls per round; the train rows add rounds and median_ms_rounds),
peak_mib (torch.cuda.max_memory_allocated over one step: weights and inputs included) and peak_over_start_mib
(less what was allocated when the step began: what the step itself needs); a floor row has gemm_ms,
attention_ms, other_ms, floor_ms, device_ms (all kernels), step_ms, step_over_floor and other_top (the largest
glue kernels: [name, us, launches] per step; gemm_top and attention_top the same for those kinds). Memory and
profiler fields are None off CUDA.

Without transformers only our rows run; a row that fails (e.g. out of memory) is recorded with its
error and the rest go on. A GPU run is added to the results store bench/results/layer.json (bench/store.py:
one row per measurement, implementation and seqlen, keyed by gpu, torch, commit and date) and
bench/results/layer.png is redrawn from it; --out FILE writes the run alone to FILE (and its .png) instead,
which a CPU smoke run needs to write anything (it never goes to the store). Results are printed as well.

    python bench/bench_layer.py                              # GPU, defaults above
    python bench/bench_layer.py --seqlen 4096 16384 --compile  # the layer's record: both lengths, eager and compiled
    python bench/bench_layer.py --device cpu --small         # smoke test on a CPU

With --compile, the train rows are repeated with the whole layer call under torch.compile (rows
`<name>+compile` with compile=True, ours and transformers sdpa): our ops are torch.library ops with fake
kernels, so the projections, RoPE, norms and concatenations around them fuse like any other PyTorch code.
Compilation happens in the warmup calls and is not timed; shapes are static (dynamic=False), so each
seqlen gets a graph of its own rather than one dynamic graph after the second length. --compile-mode passes
torch.compile's mode to both sides (the run's config records it).
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
from common import device_kernels, kernel_kind, kernel_split, stamp  # noqa: E402
from store import latest_rows, load, record, store_path  # noqa: E402

try:
    import transformers
    from transformers import DeepseekV3Config
    from transformers.cache_utils import DynamicCache
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3Attention, DeepseekV3RotaryEmbedding
except Exception as e:  # noqa: BLE001 - any import problem means "no transformers rows"
    transformers = None
    _HF_ERR = f"{type(e).__name__}: {e}"


def timed_calls(fn, iters: int, device: torch.device) -> list:
    """Milliseconds of each of iters calls of fn (CUDA events, a sync after each call; wall clock off CUDA)."""
    times = []
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    for _ in range(iters):
        if device.type == "cuda":
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
    return times


def timeit(fn, *, warmup: int, iters: int, device: torch.device) -> dict:
    """Median / min / max milliseconds of fn() over iters calls after warmup calls."""
    for _ in range(warmup):
        fn()
    times = timed_calls(fn, iters, device)
    return {"median_ms": statistics.median(times), "min_ms": min(times), "max_ms": max(times), "iters": iters}


def round_stats(rounds: list) -> dict:
    """Timing fields of a row from its rounds (a list of per-call millisecond lists): median_ms, the median of the
    rounds' medians; min_ms / max_ms over every call; median_ms_rounds; iters (calls per round); rounds."""
    medians = [statistics.median(t) for t in rounds]
    every = [x for t in rounds for x in t]
    return {"median_ms": statistics.median(medians), "min_ms": min(every), "max_ms": max(every),
            "median_ms_rounds": medians, "iters": len(rounds[0]), "rounds": len(rounds)}


MIB = 1 << 20


def step_memory(fn, device, before=None) -> dict:
    """Peak memory of one more call of fn: peak_mib, torch.cuda.max_memory_allocated over the call (the
    weights, inputs and everything else held included), and peak_over_start_mib, that less what was allocated
    when the call began. before() runs first, outside the window (e.g. dropping the last step's gradients,
    which the step would free at its start). None off CUDA, whose allocator keeps no such statistics."""
    if device.type != "cuda":
        return {"peak_mib": None, "peak_over_start_mib": None}
    if before is not None:
        before()
    torch.cuda.synchronize(device)
    start = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    fn()
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device)
    return {"peak_mib": peak / MIB, "peak_over_start_mib": (peak - start) / MIB}


FLOOR_FIELDS = ("gemm_ms", "attention_ms", "other_ms", "floor_ms", "device_ms", "step_over_floor", "other_top",
                "gemm_top", "attention_top")
OTHER_TOP = 12  # kernels of each kind listed in a floor row


def step_floor(fn, device, step_ms: float | None = None) -> dict:
    """Device time of one call of fn under torch.profiler, by kernel kind (common.kernel_kind), and the
    floor GEMM + attention: what the step would take with nothing between those kernels; step_over_floor
    from step_ms where given (the rows set it once the rounds' median is known). None off CUDA."""
    if device.type != "cuda":
        return dict.fromkeys(FLOOR_FIELDS)
    from torch.profiler import ProfilerActivity, profile
    torch.cuda.synchronize(device)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize(device)
    kernels = device_kernels(prof)
    r = kernel_split(kernels)
    # the largest kernels of each kind, by name: the glue's are where the step's time above its floor goes; the
    # GEMMs' and attention's show which kernels two floors (eager and compiled, say) differ by
    for kind in ("other", "gemm", "attention"):
        r[f"{kind}_top"] = [[name[:120], round(us, 1), round(n, 1)] for us, n, name in kernels
                            if kernel_kind(name) == kind][:OTHER_TOP]
    r["floor_ms"] = r["gemm_ms"] + r["attention_ms"]
    r["device_ms"] = sum(us for us, _, _ in kernels) / 1e3
    r["step_over_floor"] = step_ms / r["floor_ms"] if step_ms is not None and r["floor_ms"] > 0 else None
    return r


def compile_call(call, mode: str = "default"):
    """call under torch.compile as the --compile rows run it (tools/profile_ops.py --layer --compile too): static
    shapes, so each seqlen gets its own graph, as a training run at one length would have; mode: torch.compile's
    (left out for "default")."""
    if mode == "default":
        return torch.compile(call, dynamic=False)
    return torch.compile(call, dynamic=False, mode=mode)


def median_floor(floors: list) -> dict:
    """The floor of the round whose floor_ms is the median of the rounds' (an error if any round's failed), with
    floor_ms_rounds; off CUDA (no floor_ms) the first round's."""
    bad = [f for f in floors if "error" in f]
    if bad:
        return bad[0]
    if floors[0]["floor_ms"] is None:
        return floors[0]
    ranked = sorted(floors, key=lambda f: f["floor_ms"])
    return {**ranked[(len(ranked) - 1) // 2], "floor_ms_rounds": [f["floor_ms"] for f in floors]}


def failed(e: Exception) -> dict:
    return {"error": f"{type(e).__name__}: {str(e)[:300]}"}


def find(rows: list, measure: str, impl: str, seqlen=None) -> dict:
    """The row of (measure, impl, seqlen) without an error, or {}."""
    for r in rows:
        if (r["measure"], r["impl"], r.get("seqlen")) == (measure, impl, seqlen) and "error" not in r:
            return r
    return {}


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


def bench_train(a, device, dtype, rows, backends):
    torch.manual_seed(0)
    # the weights live on the host between rows, so that each layer's peak memory is measured with its own
    # weights alone on the device
    state = {k: v.detach().cpu() for k, v in make_ours(a, torch.device("cpu"), dtype).state_dict().items()}
    for S in a.seqlen:
        bench_train_at(a, S, state, device, dtype, rows, backends)


class TrainImpl:
    """One implementation of the train rows: its layer (on the host until measured), the call on it, and the
    step closures over one input x and output gradient dy."""

    def __init__(self, name, layer, call, x, dy, compiled=False):
        self.name, self.layer, self.call, self.compiled = name, layer, call, compiled
        self.xg = x.detach().requires_grad_(True)
        self.x, self.dy = x, dy
        self.error = {}  # kind ("fwd", "fwd_bwd") -> the failure that dropped it from the rounds
        self.rounds = {"fwd": [], "fwd_bwd": []}  # kind -> per-round lists of call times
        self.memory, self.floors = {}, []  # floors: one profiled step per round (ours)

    def clear(self):
        self.layer.zero_grad(set_to_none=True)
        self.xg.grad = None

    def fwd(self):
        with torch.no_grad():
            self.call(self.layer, self.x)

    def fwd_bwd(self):
        self.clear()
        self.call(self.layer, self.xg).backward(self.dy)

    def fn(self, kind):
        return self.fwd if kind == "fwd" else self.fwd_bwd

    @property
    def ours(self):
        return self.name.startswith("mla_autograd")


TRAIN_KINDS = ("fwd", "fwd_bwd")


def bench_train_at(a, S, state, device, dtype, rows, backends):
    """The train rows at one length. First each implementation alone on the device (its layer's weights the only
    ones there): warmup calls (torch.compile compiles in them) and the peak memory of one step. Then every
    implementation on the device and --rounds rounds, each timing --iters calls of every implementation in
    turn, the order reversed from one round to the next, and profiling one more step of ours for its floor: the
    GPU's clock follows its power and temperature, so the implementations compared, and each step and its
    floor, share each round's conditions."""
    B = a.batch
    torch.manual_seed(0)
    x = torch.randn(B, S, a.hidden, device=device, dtype=dtype)
    dy = torch.randn_like(x)
    fl = attn_flops(B, S, a.heads, a.nope + a.rope, a.v)
    q = torch.empty(B, S, a.heads, a.nope + a.rope, device=device, dtype=dtype)
    v = torch.empty(B, S, a.heads, a.v, device=device, dtype=dtype)
    ex = mla_autograd.explain(q, q, v, causal=True)
    del q, v
    chosen = {"forward": ex.forward.backend, "backward": ex.backward.backend}
    backends.setdefault("train", chosen)
    if chosen != backends["train"]:  # a length that dispatches elsewhere is recorded under its own key
        backends[f"train_S{S}"] = chosen
    print(f"S={S}: ours attention backend: forward {ex.forward.backend}, backward {ex.backward.backend}")

    def compiled(call):
        return compile_call(call, a.compile_mode)

    host = torch.device("cpu")
    impls, setup_rows = [], []
    ours = make_ours(a, host, dtype, state)
    impls.append(TrainImpl("mla_autograd", ours, lambda m, h: m(h), x, dy))
    if a.compile:
        impls.append(TrainImpl("mla_autograd+compile", ours, compiled(lambda m, h: m(h)), x, dy, compiled=True))
    if transformers is not None:
        for attn in ("eager", "sdpa"):
            if attn == "eager" and S > a.eager_max_seqlen:
                print(f"S={S:<6d} transformers eager skipped: above --eager-max-seqlen {a.eager_max_seqlen}")
                continue
            try:
                cfg = hf_config(a, attn)
                hf = DeepseekV3Attention(cfg, layer_idx=0).to(dtype)
                hf.load_state_dict(state, strict=True)
                rot = DeepseekV3RotaryEmbedding(cfg).to(device)
                pos = torch.arange(S, device=device)[None].expand(B, S)
                mask = None
                if attn == "eager":
                    mask = torch.full((S, S), float("-inf"), device=device, dtype=dtype).triu(1)[None, None]

                def call(m, h, rot=rot, pos=pos, mask=mask):
                    return m(h, rot(h, pos), mask)[0]

                impls.append(TrainImpl(f"transformers_{attn}", hf, call, x, dy))
                if a.compile and attn == "sdpa":
                    impls.append(TrainImpl(f"transformers_{attn}+compile", hf, compiled(call), x, dy, compiled=True))
            except Exception as e:  # noqa: BLE001
                setup_rows.append({"measure": "train", "impl": f"transformers_{attn}", "seqlen": S, **failed(e)})
                print(f"transformers {attn} setup FAILED: {e}")

    # ---- each layer alone on the device: warmup (compilation), peak memory ----
    layers = list(dict.fromkeys(im.layer for im in impls))
    for layer in layers:
        layer.to(device)
        for im in (im for im in impls if im.layer is layer):
            for kind in TRAIN_KINDS:
                fn = im.fn(kind)
                try:
                    for _ in range(a.warmup):
                        fn()
                    im.memory[kind] = step_memory(fn, device, before=im.clear)
                except Exception as e:  # noqa: BLE001
                    im.error[kind] = failed(e)
                    print(f"S={S:<6d} train_{kind}/{im.name} FAILED {im.error[kind]['error']}")
        layer.to(host)
        if device.type == "cuda":
            torch.cuda.empty_cache()

    # ---- alternating rounds, every layer on the device ----
    for layer in layers:
        layer.to(device)
    for r in range(a.rounds):
        order = impls if r % 2 == 0 else impls[::-1]
        for kind in TRAIN_KINDS:
            for im in order:
                if kind in im.error:
                    continue
                try:
                    fn = im.fn(kind)
                    fn()  # one untimed call: the last round's other implementations ran in between
                    im.rounds[kind].append(timed_calls(fn, a.iters, device))
                except Exception as e:  # noqa: BLE001
                    im.error[kind] = failed(e)
                    print(f"S={S:<6d} train_{kind}/{im.name} FAILED {im.error[kind]['error']}")
                    continue
                if kind == "fwd_bwd" and im.ours:
                    # the floor in the round's conditions too: the kernels' time follows the clock as the step's does
                    try:
                        im.clear()
                        im.floors.append(step_floor(im.fwd_bwd, device))
                    except Exception as e:  # noqa: BLE001
                        im.floors.append(failed(e))

    # ---- rows ----
    for im in impls:
        for kind in TRAIN_KINDS:
            row = {"measure": f"train_{kind}", "impl": im.name, "seqlen": S, "compile": im.compiled}
            what = f"S={S:<6d} {row['measure']}/{im.name}"
            if kind in im.error:
                row.update(im.error[kind])
                rows.append(row)
                continue
            row.update(round_stats(im.rounds[kind]))
            row["attention_tflops_fwd_equiv"] = fl / (row["median_ms"] * 1e-3) / 1e12 if kind == "fwd" else None
            row.update(im.memory[kind])
            mem = f", peak {row['peak_mib']:.0f} MiB" if row["peak_mib"] is not None else ""
            spread = ", ".join(f"{t:.3f}" for t in row["median_ms_rounds"])
            print(f"{what:44s} {row['median_ms']:9.3f} ms (rounds {spread}; min {row['min_ms']:.3f}){mem}")
            rows.append(row)
            if kind == "fwd_bwd" and im.floors:
                floor = {"measure": "train_fwd_bwd_floor", "impl": im.name, "seqlen": S, "compile": im.compiled}
                floor.update(median_floor(im.floors))
                if "error" in floor:
                    print(f"{what:44s} floor FAILED {floor['error']}")
                else:
                    floor["step_ms"] = row["median_ms"]
                    if floor["floor_ms"]:
                        floor["step_over_floor"] = row["median_ms"] / floor["floor_ms"]
                        print(f"{'':44s} floor {floor['floor_ms']:.3f} ms (GEMM {floor['gemm_ms']:.3f} + attention "
                              f"{floor['attention_ms']:.3f}; other {floor['other_ms']:.3f}), "
                              f"step/floor {floor['step_over_floor']:.2f}")
                        for kind in ("gemm", "attention", "other"):
                            for name, us, n in floor[f"{kind}_top"]:
                                print(f"{'':48s} {kind[:5]:5s} {us:8.1f} us x{n:<4g} {name[:90]}")
                rows.append(floor)
    rows.extend(setup_rows)
    for layer in layers:
        layer.to(host)
    if device.type == "cuda":
        torch.cuda.empty_cache()


@torch.inference_mode()
def bench_decode(a, device, dtype, rows, backends):
    B, L = a.decode_batch, a.decode_len
    torch.manual_seed(0)
    ours = make_ours(a, device, dtype)
    state = {k: v.detach().clone() for k, v in ours.state_dict().items()}
    x = torch.randn(B, 1, a.hidden, device=device, dtype=dtype)
    total = a.warmup + a.iters + 2  # the timed steps, the memory step, one spare
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

    def measure(name, step, check=None, note=""):
        row = {"measure": "decode_step", "impl": name, "compile": False}
        what = f"decode_step/{name}"
        try:
            row.update(timeit(step, warmup=a.warmup, iters=a.iters, device=device))
            row.update(step_memory(step, device))
            if check is not None:
                check()
            mem = f", peak {row['peak_mib']:.0f} MiB" if row["peak_mib"] is not None else ""
            print(f"{what:44s} {row['median_ms']:9.3f} ms (min {row['min_ms']:.3f}){mem}{note}")
        except Exception as e:  # noqa: BLE001
            row = {k: v for k, v in row.items() if k in ("measure", "impl", "compile")}
            row.update(failed(e))
            print(f"{what:44s} FAILED {row['error']}")
        rows.append(row)

    measure("mla_autograd", lambda: ours(x, cache=cache), note=f"  [B={B}, cache {L} tokens, page {page}]")
    ours = cache = None  # free the memory before the transformers rows
    if device.type == "cuda":
        torch.cuda.empty_cache()
    if transformers is None:
        return
    for attn in ("eager", "sdpa"):
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

            def step(hf=hf, rot=rot, hcache=hcache, kw=kw, n=n):
                pos = torch.full((B, 1), n[0], device=device, dtype=torch.long)
                hf(x, rot(x, pos), None, **{kw: hcache})
                n[0] += 1

            def check(hcache=hcache, n=n):
                grown = hcache.get_seq_length(0)
                if grown != n[0]:
                    raise RuntimeError(f"transformers' cache holds {grown} tokens after the steps, expected "
                                       f"{n[0]}: the steps did not use it")
        except Exception as e:  # noqa: BLE001
            rows.append({"measure": "decode_step", "impl": f"transformers_{attn}", "compile": False, **failed(e)})
            print(f"transformers {attn} decode setup FAILED: {e}")
            continue
        measure(f"transformers_{attn}", step, check)
        hf = hcache = step = check = None
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
    ap.add_argument("--seqlen", type=int, nargs="+", default=None, metavar="S",
                    help="train rows at each of these lengths, in one process (default 4096; 128 with --small)")
    ap.add_argument("--eager-max-seqlen", type=int, default=8192, metavar="S",
                    help="no transformers eager train rows above this length: its S x S scores do not fit")
    ap.add_argument("--decode-batch", type=int, default=16)
    ap.add_argument("--decode-len", type=int, default=4096)
    ap.add_argument("--page-size", type=int, default=64)
    ap.add_argument("--warmup", type=int, default=None, help="untimed calls first (default 3; 1 with --small)")
    ap.add_argument("--iters", type=int, default=None,
                    help="timed calls per implementation (and round) (default 10; 3 with --small)")
    ap.add_argument("--rounds", type=int, default=3,
                    help="train rows: rounds over the implementations, the order reversed each round")
    ap.add_argument("--skip-train", action="store_true")
    ap.add_argument("--skip-decode", action="store_true")
    ap.add_argument("--compile", action="store_true", help="also time the train rows of ours and transformers sdpa under torch.compile")
    ap.add_argument("--compile-mode", default="default", choices=["default", "reduce-overhead", "max-autotune",
                                                                   "max-autotune-no-cudagraphs"],
                    help="torch.compile's mode for both sides' --compile rows (reduce-overhead: CUDA graphs, so "
                         "no step waits for the host's launches)")
    ap.add_argument("--out", default=None, help="write this run alone to this JSON file (and its .png), not to the store")
    ap.add_argument("--results", default=None, help="the results store's folder (default bench/results)")
    ap.add_argument("--replot", nargs="?", const="", default=None, metavar="FILE",
                    help="only redraw the PNG of the latest run in a results file (default the layer store)")
    a = ap.parse_args(argv)
    a.warmup = (1 if a.small else 3) if a.warmup is None else a.warmup
    a.iters = (3 if a.small else 10) if a.iters is None else a.iters
    if a.rounds < 1 or a.iters < 1 or a.warmup < 0:
        ap.error("--rounds and --iters take a positive count, --warmup a count")
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
        a.hidden, a.heads, a.q_lora_rank = 256, 8, 64
        a.decode_batch, a.decode_len, a.page_size = 2, 100, 16
    a.seqlen = a.seqlen or ([128] if a.small else [4096])
    dtype = getattr(torch, a.dtype)
    if device.type == "cpu" and dtype != torch.float32:
        dtype = torch.float32
    if transformers is None:
        print(f"transformers not available ({_HF_ERR}): measuring mla_autograd only")
    import warnings
    warnings.filterwarnings("ignore", message=r"mla_autograd: .* reference path")  # backends are printed

    out = stamp()  # at the start: the run's date is when it began
    rows, backends = [], {}
    if not a.skip_train:
        bench_train(a, device, dtype, rows, backends)
    if not a.skip_decode:
        bench_decode(a, device, dtype, rows, backends)
    summary(rows, a.seqlen)
    out.update({
        "bench": "bench_layer",
        "transformers": getattr(transformers, "__version__", None),
        "dtype": str(dtype).replace("torch.", ""),
        "config": {k: getattr(a, k) for k in ("hidden", "heads", "q_lora_rank", "kv_lora_rank", "nope", "rope", "v",
                                              "batch", "seqlen", "eager_max_seqlen", "decode_batch", "decode_len",
                                              "page_size", "warmup", "iters", "rounds", "compile", "compile_mode")},
        "backends": backends,
    })
    if device.type != "cuda":
        out["gpu"] = "cpu"
        if a.out is None:  # a CPU smoke run: its numbers mean nothing beside the GPU runs of the store
            print("not written (a CPU run goes to a file only with --out)")
            return 0
    path = record("layer", out, rows, out=a.out, results=a.results)
    _plot(rows, path.with_suffix(".png"), _title(out))
    print(f"wrote {path}")
    return 0


def speedup(rows, measure, ours, other, seqlen=None):
    """other's median over ours' for one measure (None where either is missing)."""
    t, t_other = find(rows, measure, ours, seqlen).get("median_ms"), find(rows, measure, other, seqlen).get("median_ms")
    return t_other / t if t and t_other else None


def _num(x, fmt):
    return "-" if x is None else format(x, fmt)


def summary(rows: list, seqlens) -> None:
    """Per train length a table (step, floor, step/floor, peak memory, speedups over transformers sdpa,
    ours compiled against sdpa compiled), then the decode step's speedups."""
    pairs = (("mla_autograd", "transformers_sdpa"), ("mla_autograd+compile", "transformers_sdpa+compile"),
             ("mla_autograd+compile", "transformers_sdpa"), ("mla_autograd", "transformers_eager"))
    for S in seqlens:
        impls = list(dict.fromkeys(r["impl"] for r in rows if r.get("seqlen") == S and r["measure"] != "train"))
        if not impls:
            continue
        print(f"\nS={S}: ms, peak MiB of the fwd+bwd step (over its start), floor = GEMM + attention kernels")
        print(f"  {'impl':28s} {'fwd':>8s} {'fwd+bwd':>9s} {'floor':>8s} {'step/floor':>10s} {'peak MiB':>18s}")
        for impl in impls:
            f, fb = find(rows, "train_fwd", impl, S), find(rows, "train_fwd_bwd", impl, S)
            fl = find(rows, "train_fwd_bwd_floor", impl, S)
            mem = "-" if fb.get("peak_mib") is None else f"{fb['peak_mib']:.0f} ({fb['peak_over_start_mib']:.0f})"
            print(f"  {impl:28s} {_num(f.get('median_ms'), '8.3f'):>8s} {_num(fb.get('median_ms'), '9.3f'):>9s} "
                  f"{_num(fl.get('floor_ms'), '8.3f'):>8s} {_num(fl.get('step_over_floor'), '10.2f'):>10s} {mem:>18s}")
        for what in ("train_fwd", "train_fwd_bwd"):
            for ours, other in pairs:
                x = speedup(rows, what, ours, other, S)
                if x is not None:
                    print(f"S={S} {what}: speedup of {ours} over {other}: {x:.2f}x")
    for ours, other in pairs:
        x = speedup(rows, "decode_step", ours, other)
        if x is not None:
            print(f"decode_step: speedup of {ours} over {other}: {x:.2f}x")


def _title(run: dict) -> str:
    """The plot's title: GPU, torch, commit, and torch.compile's mode where the run's compiled rows used another
    than the default."""
    mode = (run.get("config") or {}).get("compile_mode", "default")
    compiled = f", torch.compile mode {mode}" if mode not in (None, "default") else ""
    return f"{run['gpu']}, torch {run['torch']}, commit {run['commit']}{compiled}"


def _plot(rows: list, path, title: str) -> None:
    """Median ms per implementation, one panel per measurement and seqlen; beside each of our fwd+bwd steps
    its floor, stacked GEMM + attention, with the step/floor ratio over the step's bar."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib missing: no plot")
        return
    panels = [(w, S) for w in ("train_fwd", "train_fwd_bwd", "decode_step")
              for S in dict.fromkeys(r.get("seqlen") for r in rows if r["measure"] == w and "median_ms" in r)]
    if not panels:
        return
    cols = min(len(panels), 3)
    nrows = math.ceil(len(panels) / cols)
    fig, axes = plt.subplots(nrows, cols, figsize=(4.8 * cols, 4 * nrows), squeeze=False)
    for ax in axes.flat[len(panels):]:
        ax.set_visible(False)
    for ax, (w, S) in zip(axes.flat, panels):
        labels, x = [], 0
        for r in rows:
            if r["measure"] != w or r.get("seqlen") != S or "median_ms" not in r:
                continue
            ax.bar(x, r["median_ms"], color="C0")
            labels.append((x, r["impl"]))
            fl = find(rows, "train_fwd_bwd_floor", r["impl"], S) if w == "train_fwd_bwd" else {}
            if fl.get("floor_ms"):
                ax.text(x, r["median_ms"], f"{fl['step_over_floor']:.2f}x floor", ha="center", va="bottom", fontsize=7)
                x += 1
                ax.bar(x, fl["gemm_ms"], color="C2", label="floor: GEMM")
                ax.bar(x, fl["attention_ms"], bottom=fl["gemm_ms"], color="C3", label="floor: attention")
                labels.append((x, "floor"))
            x += 1
        ax.set_xticks([p for p, _ in labels], [n for _, n in labels])
        ax.set_title(w if S is None else f"{w}, S={S}")
        ax.set_ylabel("median ms (lower is better)")
        ax.tick_params(axis="x", labelsize=7, rotation=15)
        handles, names = ax.get_legend_handles_labels()
        if handles:
            ax.legend(dict(zip(names, handles)).values(), dict(zip(names, handles)).keys(), fontsize=7, loc="best")
    fig.suptitle(title, fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    try:
        sys.exit(main())
    except Exception:  # noqa: BLE001
        traceback.print_exc()
        sys.exit(1)
