"""Per-CTA timelines of the warp-specialized decode kernel, from %globaltimer stamps (mla_decode_sm80_stamps.h).

Builds mla_decode_sm80 with -DMLA_DECODE_STAMPS into its own cache (the normal cache is never touched: the build
fingerprint does not see NVCC_APPEND_FLAGS), runs bench_decode's random case after a 256 MB L2 flush, and prints
for the used CTAs of each call, relative to the first CTA's entry (us: median, min, max over the CTAs of
`--runs` calls): the PDL wait, the item known, the first tile landed, the KV loop's end and the CTA's end; then
the KV loop's time per tile and the spread of the CTAs' end times. The stamp stores cost a little: do not
compare its times with bench_decode's.

    python3 tools/decode_stamps.py [--case B,S,H ...] [--runs 5] [--out stamps.json] [LaunchOptions field=value ...]

With launch options (e.g. stages=3) the calls go through decode_with_options (bench_decode.parse_options).

--out writes the raw stamps as a results file of one run (bench/store.py; one row per call: case, call, and the
stamps of every CTA); tools/merge_results.py adds it to bench/results/decode-stamps.json.
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

_default_cache = os.environ.get("MLA_AUTOGRAD_CACHE")
os.environ["NVCC_APPEND_FLAGS"] = f"{os.environ.get('NVCC_APPEND_FLAGS', '')} -DMLA_DECODE_STAMPS".strip()

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
from mla_autograd import _build  # noqa: E402

_cache = Path(_default_cache or _build.cache_root())
os.environ["MLA_AUTOGRAD_CACHE"] = str(_cache.with_name(_cache.name + "-stamps"))
from bench_decode import SCALE, make_case, parse_options  # noqa: E402
from common import stamp  # noqa: E402
from store import record  # noqa: E402

# StampSlot order (mla_decode_sm80_stamps.h)
ENTRY, WAITED, SCHEDULED, FIRST_TILE, LOOP_END, END, ID, TILES = range(8)
PHASES = [("waited", WAITED), ("scheduled", SCHEDULED), ("first tile", FIRST_TILE), ("loop end", LOOP_END), ("end", END)]


def summary(vals):
    v = sorted(vals)
    return f"{v[len(v) // 2]:7.1f} {v[0]:7.1f} {v[-1]:7.1f}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--case", action="append", help="B,S,H (default: 4,32768,16 and 128,4096,16)")
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--out", default=None, help="raw stamps as a results file (bench/store.py)")
    ap.add_argument("options", nargs="*", help="LaunchOptions field=value")
    args = ap.parse_args()
    ext = _build.load_family("mla_decode_sm80")
    options = parse_options(",".join(args.options), "launch options")
    opts = ext.LaunchOptions(**options) if options else None
    meta = stamp()
    flush = torch.empty(256 * 1024 * 1024 // 4, dtype=torch.int32, device="cuda")
    raw = {}
    for case in args.case or ["4,32768,16", "128,4096,16"]:
        B, S, H = (int(x) for x in case.split(","))
        buf, table, qn, qp, seqlens = make_case(B, S, H, 1, 64, torch.bfloat16)
        ckv, kpe = buf[..., :512], buf[..., 512:]
        out = torch.empty(B, 1, H, 512, dtype=torch.bfloat16, device="cuda")
        lse = torch.empty(B, H, 1, dtype=torch.float32, device="cuda")
        runs = []
        for r in range(args.runs + 1):  # the first call is a warm-up
            flush.zero_()
            if opts is None:
                ext.decode(qn, qp, ckv, kpe, table, seqlens, out, lse, SCALE, False)
            else:
                ext.decode_with_options(qn, qp, ckv, kpe, table, seqlens, out, lse, SCALE, False, opts)
            st = ext.read_stamps()
            if st.numel() == 0:
                sys.exit("decode_stamps: the module has no stamps (was it built without -DMLA_DECODE_STAMPS?)")
            if r > 0:
                runs.append(st.tolist())
        raw[case] = runs
        phases = {name: [] for name, _ in PHASES}
        per_tile, spread, used = [], [], 0
        for st in runs:
            rows = [s for s in st if s[TILES] > 0 and s[END] > 0]
            if not rows:
                continue
            used = len(rows)
            t0 = min(s[ENTRY] for s in st if s[ENTRY] > 0)
            for name, slot in PHASES:
                phases[name] += [(s[slot] - t0) / 1e3 for s in rows]
            per_tile += [(s[LOOP_END] - s[FIRST_TILE]) / 1e3 / s[TILES] for s in rows]
            ends = [s[END] for s in rows]
            spread.append((max(ends) - min(ends)) / 1e3)
        if not used:  # 64-row tiles (H * Sq > 32) run kernels that write no stamps
            print(f"\n== B={B} S={S} H={H}: no stamps (only the warp-specialized kernel, H <= 32, writes them)")
            continue
        print(f"\n== B={B} S={S} H={H}: {used} used CTAs per call, {len(runs)} calls after an L2 flush "
              f"(us from the first CTA's entry: median, min, max over CTAs)")
        for name, _ in PHASES:
            print(f"  {name:<11} {summary(phases[name])}")
        print(f"  KV loop, us per 32-token tile: {summary(per_tile)}")
        print(f"  end spread per call (last - first CTA end), us: {', '.join(f'{x:.1f}' for x in spread)}")
    if args.out:
        rows = [{"case": case, "call": i, "stamps": st} for case, calls in raw.items() for i, st in enumerate(calls)]
        print(f"raw stamps: {record('decode-stamps', meta, rows, out=Path(args.out))}")


if __name__ == "__main__":
    main()
