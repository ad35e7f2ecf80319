"""Prebuild kernel families: ``python -m mla_autograd.build --arch sm_80 sm_90a sm_100a``.

Compiles every family that targets one of the named architectures (all of them when none is
named, or only those given with --family) and exits non-zero on the first compile error, printing
the compiler output. CI uses it to compile-check kernels that cannot run on its machine: building
needs nvcc and the CUTLASS headers, not a GPU.
"""
from __future__ import annotations

import argparse
import sys
import time

from ._build import FAMILIES, family_available, load_family


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m mla_autograd.build", description=__doc__.split("\n\n")[0])
    ap.add_argument("--arch", nargs="*", default=None,
                    help="architectures to build for (sm_80, sm_90, sm_90a, sm_100a); default: all")
    ap.add_argument("--family", nargs="*", default=None, choices=sorted(FAMILIES),
                    help="only these families")
    ap.add_argument("--ptxas-verbose", action="store_true", help="print registers / spills per kernel")
    ap.add_argument("--skip-missing", action="store_true",
                    help="skip (instead of failing on) families that have no sources yet")
    args = ap.parse_args(argv)

    fams = [FAMILIES[n] for n in (args.family or sorted(FAMILIES))]
    if args.arch:
        fams = [f for f in fams if any(f.matches_arch(a) for a in args.arch)]
    if not fams:
        print("mla_autograd.build: no family matches the architectures named", file=sys.stderr)
        return 2
    failed = []
    for fam in fams:
        ok, why = family_available(fam.name)
        if not ok:
            if args.skip_missing and "no sources" in why:
                print(f"SKIP {fam.name}: {why}")
                continue
            print(f"FAIL {fam.name}: {why}")
            failed.append(fam.name)
            continue
        t0 = time.time()
        try:
            load_family(fam.name, verbose=args.ptxas_verbose, ptxas_verbose=args.ptxas_verbose)
        except Exception as exc:  # the compiler's output is in the exception text
            print(f"FAIL {fam.name} ({time.time() - t0:.0f} s):\n{exc}")
            failed.append(fam.name)
            continue
        print(f"OK   {fam.name} for {' '.join(fam.archs)} ({time.time() - t0:.0f} s)")
    if failed:
        print(f"mla_autograd.build: {len(failed)} famil{'y' if len(failed) == 1 else 'ies'} failed: {' '.join(failed)}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
