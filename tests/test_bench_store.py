"""The results store (bench/store.py) and tools/merge_results.py, on CPU: runs are added, replaced by key and
kept in date order; the file has one run or row per line and reads back as written; the older per-run layouts
convert to store runs and back without losing a field, and a conversion that would lose one is refused."""
from __future__ import annotations

import csv
import importlib.util
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
import store as S  # noqa: E402


def _merge_tool():
    spec = importlib.util.spec_from_file_location("merge_results_under_test", ROOT / "tools" / "merge_results.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _meta(date, commit="abc1234", **kw):
    return {"gpu": "G", "torch": "t", "commit": commit, "date": date, **kw}


def _add(store, meta, rows):
    return S.add_run(store, *S.make_run(meta, rows))


def test_make_run_puts_the_key_first_and_copies_rows():
    rows = [{"impl": "a", "ms": 1.0}]
    run, out = S.make_run(_meta("2026-01-01", cuda="13.0", rows=["ignored"]), rows)
    assert list(run) == ["gpu", "torch", "commit", "date", "cuda"]
    assert out == [{"gpu": "G", "torch": "t", "commit": "abc1234", "date": "2026-01-01", "impl": "a", "ms": 1.0}]
    assert list(out[0])[:4] == list(S.KEY) and rows == [{"impl": "a", "ms": 1.0}]  # the input is left alone


def test_add_run_replaces_same_key_and_keeps_the_others_in_date_order():
    st = S.empty("x")
    _add(st, _meta("2026-01-02"), [{"i": 1}, {"i": 2}])
    _add(st, _meta("2026-01-01"), [{"i": 3}])
    _add(st, _meta("2026-01-02", commit="fff0000"), [{"i": 4}])  # same date, other commit: another run
    assert [(r["date"], r["commit"]) for r in st["runs"]] == [
        ("2026-01-01", "abc1234"), ("2026-01-02", "abc1234"), ("2026-01-02", "fff0000")]
    assert [r["i"] for r in st["rows"]] == [3, 1, 2, 4]  # grouped by run, each run's own order
    _add(st, _meta("2026-01-02", note="again"), [{"i": 5}])  # the same run written again: replaced
    assert len(st["runs"]) == 3 and [r.get("note") for r in st["runs"] if r["commit"] == "abc1234"] == [None, "again"]
    assert sorted(r["i"] for r in st["rows"]) == [3, 4, 5]
    with pytest.raises(ValueError, match="key"):
        S.add_run(st, S.make_run(_meta("2026-01-05"), [])[0], [{"gpu": "G", "i": 6}])


def test_file_has_one_entry_per_line_and_reads_back(tmp_path):
    st = S.empty("x")
    _add(st, _meta("2026-01-01", note="a, b"), [{"i": 1, "v": [1, 2]}, {"i": 2, "s": "x\ny"}])
    _add(st, _meta("2026-01-03"), [{"i": 3}])
    text = S.dumps(st)
    assert json.loads(text) == st
    lines = text.splitlines()
    assert sum(1 for ln in lines if ln.startswith('  {"gpu"')) == 2 + 3  # 2 runs, 3 rows
    path = S.save(st, tmp_path / "sub" / "x.json")
    assert S.load(path) == st and not list(path.parent.glob("*.tmp"))
    assert S.load(tmp_path / "missing.json") == S.empty("missing")
    (tmp_path / "other.json").write_text('{"rows": []}')
    with pytest.raises(ValueError, match="not a results store"):
        S.load(tmp_path / "other.json")


def test_record_to_store_or_out_and_merge_is_idempotent(tmp_path):
    p1 = S.record("b", _meta("2026-01-01"), [{"i": 1}], results=tmp_path)
    p2 = S.record("b", _meta("2026-01-02"), [{"i": 2}], results=tmp_path)
    assert p1 == p2 == tmp_path / "b.json"
    single = S.record("b", _meta("2026-01-03"), [{"i": 3}, {"i": 4}], out=tmp_path / "run.json", results=tmp_path)
    assert len(S.load(p1)["runs"]) == 2
    st = S.merge(S.load(p1), S.load(single))
    assert [r["i"] for r in st["rows"]] == [1, 2, 3, 4]
    assert S.merge(json.loads(json.dumps(st)), S.load(single)) == st  # merging again changes nothing
    assert [r["i"] for r in S.latest_rows(st)] == [3, 4] and S.latest_rows(S.empty("b")) == []


def _write(path: Path, data) -> Path:
    path.write_text(json.dumps(data, indent=1))
    return path


def test_merge_results_converts_each_older_layout(tmp_path):
    tool = _merge_tool()
    src = tmp_path / "src"
    src.mkdir()
    stamp = {"date": "2026-11-30T01:02:03Z", "gpu": "NVIDIA H200", "torch": "2.11", "commit": "1234abc"}
    att = _write(src / "attention-2026-11-30-NVIDIA-H200-1234abc-run2.json",
                 {**stamp, "rounds": 3, "rows": [{"impl": "a", "S": 8, "fwd_ms": 1.5}, {"impl": "b", "S": 8}]})
    sweep = _write(src / "attention-sweep-2026-11-30-NVIDIA-H200-1234abc.json",
                   {**stamp, "date": "2026-11-30T02:00:00Z", "rows": [{"impl": "a", "S": 16}]})
    layer = _write(src / "layer-2026-11-30-NVIDIA-H200-1234abc.json",
                   {**stamp, "config": {"heads": 8}, "results": {"train_fwd/ours": {"median_ms": 2.0},
                                                                 "decode_step/hf_sdpa": {"error": "OOM"}}})
    bwd = _write(src / "bwd-kernel-2026-11-30-NVIDIA-H200-9999999.json",
                 {"gpu": "NVIDIA H200", "torch": "2.11", "date": "2026-11-30", "note": "n",
                  "runs": [{"commit": "1111111", "run": "first", "rows": [{"d": 1}]},
                           {"commit": "2222222", "run": "second", "rows": [{"d": 2}, {"d": 3}]}]})
    prof = _write(src / "bwd-profile-2026-12-01-NVIDIA-H200-1234abc.json",
                  {**stamp, "what": "w", "ncu": {"ms": 3.0}, "ablation": {"V0": [1, 2]}})
    stamps = _write(src / "decode-stamps-2026-12-01-NVIDIA-H200-1234abc.json", {"4,64,16": [[[1, 2]], [[3, 4]]]})
    first = _write(src / "decode_h200_20261129.json", {**stamp, "commit": "a working tree", "rows": [{"B": 1}]})
    smi = src / "attention-2026-11-30-NVIDIA-H200-1234abc-nvidia-smi.csv"
    smi.write_text("timestamp, power.draw [W]\n2026/11/30 16:10:41.480, 89.09 W\n2026/11/30 16:10:41.737, 79.5 W\n")
    beside = _write(src / "attention-2026-11-30-NVIDIA-H200-1234abc.json", {**stamp, "date": "2026-11-30T00:00:00Z",
                                                                             "rows": []})
    files = [att, sweep, layer, bwd, prof, stamps, first, smi, beside]
    assert tool.main([*map(str, files), "--results", str(tmp_path / "out")]) == 0

    def st(name):
        return S.load(tmp_path / "out" / f"{name}.json")
    a = st("attention")
    assert [(r["file"], r.get("mode"), r.get("label")) for r in a["runs"]] == [
        (beside.name, None, None), (att.name, None, "run2"), (sweep.name, "sweep", None)]
    assert a["runs"][1]["rounds"] == 3 and [r["S"] for r in a["rows"]] == [8, 8, 16]
    assert a["rows"][0] == {**stamp, "impl": "a", "S": 8, "fwd_ms": 1.5}
    assert [(r["measure"], r["impl"]) for r in st("layer")["rows"]] == [("train_fwd", "ours"), ("decode_step", "hf_sdpa")]
    b = st("bwd-kernel")
    assert [(r["commit"], r["label"], r["note"]) for r in b["runs"]] == [("1111111", "first", "n"), ("2222222", "second", "n")]
    assert [(r["commit"], r["d"]) for r in b["rows"]] == [("1111111", 1), ("2222222", 2), ("2222222", 3)]
    assert st("bwd-profile")["rows"][1] == {**stamp, "section": "ablation", "V0": [1, 2]}
    ds = st("decode-stamps")
    assert ds["runs"][0]["gpu"] == "NVIDIA H200" and [r["stamps"] for r in ds["rows"]] == [[[1, 2]], [[3, 4]]]
    assert st("decode")["runs"][0]["commit"] == "a working tree"
    n = st("nvidia-smi")
    assert n["runs"][0]["date"] == "2026-11-30T00:00:00Z" and n["runs"][0]["bench"] == "attention"  # its run's key
    assert [r["power.draw [W]"] for r in n["rows"]] == ["89.09 W", "79.5 W"]
    with smi.open() as f:
        assert len(list(csv.reader(f))) == 1 + len(n["rows"])

    # a store (what --out writes) merges as it is; merging everything again changes no store
    texts = {p.name: p.read_text() for p in (tmp_path / "out").iterdir()}
    single = S.record("attention", {**stamp, "date": "2026-12-02T00:00:00Z"}, [{"impl": "c"}], out=src / "r.json")
    assert tool.main([*map(str, files), "--results", str(tmp_path / "out")]) == 0
    assert {p.name: p.read_text() for p in (tmp_path / "out").iterdir()} == texts
    assert tool.main([str(single), "--results", str(tmp_path / "out")]) == 0
    assert [r["impl"] for r in S.latest_rows(st("attention"))] == ["c"]


def test_merge_results_refuses_a_lossy_conversion(tmp_path):
    tool = _merge_tool()
    stamp = {"date": "2026-11-30T01:02:03Z", "gpu": "NVIDIA H200", "torch": "2.11", "commit": "1234abc"}
    # a row with its own 'commit' field: the store's rows carry the run's commit there, so it would be lost
    bad = _write(tmp_path / "decode-2026-11-30-NVIDIA-H200-1234abc.json", {**stamp, "rows": [{"B": 1, "commit": "x"}]})
    with pytest.raises(SystemExit, match="does not give back"):
        tool.main([str(bad), "--results", str(tmp_path / "out")])
    assert not (tmp_path / "out").exists()
    # two files of one run key (a relabelled copy): which one is right is not for the tool to guess
    a = _write(tmp_path / "decode-2026-11-30-NVIDIA-H200-1234abc.json", {**stamp, "rows": [{"B": 1}]})
    b = _write(tmp_path / "decode-2026-11-30-NVIDIA-H200-1234abc-x.json", {**stamp, "rows": [{"B": 2}]})
    with pytest.raises(SystemExit, match="same run"):
        tool.main([str(a), str(b), "--results", str(tmp_path / "out")])
    assert not (tmp_path / "out").exists()
    with pytest.raises(ValueError, match="unknown bench"):
        tool.convert(_write(tmp_path / "nosuch-2026-11-30-NVIDIA-H200-1234abc.json", {**stamp, "rows": []}))
