"""bench/bench_attention.py's rounds (CPU): the order of the implementations alternates between rounds, and a
row's time is the median over its rounds. The timing itself needs a GPU; here bench_one is replaced by a fake
whose times depend on the round, so a wrong merge (last round wins, mean instead of median, one round's
checks overwritten by another's) gives different numbers."""
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
    monkeypatch.setattr(sys, "argv", ["bench_attention.py", "--rounds", "3", "--results", str(tmp_path)])
    bench.main()

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
        monkeypatch.setattr(sys, "argv", ["bench_attention.py", "--rounds", "1", "--no-power", *extra])
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
