"""Where a kernel's warps wait, from Nsight Compute's source page: the SASS lines with the most stall samples
(and their main stall reasons), and the samples summed over the stretches between synchronisation points
(barriers, mbarrier waits, wgmma waits, exits), so that a warp role's time splits into its phases.

    ncu --kernel-name regex:mla_decode_sm90 --launch-skip 2 --launch-count 1 --set full --import-source yes \\
        -o rep python3 tools/ncu_decode.py 128 4096 128
    ncu --import rep.ncu-rep --page source --csv --print-source sass > sass.csv
    python tools/ncu_source_summary.py sass.csv [--top 20] [--min-share 0.5]

Shares are of all samples of the kernel (every warp is sampled alike, so a stretch's share is the share of
warp-time spent there, summed over the warps that run it). A stretch ends just after the sync instruction that
closes it, so a wait's samples count toward the stretch it ends.
"""
from __future__ import annotations

import argparse
import csv
import re
import sys

SAMPLES = "Warp Stall Sampling (All Samples)"
EXECUTED = "Instructions Executed"
# Instructions that end a stretch: where a warp waits for others or for asynchronous work, or leaves.
SYNC = re.compile(r"\b(BAR\.(SYNC|ARV|RED)|SYNCS\.(PHASECHK|ARRIVE)|WARPGROUP\.DEPBAR|DEPBAR|EXIT)\b")


def _int(text: str) -> int:
    try:
        return int(text.replace(",", ""))
    except ValueError:
        return 0


def read(path: str) -> tuple[str, list[dict]]:
    """(kernel name, rows) of an `ncu --page source --csv --print-source sass` file: one row per SASS line with
    its text, samples, executions and per-reason samples."""
    with open(path, newline="") as f:
        rows = list(csv.reader(f))
    kernel = rows[0][1] if rows and len(rows[0]) > 1 else ""  # first row: "Kernel Name", the name
    header = rows[1]
    col = {name: i for i, name in enumerate(header)}
    reasons = [h for h in header if h.startswith("stall_") and "Not Issued" not in h]
    out = []
    for n, r in enumerate(rows[2:]):
        if len(r) < len(header):
            continue
        out.append({"line": n, "source": r[col["Source"]].strip(), "samples": _int(r[col[SAMPLES]]),
                    "executed": _int(r[col[EXECUTED]]) if EXECUTED in col else 0,
                    "reasons": {h[len("stall_"):]: _int(r[col[h]]) for h in reasons}})
    return kernel, out


def top_lines(rows: list[dict], n: int) -> list[dict]:
    return sorted(sorted(rows, key=lambda r: -r["samples"])[:n], key=lambda r: r["line"])


def stretches(rows: list[dict]) -> list[dict]:
    """Consecutive SASS lines up to each sync instruction and the one after it (a warp held at a barrier is
    sampled at the instruction it waits to issue next, and an mbarrier wait's retry branch follows its test):
    first and last line, samples, the executions of the sync instruction, its text."""
    out, first, total, closing = [], 0, 0, None
    for r in rows:
        total += r["samples"]
        if closing is not None:
            out.append({"first": first, "last": r["line"], "samples": total, "executed": closing["executed"],
                        "source": closing["source"]})
            first, total, closing = r["line"] + 1, 0, None
        elif SYNC.search(r["source"]):
            closing = r
    if total:
        out.append({"first": first, "last": rows[-1]["line"], "samples": total, "executed": 0, "source": "(end)"})
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("csv", help="ncu --page source --csv --print-source sass output")
    ap.add_argument("--top", type=int, default=20, help="SASS lines with the most samples to list")
    ap.add_argument("--min-share", type=float, default=0.5, help="percent of all samples a stretch needs to be listed")
    args = ap.parse_args(argv)
    kernel, rows = read(args.csv)
    total = sum(r["samples"] for r in rows)
    if not total:
        print(f"{args.csv}: no stall samples (was the report taken with --set full or the source counters?)")
        return 1
    print(f"{kernel[:120]}\n{total} samples over {len(rows)} SASS lines\n")
    print(f"top {args.top} lines:   line  share  reasons                                   SASS")
    for r in top_lines(rows, args.top):
        main_reasons = sorted(r["reasons"].items(), key=lambda kv: -kv[1])[:2]
        why = ", ".join(f"{k} {100 * v / max(r['samples'], 1):.0f}%" for k, v in main_reasons if v)
        print(f"{'':18s}{r['line']:6d} {100 * r['samples'] / total:5.1f}%  {why:40s}  {r['source'][:70]}")
    print(f"\nstretches with at least {args.min_share}% of the samples (lines, share, closing instruction and how "
          "often it ran):")
    for s in stretches(rows):
        share = 100 * s["samples"] / total
        if share >= args.min_share:
            print(f"  {s['first']:6d}-{s['last']:<6d} {share:5.1f}%  x{s['executed']:<8d} {s['source'][:70]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
