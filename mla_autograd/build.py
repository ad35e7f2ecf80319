"""Prebuild kernel families: ``python -m mla_autograd.build --arch sm_80 sm_90a sm_100f``.

Compiles every family that targets one of the named architectures (all of them when none is
named, or only those given with --family) and exits non-zero on the first compile error, printing
the compiler output. CI uses it to compile-check kernels that cannot run on its machine: building
needs nvcc and the CUTLASS headers, not a GPU. ``--check-images`` then lists each built module's
cubins and PTX with cuobjdump and fails unless every build target of the family is in it (the
dispatch table routes a capability to a family only where one of those targets loads).
"""
from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

from ._build import FAMILIES, _cuda_home, family_available, load_family


def find_cuobjdump() -> str | None:
    """cuobjdump from PATH, the CUDA toolkit, or the copy that Triton (a torch dependency) ships."""
    found = shutil.which("cuobjdump")
    if found:
        return found
    home = _cuda_home()
    if home and os.path.isfile(os.path.join(home, "bin", "cuobjdump")):
        return os.path.join(home, "bin", "cuobjdump")
    try:
        import triton
        cand = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
        return str(cand) if cand.is_file() else None
    except ImportError:
        return None


def module_images(path: str, cuobjdump: str) -> tuple[set[str], set[str]]:
    """({"sm_80", "sm_90a", ...} of the cubins, {"compute_90", ...} of the PTX) embedded in a module file."""
    def listing(flag: str) -> str:
        r = subprocess.run([cuobjdump, flag, path], capture_output=True, text=True)
        # cuobjdump exits non-zero when the file has no image of that kind
        return r.stdout if r.returncode == 0 else ""
    elf = {f"sm_{m}" for m in re.findall(r"\.sm_(\d+[af]?)\.cubin", listing("--list-elf"))}
    ptx = {f"compute_{m}" for m in re.findall(r"\.sm_(\d+[af]?)\.ptx", listing("--list-ptx"))}
    return elf, ptx


def missing_images(fam, path: str, cuobjdump: str) -> list[str]:
    """The family's build targets that the module file lacks. cuobjdump lists an arch-specific cubin with
    its suffix (sm_90a) and a family cubin by its number alone (sm_100f as sm_100)."""
    elf, ptx = module_images(path, cuobjdump)
    missing = []
    for t in fam.target_objects():
        name = t.name
        if t.is_ptx:
            found = name in ptx
        elif name.endswith("f"):
            found = name in elf or name[:-1] in elf
        else:
            found = name in elf
        if not found:
            missing.append(name)
    return missing


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m mla_autograd.build", description=__doc__.split("\n\n")[0])
    ap.add_argument("--arch", nargs="*", default=None,
                    help="architectures to build for (sm_80, sm_90, sm_90a, sm_100f, ...); default: all")
    ap.add_argument("--family", nargs="*", default=None, choices=sorted(FAMILIES),
                    help="only these families")
    ap.add_argument("--ptxas-verbose", action="store_true", help="print registers / spills per kernel")
    ap.add_argument("--skip-missing", action="store_true",
                    help="skip (instead of failing on) families that have no sources yet")
    ap.add_argument("--check-images", action="store_true",
                    help="after building, check with cuobjdump that each module has a cubin or PTX per target")
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
            module = load_family(fam.name, verbose=args.ptxas_verbose, ptxas_verbose=args.ptxas_verbose)
        except Exception as exc:  # the compiler's output is in the exception text
            print(f"FAIL {fam.name} ({time.time() - t0:.0f} s):\n{exc}")
            failed.append(fam.name)
            continue
        print(f"OK   {fam.name} for {' '.join(fam.targets)} ({time.time() - t0:.0f} s)")
        if args.check_images:
            tool = find_cuobjdump()
            if tool is None:
                print(f"FAIL {fam.name}: --check-images needs cuobjdump (CUDA toolkit or Triton)")
                failed.append(fam.name)
                continue
            path = getattr(module, "__file__", None)
            lacks = missing_images(fam, path, tool) if path else ["(module file not found)"]
            if lacks:
                print(f"FAIL {fam.name}: {path} has no image for {' '.join(lacks)}")
                failed.append(fam.name)
            else:
                elf, ptx = module_images(path, tool)
                print(f"     images: {' '.join(sorted(elf | ptx))}")
    if failed:
        print(f"mla_autograd.build: {len(failed)} famil{'y' if len(failed) == 1 else 'ies'} failed: {' '.join(failed)}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
