"""Where bench_decode, bench_kernels, bench_layer and bench_transformers write their runs (CPU): the bench's
results store (an A/B decode run in a store of its own), or --out's file alone; a CPU smoke run of bench_layer
or bench_transformers only with --out. The kernels need a GPU: bench_decode's and bench_kernels' timing
functions are replaced by fakes here, and bench_layer and bench_transformers run for real at their --small
sizes on the reference path; bench_layer's CUDA-only fields (peak memory, the profiled floor) are checked on
a faked allocator and profiler."""
from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "bench"
STAMP = {"gpu": "fake", "torch": "x", "cudnn": 0, "commit": "c0ffee", "date": "2026-01-02T03:04:05Z"}


def _load(name):
    spec = importlib.util.spec_from_file_location(f"{name}_under_test", BENCH / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture()
def decode(monkeypatch):
    mod = _load("bench_decode")
    calls = []

    def fake_run_case(ext, B, S, H, page, Sq=1, dtype=None, sdpa=True, options=mod.AUTO, api=True):
        calls.append((B, S, H, dict(options)))
        mod.api_flags.append(api)
        us = 100.0 + len(calls)
        return {"B": B, "S": S, "H": H, "Sq": Sq, "page": page, "dtype": "bfloat16", "options": dict(options),
                **{f"{k}_us": us for k in ("kernel", "graph", "sched", "sched_graph", "plan_graph")},
                **{f"{k}_GBps": 1.0 for k in ("kernel", "graph", "sched", "sched_graph")},
                "kernel_TFps": 1.0, "sched_TFps": 1.0,
                **({"api_us": us * 1.02, "api_over_kernel": 1.02, "api_sched_us": us * 1.01,
                    "api_sched_over_kernel": 1.01} if api else {})}
    mod.api_flags = []
    monkeypatch.setattr(mod, "load_family", lambda name: None)
    monkeypatch.setattr(mod, "run_case", fake_run_case)
    monkeypatch.setattr(mod, "stamp", lambda: dict(STAMP))
    monkeypatch.setattr(mod.torch.cuda, "get_device_name", lambda *a: "fake")
    mod.plotted = []
    monkeypatch.setattr(mod, "plot", lambda rows, path: mod.plotted.append((len(rows), Path(path).name)))
    mod.calls = calls
    return mod


def test_decode_runs_go_to_decode_or_decode_ab(decode, tmp_path):
    decode.main(["--quick", "--results", str(tmp_path)])
    st = json.loads((tmp_path / "decode.json").read_text())
    assert len(st["runs"]) == 1 and st["runs"][0]["option_fields"] == list(decode.OPTION_FIELDS)
    assert [(r["B"], r["H"]) for r in st["rows"]] == [(128, 16), (128, 128), (4, 16)]
    assert all(r["commit"] == "c0ffee" and r["gpu"] == "fake" for r in st["rows"])
    assert decode.plotted == [(3, "decode.png")]

    decode.main(["--quick", "--ab", "groups=0,stages=3", "--rounds", "2", "--results", str(tmp_path)])
    st_ab = json.loads((tmp_path / "decode-ab.json").read_text())
    opts = {"groups": False, "stages": 3}
    # each case twice per round, the order alternating, and every row's round recorded
    assert [(r["round"], r["options"]) for r in st_ab["rows"][:2]] == [(0, {}), (0, opts)]
    assert [(r["round"], r["options"]) for r in st_ab["rows"][6:8]] == [(1, opts), (1, {})]
    assert len(st_ab["rows"]) == 12
    assert json.loads((tmp_path / "decode.json").read_text()) == st  # the plain store is left alone

    decode.main(["--quick", "--results", str(tmp_path), "--out", str(tmp_path / "one.json")])
    assert json.loads((tmp_path / "decode.json").read_text()) == st
    assert len(json.loads((tmp_path / "one.json").read_text())["rows"]) == 3

    decode.plotted.clear()
    decode.main(["--replot", "--results", str(tmp_path)])  # the latest run of the store, drawn beside it
    assert decode.plotted == [(3, "decode.png")]


def test_decode_times_the_public_call_beside_the_kernel_where_it_can(decode, tmp_path, capsys):
    """The public call takes no launch options: only automatic-launch cases time it, none of an --ab run."""
    decode.main(["--quick", "--results", str(tmp_path)])
    assert decode.api_flags == [True] * 3
    rows = json.loads((tmp_path / "decode.json").read_text())["rows"]
    assert all(r["api_over_kernel"] == 1.02 and r["api_sched_over_kernel"] == 1.01 for r in rows)
    assert "api/k" in capsys.readouterr().out
    decode.api_flags.clear()
    decode.main(["--quick", "--no-api", "--results", str(tmp_path)])
    assert decode.api_flags == [False] * 3
    decode.api_flags.clear()
    decode.main(["--sweep", "--no-sdpa", "--results", str(tmp_path)])
    assert decode.api_flags == [not opts for *_, opts in decode.calls[-len(decode.api_flags):]]
    assert decode.api_flags.count(True) == 8 and decode.api_flags.count(False) == 9
    decode.api_flags.clear()
    decode.main(["--quick", "--ab", "groups=0", "--results", str(tmp_path)])
    assert decode.api_flags == [False] * 6


def test_decode_public_call_columns_on_the_reference_path(monkeypatch):
    """time_public_call on CPU (the reference path), with a timer that calls once: the public call and its
    schedule take the case's tensors as decode's signature says, and the columns are what the docstring lists."""
    import warnings

    import torch
    mod = _load("bench_decode")
    timed = []
    monkeypatch.setattr(mod, "bench_ms", lambda fn: timed.append(fn()) or 0.5)
    monkeypatch.setattr(mod.torch.cuda, "synchronize", lambda *a: None)
    B, S, H, page = 2, 128, 16, 64
    g = torch.Generator().manual_seed(0)
    buf = torch.randn(B * S // page + 1, page, 576, generator=g)
    table = torch.randperm(buf.shape[0], generator=g)[: B * S // page].view(B, -1).to(torch.int32)
    q_nope, q_pe = torch.randn(B, 1, H, 512, generator=g), torch.randn(B, 1, H, 64, generator=g)
    seqlens = torch.tensor([S, S - 37], dtype=torch.int32)
    ckv, kpe = buf[..., :512], buf[..., 512:]
    from mla_autograd import reference
    want = reference.decode_forward(q_nope, q_pe, ckv, kpe, table, seqlens, softmax_scale=mod.SCALE, causal=False)[0]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the reference-path notice
        cols = mod.time_public_call(q_nope, q_pe, ckv, kpe, table, seqlens, False, want, 0.25, 0.4)
    assert cols["api_backend"] == "reference" and cols["api_checks_values"] is False
    assert cols["api_max_abs_diff_vs_kernel"] == 0.0
    assert (cols["api_us"], cols["api_over_kernel"]) == (500.0, 2.0)
    assert (cols["api_sched_us"], cols["api_sched_over_kernel"]) == (500.0, 1.25)
    assert len(timed) == 2 and all(torch.equal(t, want) for t in timed)  # default return_lse=False: out alone


def test_decode_ab_options_parse_and_reject(decode):
    assert decode.parse_options("warp_specialized=false,ctas_per_sm=1,pdl=1") == {
        "warp_specialized": False, "ctas_per_sm": 1, "pdl": True}
    assert decode.options_label({"groups": False, "stages": 2}) == "groups=0,stages=2"
    assert decode.options_label({}) == "auto"
    for bad, match in (("wide=1", "field=value"), ("groups", "field=value"), ("groups=2", "0/1"),
                       ("stages=x", "integer")):
        with pytest.raises(SystemExit, match=match):
            decode.parse_options(bad)
    with pytest.raises(SystemExit, match="no launch options"):
        decode.main(["--quick", "--ab", ","])
    assert decode.calls == []


def test_kernels_bench_alternates_sides_and_takes_medians():
    mod = _load("bench_kernels")
    calls = []
    samples = {"": iter([3.0, 1.0, 2.0]), "_ab": iter([5.0, 9.0, 4.0])}

    def timer(fn):
        calls.append(fn())
        return next(samples[calls[-1]])
    med = mod.alternate({"": lambda: "", "_ab": lambda: "_ab"}, 3, timer)
    assert calls == ["", "_ab"] * 3  # the sides in turn within every round
    assert med == {"": 2.0, "_ab": 5.0}
    assert mod.alternate({"": lambda: ""}, 1, lambda fn: 7.0) == {"": 7.0}


def test_kernels_bench_writes_fwd_and_bwd_stores(monkeypatch, tmp_path):
    mod = _load("bench_kernels")
    monkeypatch.setattr(mod.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(mod, "stamp", lambda: dict(STAMP))
    monkeypatch.setattr(mod, "load_family", lambda name: None)
    seen, seen_ab = [], []

    def fake_fwd(ext, B, H, S, dims, l2_group, ctas=None, dynamic=None, causal_only=False, ab=None, rounds=1):
        seen.append((B, H, S, tuple(dims), l2_group))
        seen_ab.append((ctas, dynamic, ab, rounds))
        return [{"B": B, "H": H, "S": S, "d": d, "dv": dv, "ours_ms": 1.0} for d, dv in dims]
    monkeypatch.setattr(mod, "bench_fwd", fake_fwd)
    monkeypatch.setattr(mod, "bench_bwd", lambda causal_only, det, l2_group, varlen, ab, rounds, seed, shape, dims: [
        {"causal": causal_only, "det": det, "l2_group": l2_group, "varlen": varlen, "ab": ab, "rounds": rounds,
         "seed": seed, "shape": list(shape), "dims": [list(d) for d in dims]}])
    monkeypatch.setattr(mod, "bench_fwd_varlen", lambda ext, varlen, dims, causal_only, ab, rounds, seed: [
        {"varlen": varlen, "dims": [list(d) for d in dims], "causal_only": causal_only, "ab": ab, "rounds": rounds,
         "seed": seed}])
    assert mod.main(["fwd", "--shape", "1,2,128", "--shape", "2,4,256", "--dims", "64", "--results", str(tmp_path)]) == 0
    assert seen == [(1, 2, 128, ((64, 64),), None), (2, 4, 256, ((64, 64),), None)]
    assert len(json.loads((tmp_path / "fwd-kernel.json").read_text())["rows"]) == 2
    assert mod.main(["fwd", "--dims", "192", "--l2-group", "3", "--out", str(tmp_path / "one.json")]) == 0
    assert seen[-1] == (2, 16, 8192, ((192, 128),), 3)
    assert seen_ab[-1] == (None, None, None, 3)
    # dense rows: --ab beside the launch the other options give
    assert mod.main(["fwd", "--shape", "16,16,1024", "--ctas", "7", "--ab", "ctas=1073741824,dynamic=false", "--rounds",
                     "5", "--out", str(tmp_path / "fd.json")]) == 0
    assert seen_ab[-1] == (7, None, {"ctas": 1073741824, "dynamic": False}, 5)
    assert mod.main(["bwd", "--causal-only", "--no-det", "--l2-group", "0", "--results", str(tmp_path)]) == 0
    (row,) = json.loads((tmp_path / "bwd-kernel.json").read_text())["rows"]
    assert (row["causal"], row["det"], row["l2_group"], row["commit"]) == (True, False, 0, "c0ffee")
    assert (row["varlen"], row["ab"], row["rounds"]) == (None, None, 3)
    assert (row["shape"], row["dims"]) == ([2, 16, 8192], [[192, 128], [128, 128]])
    # dense backward rows: one call per --shape, --dims narrowing the head-dim pairs
    assert mod.main(["bwd", "--shape", "16,16,1024", "--shape", "1,8,512", "--dims", "128", "--ab",
                     "dq_wg_barriers=false", "--out", str(tmp_path / "bs.json")]) == 0
    rows = json.loads((tmp_path / "bs.json").read_text())["rows"]
    assert [(r["shape"], r["dims"], r["ab"]) for r in rows] == [
        ([16, 16, 1024], [[128, 128]], {"dq_wg_barriers": False}), ([1, 8, 512], [[128, 128]], {"dq_wg_barriers": False})]
    assert mod.main(["bwd", "--varlen", "longtail", "--ab", "compact_varlen=false,l2_group=2", "--rounds", "2",
                     "--out", str(tmp_path / "ab.json")]) == 0
    (row,) = json.loads((tmp_path / "ab.json").read_text())["rows"]
    assert (row["varlen"], row["ab"], row["rounds"]) == ("longtail", {"compact_varlen": False, "l2_group": 2}, 2)
    assert row["shape"] == [2, 16, 8192]  # a packed batch: one call, whatever --shape says
    assert row["seed"] == 0
    # the forward on a packed batch: its own function, the same --ab / --rounds / --seed
    assert mod.main(["fwd", "--varlen", "longtail", "--dims", "192", "--causal-only", "--ab", "longest_first=false",
                     "--seed", "2", "--out", str(tmp_path / "fv.json")]) == 0
    (row,) = json.loads((tmp_path / "fv.json").read_text())["rows"]
    assert (row["varlen"], row["dims"], row["causal_only"], row["ab"], row["rounds"], row["seed"]) == (
        "longtail", [[192, 128]], True, {"longest_first": False}, 3, 2)
    with pytest.raises(SystemExit, match="--ab: expected key=value"):
        mod.main(["bwd", "--ab", "compact_varlen"])


def test_layer_cpu_smoke_writes_only_with_out(tmp_path):
    mod = _load("bench_layer")
    assert mod.main(["--device", "cpu", "--small", "--skip-train", "--results", str(tmp_path)]) == 0
    assert not list(tmp_path.iterdir())  # a CPU run never goes to the store
    out = tmp_path / "run.json"
    assert mod.main(["--device", "cpu", "--small", "--skip-train", "--out", str(out)]) == 0
    st = json.loads(out.read_text())
    (run,) = st["runs"]
    assert run["gpu"] == "cpu" and run["config"]["heads"] == 8 and run["backends"]["decode"] == "reference"
    rows = {(r["measure"], r["impl"]): r for r in st["rows"]}
    assert ("decode_step", "mla_autograd") in rows
    assert all(r["median_ms"] > 0 for r in rows.values() if "error" not in r)
    assert all(r["date"] == run["date"] for r in st["rows"])


def test_transformers_cpu_smoke_writes_every_row_only_with_out(tmp_path):
    pytest.importorskip("transformers", reason="transformers is a test-only dependency")
    mod = _load("bench_transformers")
    args = ["--device", "cpu", "--small", "--models", "dsv3-layer", "--measurements", "prefill"]
    assert mod.main(args + ["--results", str(tmp_path)]) == 0
    assert not list(tmp_path.iterdir())  # a CPU run never goes to the store
    out = tmp_path / "run.json"
    assert mod.main(["--device", "cpu", "--small", "--out", str(out)]) == 0
    st = json.loads(out.read_text())
    (run,) = st["runs"]
    assert run["gpu"] == "cpu" and run["bench"] == "bench_transformers" and run["dtype"] == "float32"
    assert run["backends"]["tiny"]["forward"] == "reference"
    rows = st["rows"]
    keys = {(r["model"], r["measurement"], r["impl"], r["B"]) for r in rows}
    impls = ("mla_autograd", "sdpa", "eager")
    expect = {(m, w, i, b) for m, b in (("tiny", 2), ("dsv3-layer", 1)) for w in ("train_step", "prefill")
              for i in impls}
    expect |= {("tiny", "decode_step", i, 2) for i in impls}
    expect |= {("dsv3-layer", "decode_step", i, b) for i in impls for b in (1, 2)}
    assert keys == expect and len(rows) == len(expect)
    for r in rows:
        assert "error" not in r, r
        assert r["ms"] > 0 and r["tokens_per_s"] > 0 and r["dtype"] == "float32" and r["date"] == run["date"]
        assert "peak_mem_gb" in r  # None on a CPU
        if r["impl"] != "sdpa":
            assert r["max_abs_diff_vs_sdpa"] < 1e-4  # float32: the same model under the three implementations
        if r["impl"] == "mla_autograd":
            assert r["speedup_vs_sdpa"] > 0
        else:
            assert "speedup_vs_sdpa" not in r
    tokens = {(r["measurement"], r["B"], r["S"], r["tokens_per_s"] * r["ms"] / 1e3) for r in rows}
    assert all(abs(n - (b if w == "decode_step" else b * s)) < 1e-6 for w, b, s, n in tokens)
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return
    assert out.with_suffix(".png").stat().st_size > 0


def test_transformers_bench_failed_rows_are_recorded(monkeypatch, tmp_path):
    pytest.importorskip("transformers", reason="transformers is a test-only dependency")
    mod = _load("bench_transformers")

    def no_memory(*args, **kwargs):
        raise RuntimeError("out of memory (a stand-in)")
    monkeypatch.setattr(mod, "train_step", no_memory)
    out = tmp_path / "run.json"
    assert mod.main(["--device", "cpu", "--small", "--models", "tiny", "--measurements", "train_step,prefill",
                     "--impls", "mla_autograd,sdpa", "--out", str(out)]) == 0
    rows = {(r["measurement"], r["impl"]): r for r in json.loads(out.read_text())["rows"]}
    assert set(rows) == {(w, i) for w in ("train_step", "prefill") for i in ("mla_autograd", "sdpa")}
    for i in ("mla_autograd", "sdpa"):
        assert "out of memory" in rows["train_step", i]["error"] and "ms" not in rows["train_step", i]
        assert rows["prefill", i]["ms"] > 0
    assert rows["train_step", "mla_autograd"]["speedup_vs_sdpa"] is None


def test_layer_cpu_train_rows_per_seqlen_with_compile_floor_and_memory_fields(monkeypatch, tmp_path):
    """Two lengths in one run, eager above --eager-max-seqlen left out, the --compile rows of both sides marked
    compile=True (torch.compile replaced by the function itself: inductor on a CPU is slow, and the rows' plumbing
    is what is checked), and the memory and profiler fields present but None off CUDA."""
    pytest.importorskip("transformers", reason="transformers is a test-only dependency")
    mod = _load("bench_layer")
    compiled = []
    monkeypatch.setattr(mod.torch, "compile", lambda fn, **kw: compiled.append(kw) or fn)
    out = tmp_path / "run.json"
    assert mod.main(["--device", "cpu", "--small", "--skip-decode", "--seqlen", "32", "64",
                     "--eager-max-seqlen", "32", "--compile", "--iters", "1", "--out", str(out)]) == 0
    assert compiled == [{"dynamic": False}] * 4  # ours and transformers sdpa, at each length
    st = json.loads(out.read_text())
    (run,) = st["runs"]
    assert run["config"]["seqlen"] == [32, 64] and run["config"]["eager_max_seqlen"] == 32
    rows = {(r["measure"], r["impl"], r["seqlen"]): r for r in st["rows"]}
    impls = ["mla_autograd", "mla_autograd+compile", "transformers_eager", "transformers_sdpa",
             "transformers_sdpa+compile"]
    expect = {(m, i, S) for S in (32, 64) for m in ("train_fwd", "train_fwd_bwd") for i in impls
              if not (i == "transformers_eager" and S == 64)}
    expect |= {("train_fwd_bwd_floor", i, S) for S in (32, 64) for i in impls[:2]}
    assert set(rows) == expect
    for (measure, impl, S), r in rows.items():
        assert "error" not in r, r
        assert r["compile"] == impl.endswith("+compile")
        if measure == "train_fwd_bwd_floor":
            assert all(r[k] is None for k in mod.FLOOR_FIELDS)
            assert r["step_ms"] == rows["train_fwd_bwd", impl, S]["median_ms"]
        else:
            assert r["median_ms"] > 0 and r["peak_mib"] is None and r["peak_over_start_mib"] is None
        if measure != "train_fwd_bwd_floor":
            assert r["rounds"] == 3 and len(r["median_ms_rounds"]) == 3 and r["iters"] == 1
    assert mod.main(["--replot", str(out)]) == 0
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return
    assert out.with_suffix(".png").stat().st_size > 0


def test_layer_train_rounds_alternate_the_implementations(monkeypatch, tmp_path):
    """The timed calls: per round the forwards of every implementation, then the steps, the order reversed
    from one round to the next; a row's median is the median of its rounds' medians."""
    pytest.importorskip("transformers", reason="transformers is a test-only dependency")
    mod = _load("bench_layer")
    monkeypatch.setattr(mod.torch, "compile", lambda fn, **kw: fn)
    timed, fake_ms = [], iter([5.0, 1.0, 3.0] * 100)

    def fake_timed_calls(fn, iters, device):
        timed.append((fn.__self__.name, fn.__name__))
        return [next(fake_ms)] * iters
    monkeypatch.setattr(mod, "timed_calls", fake_timed_calls)
    out = tmp_path / "run.json"
    assert mod.main(["--device", "cpu", "--small", "--skip-decode", "--seqlen", "32", "--compile", "--iters", "2",
                     "--rounds", "3", "--out", str(out)]) == 0
    impls = ["mla_autograd", "mla_autograd+compile", "transformers_eager", "transformers_sdpa",
             "transformers_sdpa+compile"]
    expect = []
    for r in range(3):
        order = impls if r % 2 == 0 else impls[::-1]
        expect += [(i, k) for k in ("fwd", "fwd_bwd") for i in order]
    assert timed == expect
    rows = {(r["measure"], r["impl"]): r for r in json.loads(out.read_text())["rows"]}
    first = rows["train_fwd", "mla_autograd"]  # timed 1st, 15th and 21st: fake times 5, 3, 3
    assert first["median_ms_rounds"] == [5.0, 3.0, 3.0] and first["median_ms"] == 3.0
    assert first["min_ms"] == 3.0 and first["max_ms"] == 5.0 and first["iters"] == 2
    with pytest.raises(SystemExit):
        mod.main(["--device", "cpu", "--small", "--rounds", "0"])
    compiled = []
    monkeypatch.setattr(mod.torch, "compile", lambda fn, **kw: compiled.append(kw) or fn)
    assert mod.main(["--device", "cpu", "--small", "--skip-decode", "--seqlen", "32", "--compile", "--iters", "1",
                     "--rounds", "1", "--compile-mode", "reduce-overhead", "--out", str(out)]) == 0
    assert compiled == [{"dynamic": False, "mode": "reduce-overhead"}] * 2  # ours and transformers sdpa
    assert json.loads(out.read_text())["runs"][0]["config"]["compile_mode"] == "reduce-overhead"


class _FakeEvent:
    def __init__(self, key, us, count=1, device=True, annotation=False):
        from torch.autograd import DeviceType
        self.key, self.device_time_total, self.count = key, us, count
        self.device_type = DeviceType.CUDA if device else DeviceType.CPU
        self.is_user_annotation = annotation


class _FakeProfile:
    """torch.profiler.profile as step_floor uses it: a context manager whose key_averages() lists these
    events (a GPU run's kinds: our attention kernels, whose names carry cutlass, cuBLAS/nvjet GEMMs, glue
    kernels, and the host ops and annotated ranges that repeat their time)."""

    EVENTS = [
        _FakeEvent("void fmha_fwd_sm90_kernel<KT<cutlass::bfloat16_t, 192, 128>>(...)", 1000.0),
        _FakeEvent("fmha_bwd_sm90_main<Tr>", 2500.0),
        _FakeEvent("fmha_bwd_sm90_preprocess", 100.0),
        _FakeEvent("nvjet_tst_256x128_64x4_1x2_h_bz_coopA_NTN", 3000.0, count=6),
        _FakeEvent("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64", 1500.0, count=3),
        _FakeEvent("void cutlass::Kernel2<cutlass_80_wmma_tensorop_bf16_s161616gemm>", 400.0),
        _FakeEvent("triton_poi_fused__to_copy_cat_mul_0", 700.0, count=4),
        _FakeEvent("Memset (Device)", 50.0),
        _FakeEvent("aten::mm", 4900.0, device=False),
        _FakeEvent("## Call CompiledFxGraph fxyz ##", 9000.0, annotation=True),
        _FakeEvent("cudaLaunchKernel", 0.0, count=20, device=False),
    ]

    def __init__(self, activities=None):
        self.activities = activities

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def key_averages(self):
        return self.EVENTS


def test_layer_floor_splits_a_profiled_step_by_kernel_kind(monkeypatch):
    """step_floor's CUDA path with the profiler and the device synchronization faked: the kinds of
    common.kernel_kind summed, host ops and annotated ranges left out, floor = GEMM + attention."""
    import torch.profiler
    mod = _load("bench_layer")
    common = _load("common")
    assert [common.kernel_kind(e.key) for e in _FakeProfile.EVENTS[:8]] == (
        ["attention"] * 3 + ["gemm"] * 3 + ["other"] * 2)
    assert [k[2] for k in common.device_kernels(_FakeProfile())] == [e.key for e in sorted(
        _FakeProfile.EVENTS[:8], key=lambda e: -e.device_time_total)]
    monkeypatch.setattr(torch.profiler, "profile", _FakeProfile)
    monkeypatch.setattr(mod.torch.cuda, "synchronize", lambda *a: None)
    calls = []
    r = mod.step_floor(lambda: calls.append(1), mod.torch.device("cuda"), step_ms=12.5)
    assert calls == [1]
    assert r["attention_ms"] == pytest.approx(3.6) and r["gemm_ms"] == pytest.approx(4.9)
    assert r["other_ms"] == pytest.approx(0.75) and r["device_ms"] == pytest.approx(9.25)
    assert r["floor_ms"] == pytest.approx(8.5) and r["step_over_floor"] == pytest.approx(12.5 / 8.5)
    assert [row[0][:14] for row in r["gemm_top"]] == ["nvjet_tst_256x", "sm90_xmma_gemm", "void cutlass::"]
    assert [row[1] for row in r["attention_top"]] == [2500.0, 1000.0, 100.0]
    assert r["other_top"] == [["triton_poi_fused__to_copy_cat_mul_0", 700.0, 4], ["Memset (Device)", 50.0, 1]]


def test_layer_floor_is_the_median_round_s():
    mod = _load("bench_layer")
    floors = [{"floor_ms": 11.0, "gemm_ms": 6.0}, {"floor_ms": 10.0, "gemm_ms": 5.5}, {"floor_ms": 12.0, "gemm_ms": 6.5}]
    assert mod.median_floor(floors) == {"floor_ms": 11.0, "gemm_ms": 6.0, "floor_ms_rounds": [11.0, 10.0, 12.0]}
    assert mod.median_floor(floors[:2])["floor_ms"] == 10.0  # an even count: the lower middle
    assert mod.median_floor(floors + [{"error": "RuntimeError: x"}]) == {"error": "RuntimeError: x"}
    assert mod.median_floor([dict.fromkeys(mod.FLOOR_FIELDS)] * 2) == dict.fromkeys(mod.FLOOR_FIELDS)  # off CUDA


def test_layer_plot_title_names_a_compile_mode_other_than_the_default():
    mod = _load("bench_layer")
    run = dict(STAMP, config={"compile": True, "compile_mode": "reduce-overhead"})
    assert mod._title(run) == "fake, torch x, commit c0ffee, torch.compile mode reduce-overhead"
    for config in ({"compile_mode": "default"}, {}, None):  # the default, and runs from before the option
        assert mod._title(dict(STAMP, config=config)) == "fake, torch x, commit c0ffee"


def test_layer_step_memory_is_the_peak_of_one_call_over_its_start(monkeypatch):
    mod = _load("bench_layer")
    mib = mod.MIB
    state = {"now": 100 * mib, "peak": 0}
    cuda = mod.torch.cuda
    monkeypatch.setattr(cuda, "synchronize", lambda *a: None)
    monkeypatch.setattr(cuda, "memory_allocated", lambda *a: state["now"])
    monkeypatch.setattr(cuda, "reset_peak_memory_stats", lambda *a: state.update(peak=state["now"]))
    monkeypatch.setattr(cuda, "max_memory_allocated", lambda *a: state["peak"])

    def step():
        state["peak"] = max(state["peak"], state["now"] + 30 * mib)

    def drop_grads():  # what the step would free at its start, freed before the window opens
        state["now"] -= 20 * mib
    r = mod.step_memory(step, mod.torch.device("cuda"), before=drop_grads)
    assert r == {"peak_mib": 110.0, "peak_over_start_mib": 30.0}
    assert mod.step_memory(step, mod.torch.device("cpu")) == {"peak_mib": None, "peak_over_start_mib": None}
