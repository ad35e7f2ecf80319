"""The results store: one JSON file per benchmark in bench/results/ (attention.json, decode.json, ...).

A store is a dict

    {"bench": NAME, "key": ["gpu", "torch", "commit", "date"],
     "runs": [{gpu, torch, commit, date, <run metadata: cuda, cudnn, capability, args, note, ...>}, ...],
     "rows": [{gpu, torch, commit, date, <the row's own fields>}, ...]}

A run is one invocation of a benchmark; it is identified by its key (gpu, torch, commit, date), with date the
UTC time stamp taken when the run started. Every row repeats its run's key, so rows can be filtered without
joining. Adding a run replaces the run and all rows with the same key, and keeps every other run: writing a
run again as it grows (bench_attention writes after every workload) or merging the same result file twice
changes nothing, while a rerun of the same commit is a new run (a later date) beside the earlier one, so the
spread between runs stays visible. Runs are kept sorted by date, rows in their run's order.

The file is written with one run or row per line (small diffs, readable), atomically (a temporary file, then
a rename), so a run cut short leaves either the previous store or the new one.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"
KEY = ("gpu", "torch", "commit", "date")


def store_path(bench: str, results: Path | None = None) -> Path:
    """bench/results/<bench>.json (or under `results`)."""
    return Path(results or RESULTS) / f"{bench}.json"


def empty(bench: str) -> dict:
    return {"bench": bench, "key": list(KEY), "runs": [], "rows": []}


def run_key(d: dict) -> tuple:
    """(gpu, torch, commit, date) of a run or a row; a missing field reads as None."""
    return tuple(d.get(k) for k in KEY)


def load(path: Path, bench: str | None = None) -> dict:
    """The store at path, or an empty one named `bench` (default: the file's stem) if the file does not exist."""
    path = Path(path)
    if not path.exists():
        return empty(bench or path.stem)
    data = json.loads(path.read_text())
    if not is_store(data):
        raise ValueError(f"{path} is not a results store (no 'runs'/'rows' lists)")
    return data


def is_store(data) -> bool:
    return isinstance(data, dict) and isinstance(data.get("runs"), list) and isinstance(data.get("rows"), list)


def make_run(meta: dict, rows: list[dict]) -> tuple[dict, list[dict]]:
    """(run, rows) with the key fields first in the run and in every row. meta: the run's metadata (common.stamp()
    plus anything the bench adds; a 'rows' entry in it is ignored); rows: the bench's rows (not modified)."""
    run = {k: meta.get(k) for k in KEY}
    run.update({k: v for k, v in meta.items() if k not in KEY and k != "rows"})
    key = {k: run[k] for k in KEY}
    return run, [{**key, **{k: v for k, v in r.items() if k not in KEY}} for r in rows]


def add_run(store: dict, run: dict, rows: list[dict]) -> dict:
    """Put one run (and its rows) into the store in place: an existing run with the same key is replaced with
    its rows. Every row must carry the run's key (make_run gives it). Returns the store."""
    key = run_key(run)
    bad = [r for r in rows if run_key(r) != key]
    if bad:
        raise ValueError(f"row {bad[0]} does not carry its run's key {key}")
    store["runs"] = [r for r in store["runs"] if run_key(r) != key] + [run]
    kept = [r for r in store["rows"] if run_key(r) != key]
    # runs in date order (a run without a date first), rows grouped by run in that order (a stable sort keeps
    # each run's own row order)
    store["runs"].sort(key=lambda r: str(r.get("date") or ""))
    order = {run_key(r): i for i, r in enumerate(store["runs"])}
    store["rows"] = sorted(kept + list(rows), key=lambda r: order.get(run_key(r), -1))
    return store


def merge(store: dict, other: dict) -> dict:
    """Add every run of the store `other` (with its rows) to `store`; returns store."""
    for run in other["runs"]:
        key = run_key(run)
        add_run(store, run, [r for r in other["rows"] if run_key(r) == key])
    return store


def dumps(store: dict) -> str:
    """The store as JSON text: top-level fields first, then one run per line and one row per line."""
    head = {k: v for k, v in store.items() if k not in ("runs", "rows")}
    lines = ["{"]
    for k, v in head.items():
        lines.append(f" {json.dumps(k)}: {json.dumps(v)},")
    for name in ("runs", "rows"):
        items = store[name]
        lines.append(f' "{name}": [')
        lines += [f"  {json.dumps(x)}{',' if i + 1 < len(items) else ''}" for i, x in enumerate(items)]
        lines.append(" ]," if name == "runs" else " ]")
    lines.append("}")
    return "\n".join(lines) + "\n"


def save(store: dict, path: Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(dumps(store))
    os.replace(tmp, path)
    return path


def record(bench: str, meta: dict, rows: list[dict], out: Path | None = None, results: Path | None = None) -> Path:
    """Write one run of `bench`. Without `out`: added to the bench's store (bench/results/<bench>.json, or under
    `results`). With `out`: a file holding this run alone (a store of one run; tools/merge_results.py adds it to
    the store later, e.g. after copying it back from the GPU machine). Returns the path written."""
    run, rows = make_run(meta, rows)
    if out is not None:
        return save(add_run(empty(bench), run, rows), Path(out))
    path = store_path(bench, results)
    return save(add_run(load(path, bench), run, rows), path)


def latest_rows(store: dict) -> list[dict]:
    """The rows of the store's latest run (by date), for its plot."""
    if not store["runs"]:
        return []
    key = run_key(store["runs"][-1])
    return [r for r in store["rows"] if run_key(r) == key]
