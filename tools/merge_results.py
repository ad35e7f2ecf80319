#!/usr/bin/env python
"""Merge benchmark result files into the results store (bench/results/<bench>.json, see bench/store.py).

    python tools/merge_results.py FILE [FILE ...]            # into bench/results/
    python tools/merge_results.py --results DIR FILE ...     # into another results folder
    python tools/merge_results.py --check FILE ...           # convert and verify only, write nothing

A FILE is either a results store (what `bench/*.py --out FILE` writes, or a store copied back from another
machine: all its runs are merged) or a per-run file in one of the older layouts, named
<bench>-<YYYY-MM-DD>-<gpu>-<commit>[-<label>].<json|csv>:

  attention[-sweep], decode[-sweep|-quick|-reps], decode-ab   {stamp..., rows: [...]}: rows as they are
  layer                                                       {stamp..., results: {"<measure>/<impl>": {...}}}:
                                                              one row per entry, measure and impl as fields
  bwd-kernel                                                  {gpu, torch, date, note, runs: [{commit, run, rows}]}:
                                                              one run per entry of runs (its 'run' text as label)
  bwd-profile                                                 {stamp..., <section>: {...}}: one row per section
  decode-stamps                                               {"B,S,H": [per call: [per CTA: stamps]]}: one row
                                                              per call (gpu, day and commit from the file name)
  attention-...-nvidia-smi.csv                                nvidia-smi samples beside that attention run: rows
                                                              of the nvidia-smi store, one per sample, as text
  decode_h200_<YYYYMMDD>.json                                 the first decode layout (its own stamp)

Converted runs keep every field of the file; 'file' (its name), 'mode' (sweep, quick, reps) and 'label' (the
name's suffix) are added to the run. Each conversion is checked by turning the run back into the file's
layout and comparing with the file; a mismatch stops before anything is written. Prints the rows (entries)
per file and the rows per store before and after.
"""
from __future__ import annotations

import argparse
import csv
import json
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import store as S  # noqa: E402

NAME = re.compile(r"^(?P<bench>[a-z][a-z-]*?)-(?P<day>\d{4}-\d{2}-\d{2})-(?P<gpu>.+?)-(?P<commit>[0-9a-f]{7,40})"
                  r"(?:-(?P<label>[^.]+))?\.(?P<ext>json|csv)$")
FIRST_DECODE = re.compile(r"^decode_(?P<gpu>[a-z0-9]+)_(?P<day>\d{8})\.json$")
# per-run file name prefix -> (store, mode)
STORE_OF = {
    "attention": ("attention", None), "attention-sweep": ("attention", "sweep"),
    "decode": ("decode", None), "decode-sweep": ("decode", "sweep"), "decode-quick": ("decode", "quick"),
    "decode-reps": ("decode", "reps"), "decode-ab": ("decode-ab", None), "layer": ("layer", None),
    "bwd-kernel": ("bwd-kernel", None), "bwd-profile": ("bwd-profile", None),
    "decode-stamps": ("decode-stamps", None),
}
ADDED = ("file", "mode", "label")  # run fields the conversion adds


def _meta(data: dict, skip=()) -> dict:
    return {k: v for k, v in data.items() if k not in skip}


def convert(path: Path) -> list[tuple[str, dict, list[dict]]]:
    """[(store name, run, rows)] of one result file (a store gives each of its runs)."""
    path = Path(path)
    if path.suffix == ".json":
        data = json.loads(path.read_text())
        if S.is_store(data):
            out = []
            for run in data["runs"]:
                k = S.run_key(run)
                out.append((data["bench"], run, [r for r in data["rows"] if S.run_key(r) == k]))
            return out
    m = NAME.match(path.name)
    if m is None:
        f = FIRST_DECODE.match(path.name)
        if f is None:
            raise ValueError(f"{path.name}: neither a results store nor a per-run file name this tool knows")
        meta = dict(_meta(data, ("rows",)), file=path.name)
        return [("decode", *S.make_run(meta, data["rows"]))]
    prefix, label = m["bench"], m["label"]
    if m["ext"] == "csv":
        if label != "nvidia-smi":
            raise ValueError(f"{path.name}: unknown csv file")
        return [("nvidia-smi", *_nvidia_smi(path, m))]
    if prefix not in STORE_OF:
        raise ValueError(f"{path.name}: unknown bench {prefix!r}")
    name, mode = STORE_OF[prefix]
    added = {"file": path.name, **({"mode": mode} if mode else {}), **({"label": label} if label else {})}
    if prefix == "layer":
        rows = [{"measure": k.split("/", 1)[0], "impl": k.split("/", 1)[1], **v} for k, v in data["results"].items()]
        return [(name, *S.make_run({**_meta(data, ("results",)), **added}, rows))]
    if prefix == "bwd-kernel":
        out = []
        for r in data["runs"]:
            meta = {**_meta(data, ("runs",)), "commit": r["commit"], **added, "label": r["run"]}
            out.append((name, *S.make_run(meta, r["rows"])))
        return out
    if prefix == "bwd-profile":
        sections = [k for k, v in data.items() if isinstance(v, dict)]
        rows = [{"section": k, **data[k]} for k in sections]
        return [(name, *S.make_run({**_meta(data, sections), **added}, rows))]
    if prefix == "decode-stamps":
        meta = {"gpu": m["gpu"].replace("-", " "), "torch": None, "commit": m["commit"], "date": m["day"], **added}
        rows = [{"case": case, "call": i, "stamps": st} for case, calls in data.items() for i, st in enumerate(calls)]
        return [(name, *S.make_run(meta, rows))]
    return [(name, *S.make_run({**_meta(data, ("rows",)), **added}, data["rows"]))]


def _nvidia_smi(path: Path, m) -> tuple[dict, list[dict]]:
    """The samples of an `nvidia-smi --query-gpu=... --format=csv -lms N` log taken beside a bench run, keyed by
    that run (its JSON beside the csv gives the key); values as nvidia-smi wrote them."""
    beside = path.with_name(path.name.replace("-nvidia-smi.csv", ".json"))
    run = json.loads(beside.read_text()) if beside.exists() else {
        "gpu": m["gpu"].replace("-", " "), "commit": m["commit"], "date": m["day"]}
    with path.open(newline="") as f:
        reader = csv.reader(f, skipinitialspace=True)
        header = next(reader)
        rows = [dict(zip(header, line)) for line in reader if line]
    meta = {k: run.get(k) for k in S.KEY}
    meta.update({"bench": m["bench"], "columns": header, "file": path.name})
    return S.make_run(meta, rows)


def _unconvert(path: Path, run: dict, rows: list[dict]):
    """The file's own layout rebuilt from one converted run (for the check)."""
    meta = {k: v for k, v in run.items() if k not in ADDED}
    own = [{k: v for k, v in r.items() if k not in S.KEY} for r in rows]
    if path.suffix == ".csv":
        return [run["columns"]] + [[r[c] for c in run["columns"]] for r in own]
    if path.name.startswith("layer-"):
        return {**meta, "results": {f"{r.pop('measure')}/{r.pop('impl')}": r for r in own}}
    if path.name.startswith("bwd-profile-"):
        return {**meta, **{r.pop("section"): r for r in own}}
    if path.name.startswith("decode-stamps-"):
        out: dict = {}
        for r in own:
            out.setdefault(r["case"], []).append(r["stamps"])
        return out
    return {**meta, "rows": own}


def check(path: Path, converted) -> None:
    """Raise if the converted runs do not give back the file's content exactly."""
    path = Path(path)
    if path.suffix == ".csv":
        with path.open(newline="") as f:
            want = [line for line in csv.reader(f, skipinitialspace=True) if line]
        (_, run, rows), = converted
        got = _unconvert(path, run, rows)
    else:
        want = json.loads(path.read_text())
        if S.is_store(want):
            return  # merged as it is
        if path.name.startswith("bwd-kernel-"):
            got = {k: v for k, v in converted[0][1].items() if k not in ADDED and k != "commit"}
            got["runs"] = [{"commit": run["commit"], "run": run["label"],
                            "rows": [{k: v for k, v in r.items() if k not in S.KEY} for r in rows]}
                           for _, run, rows in converted]
        else:
            (_, run, rows), = converted
            got = _unconvert(path, run, rows)
        if not path.name.startswith("decode-stamps-"):
            for k in S.KEY:  # make_run gives a run every key field, None where the file had none
                if k not in want and got.get(k) is None:
                    got.pop(k, None)
    if got != want:
        raise SystemExit(f"{path.name}: the conversion does not give back the file's content")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("files", nargs="+", type=Path)
    ap.add_argument("--results", type=Path, default=S.RESULTS, help="the store's folder (default bench/results)")
    ap.add_argument("--check", action="store_true", help="convert and verify only")
    a = ap.parse_args(argv)
    todo, srcs, per_file = [], [], []
    for f in a.files:
        c = convert(f)
        check(f, c)
        per_file.append((f.name, sum(len(rows) for _, _, rows in c), len(c)))
        todo += c
        srcs += [f] * len(c)
    for name, rows, runs in per_file:
        print(f"{name}: {rows} rows in {runs} run{'s' if runs != 1 else ''}")
    seen = {}
    for (n, run, rows), src in zip(todo, srcs):
        k = (n, S.run_key(run))
        if k in seen and seen[k][1:] != (run, rows):
            raise SystemExit(f"{src.name} and {seen[k][0].name} hold the same run {k[1]} with different content")
        seen[k] = (src, run, rows)
    names = sorted({n for n, _, _ in todo})
    stores = {n: S.load(S.store_path(n, a.results), n) for n in names}
    before = {n: (len(s["runs"]), len(s["rows"])) for n, s in stores.items()}
    for n, run, rows in todo:
        S.add_run(stores[n], run, rows)
    print(f"{'store':<16}{'runs before':>12}{'rows before':>12}{'runs after':>11}{'rows after':>11}")
    for n in names:
        print(f"{n:<16}{before[n][0]:>12}{before[n][1]:>12}{len(stores[n]['runs']):>11}{len(stores[n]['rows']):>11}")
        if not a.check:
            S.save(stores[n], S.store_path(n, a.results))
    if not a.check:  # read back what was written: every run merged is there with exactly its rows
        for n, run, rows in todo:
            back = S.load(S.store_path(n, a.results))
            k = S.run_key(run)
            if [r for r in back["runs"] if S.run_key(r) == k] != [run] or \
                    [r for r in back["rows"] if S.run_key(r) == k] != rows:
                raise SystemExit(f"{n}: run {k} did not read back as merged")
    print(f"total rows in: {sum(r for _, r, _ in per_file)}; {'checked, nothing written' if a.check else 'written'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
