"""bench/bench_attention.py on CPU: the order of the implementations alternates between rounds, and a row's time
is the median over its rounds. The timing itself needs a GPU; here bench_one and bench_varlen_one are replaced by
fakes whose times depend on the round, so a wrong merge (last round wins, mean instead of median, one round's
checks overwritten by another's) gives different numbers. The packed varlen workloads' lengths and FLOPs, their
rows (the public call over its kernels alone), the plot of dense and varlen rows, and bench_varlen_one itself
on the reference path (tiny lengths, a fake timer) are checked as they are."""
from __future__ import annotations

import importlib.util
import json
import statistics
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "bench" / "bench_attention.py"


@pytest.fixture()
def bench(monkeypatch):
    spec = importlib.util.spec_from_file_location("bench_attention_under_test", BENCH)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    monkeypatch.setattr(mod.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(mod, "stamp", lambda: {"gpu": "fake", "torch": "x", "cudnn": 0, "commit": "c0ffee",
                                                "date": "2026-01-02T03:04:05Z"})
    monkeypatch.setattr(mod, "peers", lambda names=None: {"sdpa_cudnn": None})
    monkeypatch.setattr(mod, "plot", lambda rows, path: None)
    monkeypatch.setattr(mod, "PowerSampler", FakeSampler)
    mod.varlen_calls = []

    def fake_bench_varlen_one(kind, H, dqk, dv, causal, impls, do_fwd=True, do_bwd=True):
        """The public call 1.1 x its kernels' time forward, 1.2 x backward; times grow by round."""
        call = (kind, causal, do_fwd, do_bwd)
        rnd = sum(1 for c in mod.varlen_calls if c[0] == call)  # this workload's pass in earlier rounds
        mod.varlen_calls.append((call, list(impls)))
        rows = []
        for n in impls:
            r = mod.varlen_row(n, kind, mod.varlen_lengths(kind), H, dqk, dv, causal)
            api = n == mod.OURS
            if do_fwd:
                r["fwd_ms"] = (1.0 + rnd) * (1.1 if api else 1.0)
                r["fwd_tflops"] = 10.0 / r["fwd_ms"]
            if do_bwd:
                r["bwd_ms"] = (2.0 + rnd) * (1.2 if api else 1.0)
                r["bwd_tflops"], r["fwd_bwd_ms"] = 25.0 / r["bwd_ms"], r["bwd_ms"] + 1.0
            rows.append(r)
        return rows
    monkeypatch.setattr(mod, "bench_varlen_one", fake_bench_varlen_one)
    return mod


class FakeSampler:
    """Clock 1000 + t0 MHz in any window starting at t0; no samples in a window starting at 99."""

    def window(self, t0, t1):
        return None if t0 == 99 else {"sm_mhz": 1000.0 + t0, "power_w": 600.0 + t0, "samples": 3}

    def close(self):
        pass


def test_rounds_alternate_order_and_take_the_median(bench, monkeypatch, tmp_path):
    calls = []
    # round r of a pass: ours 3 + 2r ms (r = 0, 1, 2 -> 3, 5, 7; but round 1 is slowest for cuDNN)
    ours_bwd = [3.0, 9.0, 4.0]
    cudnn_bwd = [5.0, 4.5, 6.0]

    def fake_bench_one(B, H, S, dqk, dv, causal, impls, do_fwd=True, do_bwd=True):
        names = list(impls)
        calls.append((names, do_fwd, do_bwd))
        rnd = sum(1 for n, f, b in calls if f == do_fwd and b == do_bwd) - 1
        rnd //= 4  # four workloads per pass
        rows = []
        for n in names:
            r = {"impl": n, "B": B, "H": H, "S": S, "dqk": dqk, "dv": dv, "causal": causal,
                 "max_abs_diff_vs_first": float(rnd)}
            if n == "mla_autograd":
                r["backend_fwd"] = r["backend_bwd"] = "sm90"
            if do_fwd:
                r["fwd_ms"] = 1.0 + rnd
                r["fwd_tflops"] = 100.0 / r["fwd_ms"]
            if do_bwd:
                t = (ours_bwd if n == "mla_autograd" else cudnn_bwd)[rnd]
                r["bwd_ms"], r["bwd_tflops"], r["fwd_bwd_ms"] = t, 250.0 / t, t + 1.0
                r["bwd_window"] = [99 if rnd == 1 else 10 * rnd, 10 * rnd + 1]
            if causal and n == "sdpa_cudnn" and rnd == 2 and do_bwd:
                r["error"] = "RuntimeError: round 2 failed"
            rows.append(r)
        return rows

    monkeypatch.setattr(bench, "bench_one", fake_bench_one)
    monkeypatch.setattr(sys, "argv", ["bench_attention.py", "--rounds", "3", "--no-varlen", "--results", str(tmp_path)])
    bench.main()
    assert bench.varlen_calls == []

    fwd_orders = [names for names, f, b in calls if f and not b]
    bwd_orders = [names for names, f, b in calls if b and not f]
    assert len(fwd_orders) == len(bwd_orders) == 12
    ours_first, cudnn_first = ["mla_autograd", "sdpa_cudnn"], ["sdpa_cudnn", "mla_autograd"]
    assert fwd_orders == [ours_first] * 4 + [cudnn_first] * 4 + [ours_first] * 4
    assert bwd_orders == fwd_orders

    (out,) = tmp_path.glob("*.json")  # the store, bench/store.py's layout: one run, its rows carrying its key
    assert out.name == "attention.json"
    data = json.loads(out.read_text())
    (run,) = data["runs"]
    assert run["rounds"] == 3 and (run["gpu"], run["commit"]) == ("fake", "c0ffee")
    rows = data["rows"]
    assert len(rows) == 8 and [r["impl"] for r in rows[:2]] == ours_first
    for r in rows:
        assert (r["gpu"], r["torch"], r["commit"], r["date"]) == (run["gpu"], run["torch"], run["commit"], run["date"])
        ours = r["impl"] == "mla_autograd"
        assert r["bwd_ms_rounds"] == (ours_bwd if ours else cudnn_bwd)
        assert r["bwd_ms"] == statistics.median(ours_bwd if ours else cudnn_bwd)  # 4.0 / 5.0: neither last nor mean
        assert r["bwd_tflops"] == pytest.approx(250.0 / r["bwd_ms"])
        assert r["fwd_ms_rounds"] == [1.0, 2.0, 3.0] and r["fwd_ms"] == 2.0
        assert r["fwd_tflops"] == pytest.approx(50.0)
        assert r["fwd_bwd_ms"] == statistics.median([t + 1.0 for t in (ours_bwd if ours else cudnn_bwd)])
        assert r["max_abs_diff_vs_first"] == 0.0  # the first round's check, not a later round's
        assert ("error" in r) == (r["causal"] and not ours)
        assert "bwd_window" not in r and r["bwd_windows"] == [[0, 1], [99, 11], [20, 21]]
        assert r["bwd_sm_mhz_rounds"] == [1000, None, 1020] and r["bwd_power_w_rounds"] == [600.0, None, 620.0]
        assert "fwd_sm_mhz_rounds" not in r  # the fake timed no forward windows


def test_merge_round_keeps_first_row_identity(bench):
    rows, by_key = [], {}
    base = {"impl": "a", "B": 1, "H": 1, "S": 8, "dqk": 64, "dv": 64, "causal": False}
    bench.merge_round(rows, by_key, dict(base, fwd_ms=2.0, fwd_tflops=5.0))
    bench.merge_round(rows, by_key, dict(base, bwd_ms=4.0, bwd_tflops=1.0, fwd_bwd_ms=6.0))
    bench.merge_round(rows, by_key, dict(base, fwd_ms=4.0, fwd_tflops=2.5))
    assert len(rows) == 1
    (r,) = rows
    assert r["fwd_ms_rounds"] == [2.0, 4.0] and r["fwd_ms"] == 3.0 and r["fwd_tflops"] == pytest.approx(10.0 / 3.0)
    assert r["bwd_ms"] == 4.0 and r["fwd_bwd_ms_rounds"] == [6.0]


def test_power_sampler_parses_nvidia_smi_lines(bench):
    import datetime
    from common import PowerSampler
    t, mhz, w = PowerSampler.parse("2026/11/30 16:12:24.816, 1755, 692.31\n")
    assert (mhz, w) == (1755.0, 692.31)
    assert t == datetime.datetime(2026, 11, 30, 16, 12, 24, 816000).timestamp()
    assert PowerSampler.parse("timestamp, clocks.current.sm [MHz], power.draw [W]") is None
    assert PowerSampler.parse("2026/11/30 16:12:24.816, [N/A], 692.31") is None


def test_runs_go_to_the_store_or_to_out(bench, monkeypatch, tmp_path):
    """Every run is added to the store (a rerun at a later date beside the first, the same run written again
    replaced); --out writes the run alone to its own file and leaves the store as it was."""
    def fake_bench_one(B, H, S, dqk, dv, causal, impls, do_fwd=True, do_bwd=True):
        return [{"impl": n, "B": B, "H": H, "S": S, "dqk": dqk, "dv": dv, "causal": causal,
                 **({"fwd_ms": 1.0, "fwd_tflops": 1.0} if do_fwd else {"bwd_ms": 2.0, "bwd_tflops": 1.0})}
                for n in impls]

    def run(date, *extra):
        stamp = {"gpu": "fake", "torch": "x", "cudnn": 0, "commit": "c0ffee", "date": date}
        monkeypatch.setattr(bench, "stamp", lambda: dict(stamp))
        monkeypatch.setattr(sys, "argv", ["bench_attention.py", "--rounds", "1", "--no-power", "--no-varlen", *extra])
        bench.main()

    monkeypatch.setattr(bench, "bench_one", fake_bench_one)
    store = tmp_path / "attention.json"
    run("2026-01-01T00:00:00Z", "--results", str(tmp_path))
    run("2026-01-02T00:00:00Z", "--results", str(tmp_path))
    run("2026-01-02T00:00:00Z", "--results", str(tmp_path))  # the same run again: replaced, not doubled
    data = json.loads(store.read_text())
    assert [r["date"] for r in data["runs"]] == ["2026-01-01T00:00:00Z", "2026-01-02T00:00:00Z"]
    assert len(data["rows"]) == 16
    assert [r["date"] for r in data["rows"]] == ["2026-01-01T00:00:00Z"] * 8 + ["2026-01-02T00:00:00Z"] * 8
    before = store.read_text()
    single = tmp_path / "elsewhere" / "run.json"
    run("2026-01-03T00:00:00Z", "--results", str(tmp_path), "--out", str(single))
    assert store.read_text() == before
    alone = json.loads(single.read_text())
    assert [r["date"] for r in alone["runs"]] == ["2026-01-03T00:00:00Z"] and len(alone["rows"]) == 8
    assert all(r["fwd_ms"] == 1.0 and r["bwd_ms"] == 2.0 for r in alone["rows"])


# ---- packed variable-length workloads ----

def test_varlen_lengths_are_fixed_and_sum_to_the_total(bench):
    import random
    for kind, count in (("longtail", 31), ("uniform32", 32), ("uniform1024", 1024)):
        lengths = bench.varlen_lengths(kind)
        assert isinstance(lengths, list) and all(type(n) is int and n > 0 for n in lengths)
        assert len(lengths) == count and sum(lengths) == 32768 == bench.VARLEN_TOKENS
    assert set(bench.varlen_lengths("uniform32")) == {1024} and set(bench.varlen_lengths("uniform1024")) == {32}
    tail = bench.varlen_lengths("longtail")
    random.seed(1234)  # the global generator plays no part
    assert bench.varlen_lengths("longtail") == tail == bench.varlen_lengths("longtail", seed=0)
    assert 3000 <= max(tail) <= 6000 and max(tail) == 4216 and min(tail) == 149
    assert sorted(tail)[15] == 793 and max(tail) > 4 * sorted(tail)[15]  # a long tail over the median
    other = bench.varlen_lengths("longtail", seed=1)
    assert other != tail and sorted(other) == sorted(tail)  # a seed reorders the documents, the lengths stay
    with pytest.raises(ValueError, match="longtail"):
        bench.varlen_lengths("zipf")


def test_varlen_flops_are_the_sum_of_dense_flops(bench):
    for causal in (False, True):
        for kind in bench.VARLEN_KINDS:
            lengths = bench.varlen_lengths(kind)
            per_sequence = sum(bench.flops_fwd(1, 16, n, n, 192, 128, causal) for n in lengths)
            assert bench.varlen_flops_fwd(lengths, 16, 192, 128, causal) == pytest.approx(per_sequence, rel=1e-12)
        # equal lengths: the dense count of a batch of them
        assert bench.varlen_flops_fwd([1024] * 32, 16, 192, 128, causal) == bench.flops_fwd(32, 16, 1024, 1024, 192,
                                                                                             128, causal)
    assert bench.varlen_flops_fwd([3, 5], 2, 8, 4, False) == 2.0 * 2 * (9 + 25) * 12
    assert bench.varlen_flops_fwd([3, 5], 2, 8, 4, True) == 2.0 * 2 * (9 + 25) * 12 / 2
    longtail = bench.varlen_lengths("longtail")
    # a long tail costs more than the same tokens in equal sequences
    assert bench.varlen_flops_fwd(longtail, 16, 192, 128, False) > bench.varlen_flops_fwd([1057] * 31, 16, 192, 128,
                                                                                          False)


def test_cu_seqlens_and_varlen_row(bench):
    cu = bench.cu_seqlens([3, 5, 0, 2])
    assert cu.dtype == bench.torch.int32 and cu.tolist() == [0, 3, 8, 8, 10]
    r = bench.varlen_row("mla_autograd", "longtail", bench.varlen_lengths("longtail"), 16, 192, 128, True)
    assert r == {"case": "varlen", "impl": "mla_autograd", "lengths_kind": "longtail", "B": 31, "H": 16, "S": 32768,
                 "max_seqlen": 4216, "dqk": 192, "dv": 128, "causal": True}
    assert all(f in r for f in bench.ROW_KEY)


def test_varlen_impls_are_the_public_call_its_kernels_and_varlen_peers(bench):
    assert list(bench.varlen_impls()) == ["mla_autograd", "mla_autograd_kernel"]
    assert list(bench.varlen_impls(["sdpa_cudnn", "flex_attention"])) == ["mla_autograd", "mla_autograd_kernel"]
    assert list(bench.varlen_impls(["sdpa_cudnn", "fa4"])) == ["mla_autograd", "mla_autograd_kernel", "fa4"]


def test_default_run_has_dense_then_varlen_rows_with_api_over_kernel(bench, monkeypatch, tmp_path):
    def fake_bench_one(B, H, S, dqk, dv, causal, impls, do_fwd=True, do_bwd=True):
        return [{"case": "dense", "impl": n, "B": B, "H": H, "S": S, "dqk": dqk, "dv": dv, "causal": causal,
                 **({"fwd_ms": 1.0, "fwd_tflops": 1.0} if do_fwd else {"bwd_ms": 2.0, "bwd_tflops": 1.0})}
                for n in impls]
    monkeypatch.setattr(bench, "bench_one", fake_bench_one)
    bench.main(["--rounds", "3", "--no-power", "--results", str(tmp_path)])
    rows = json.loads((tmp_path / "attention.json").read_text())["rows"]
    cases = [r["case"] for r in rows]
    assert cases == ["dense"] * 8 + ["varlen"] * 12  # 3 kinds x causal/not x (public call, kernels)
    varlen = rows[8:]
    assert [(r["lengths_kind"], r["causal"]) for r in varlen[::2]] == [
        (k, c) for k in ("longtail", "uniform32", "uniform1024") for c in (False, True)]
    for r in varlen:
        assert (r["H"], r["dqk"], r["dv"], r["S"]) == (16, 192, 128, 32768)
        assert r["max_seqlen"] == max(bench.varlen_lengths(r["lengths_kind"]))
        assert r["fwd_ms_rounds"] == pytest.approx([x * (1.1 if r["impl"] == "mla_autograd" else 1.0)
                                                    for x in (1.0, 2.0, 3.0)])
        if r["impl"] == "mla_autograd":
            # the medians' ratio: 2.2 / 2.0 forward, 3.6 / 3.0 backward, 4.6 / 4.0 both
            assert r["api_over_kernel"] == pytest.approx(1.1)
            assert r["bwd_api_over_kernel"] == pytest.approx(1.2)
            assert r["fwd_bwd_api_over_kernel"] == pytest.approx(4.6 / 4.0)
        else:
            assert r["impl"] == "mla_autograd_kernel" and "api_over_kernel" not in r
    # every varlen workload once per pass, the implementations' order alternating by round
    orders = [impls for (kind, causal, f, b), impls in bench.varlen_calls
              if (kind, causal, f) == ("uniform32", True, True)]
    assert orders == [["mla_autograd", "mla_autograd_kernel"], ["mla_autograd_kernel", "mla_autograd"],
                      ["mla_autograd", "mla_autograd_kernel"]]
    assert len(bench.varlen_calls) == 3 * 2 * 6


def test_varlen_only_quick_and_peers(bench, monkeypatch, tmp_path):
    dense_calls = []
    monkeypatch.setattr(bench, "bench_one", lambda *a, **k: dense_calls.append(a) or [])
    monkeypatch.setattr(bench, "stamp", lambda: {"gpu": "fake", "torch": "x", "cudnn": 0, "commit": "c0ffee",
                                                  "date": "2026-01-02T03:04:05Z"})
    bench.main(["--varlen", "--quick", "--rounds", "1", "--no-power", "--peers", "fa4", "--out",
                str(tmp_path / "v.json")])
    assert dense_calls == []
    rows = json.loads((tmp_path / "v.json").read_text())["rows"]
    assert {(r["lengths_kind"], r["causal"]) for r in rows} == {("longtail", False), ("longtail", True)}
    assert [r["impl"] for r in rows[:3]] == ["mla_autograd", "mla_autograd_kernel", "fa4"]
    bench.varlen_calls.clear()
    bench.main(["--quick", "--rounds", "1", "--no-power", "--no-bwd", "--out", str(tmp_path / "q.json")])
    assert len(dense_calls) == 4 and {c[0][0] for c in bench.varlen_calls} == {"longtail"}
    assert all(c[0][2:] == (True, False) for c in bench.varlen_calls)  # --no-bwd: forwards only
    with pytest.raises(SystemExit):
        bench.main(["--varlen", "--no-varlen"])
    with pytest.raises(SystemExit):
        bench.main(["--peers", "fa5"])


def test_sweep_adds_the_s_sweep_and_the_layer_shape_and_cudnn_names_sdpa_cudnn(bench, monkeypatch, tmp_path):
    dense_calls, peer_names = [], []
    monkeypatch.setattr(bench, "bench_one", lambda *a, **k: dense_calls.append(a[:6]) or [])
    monkeypatch.setattr(bench, "peers", lambda names=None: peer_names.append(names) or {"sdpa_cudnn": None})
    bench.main(["--sweep", "--no-varlen", "--no-bwd", "--rounds", "1", "--no-power", "--peers", "fa4,cudnn",
                "--out", str(tmp_path / "s.json")])
    assert peer_names == [["fa4", "sdpa_cudnn"]]
    anchors = [(2, 16, 8192, d, dv, c) for d, dv in ((192, 128), (128, 128)) for c in (False, True)]
    sweep = [(16384 // s, 16, s, 192, 128, c) for s in (1024, 2048, 4096, 16384) for c in (False, True)]
    layer = [(1, 128, 4096, 192, 128, c) for c in (False, True)]
    assert dense_calls == anchors + sweep + layer
    row = {"case": "dense", "B": 1, "H": 128, "S": 4096, "dqk": 192, "dv": 128, "causal": True}
    assert bench.workload_text(row) == "192/128 causal B1 H128 S4096"
    assert bench.workload_text(dict(row, H=16, B=4)) == "192/128 causal B4 S4096"


def test_annotate_api_over_kernel_pairs_rows_by_workload(bench):
    def row(impl, kind, causal, **times):
        return dict(bench.varlen_row(impl, kind, bench.varlen_lengths(kind), 16, 192, 128, causal), **times)
    rows = [row("mla_autograd", "longtail", False, fwd_ms=2.0, bwd_ms=6.0),
            row("mla_autograd_kernel", "longtail", False, fwd_ms=1.0, bwd_ms=4.0, fwd_bwd_ms=5.0),
            row("mla_autograd", "longtail", True, fwd_ms=3.0, error="RuntimeError: x"),
            row("mla_autograd_kernel", "uniform32", True, fwd_ms=3.0),
            row("fa4", "longtail", False, fwd_ms=1.5),
            {"case": "dense", "impl": "mla_autograd", "B": 2, "H": 16, "S": 4096, "dqk": 192, "dv": 128,
             "causal": False, "fwd_ms": 1.0}]
    bench.annotate_api_over_kernel(rows)
    assert (rows[0]["api_over_kernel"], rows[0]["bwd_api_over_kernel"]) == (2.0, 1.5)
    assert "fwd_bwd_api_over_kernel" not in rows[0]  # the public call's row has no fwd+bwd time
    assert not any("api_over_kernel" in r for r in rows[1:])  # no kernel row of the same workload, or not ours


def _real_bench():
    spec = importlib.util.spec_from_file_location("bench_attention_plotted", BENCH)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_plot_draws_dense_and_varlen_rows(tmp_path):
    pytest.importorskip("matplotlib")
    mod = _real_bench()
    dense = [{"impl": n, "B": 2, "H": 16, "S": 8192, "dqk": d, "dv": 128, "causal": c, "fwd_tflops": 500.0,
              "bwd_tflops": 400.0} for n in ("mla_autograd", "sdpa_cudnn") for d in (192, 128) for c in (False, True)]
    dense[0]["case"] = "dense"  # rows from before the varlen case have no "case"
    varlen = [mod.varlen_row(n, k, mod.varlen_lengths(k), 16, 192, 128, c) for n in ("mla_autograd", "fa4")
              for k in mod.VARLEN_KINDS for c in (False, True)]
    for i, r in enumerate(varlen):
        r.update(fwd_tflops=300.0 + i, bwd_tflops=200.0 + i)
    varlen[-1] = dict(varlen[-1], error="ModuleNotFoundError: No module named 'flash_attn'")
    del varlen[-1]["fwd_tflops"], varlen[-1]["bwd_tflops"]
    for rows, name in ((dense + varlen, "both.png"), (varlen, "varlen.png"), (dense, "dense.png")):
        mod.plot(rows, tmp_path / name)
        assert (tmp_path / name).stat().st_size > 0
    mod.plot([dict(varlen[-1])], tmp_path / "none.png")  # nothing timed: no figure, no error
    assert not (tmp_path / "none.png").exists()
    mod.print_tables(dense + varlen, {"gpu": "fake", "torch": "x", "cudnn": 0, "commit": "c0ffee"})


def test_bench_varlen_one_on_the_reference_path(monkeypatch):
    """The whole of bench_varlen_one on CPU (float32: the reference path), tiny lengths and a timer that calls once:
    the public call's argument order, the kernel-only row's refusal off the kernels, a peer's (out, lse) result."""
    mod = _real_bench()
    M = mod.M
    monkeypatch.setattr(mod, "varlen_lengths", lambda kind, seed=0: [5, 0, 9, 3])
    timed = []
    monkeypatch.setattr(mod, "median_ms", lambda f: timed.append(f()) or 2.0)

    class FakeFA4:
        @staticmethod
        def flash_attn_varlen_func(q, k, v, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None,
                                   max_seqlen_k=None, softmax_scale=None, causal=False):
            return M.attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                      softmax_scale=softmax_scale, causal=causal, return_lse=True)
    monkeypatch.setattr(mod, "_fa4", lambda: FakeFA4)
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the reference-path notice
        rows = mod.bench_varlen_one("tiny", 2, 16, 8, True, mod.varlen_impls(["fa4"]), device="cpu",
                                    dtype=mod.torch.float32)
    ours, kernel, fa4 = rows
    assert [r["impl"] for r in rows] == ["mla_autograd", "mla_autograd_kernel", "fa4"]
    flops = mod.varlen_flops_fwd([5, 0, 9, 3], 2, 16, 8, True)
    for r in (ours, fa4):
        assert (r["B"], r["S"], r["max_seqlen"], r["case"]) == (4, 17, 9, "varlen") and "error" not in r
        assert r["fwd_ms"] == r["bwd_ms"] == r["fwd_bwd_ms"] == 2.0
        assert r["fwd_tflops"] == pytest.approx(flops / 2.0 / 1e9)
        assert r["bwd_tflops"] == pytest.approx(2.5 * flops / 2.0 / 1e9)
        assert r["max_abs_diff_vs_first"] == 0.0
    assert ours["backend_fwd"] == ours["backend_bwd"] == "reference" and ours["api_checks_values"] is False
    assert kernel["error"].startswith("RuntimeError: no kernel here") and "fwd_ms" not in kernel
    assert len(timed) == 6  # fwd, bwd, fwd+bwd of the two that ran
