"""Prebuild kernel families: ``python -m mla_autograd.build --arch sm_80 sm_90a sm_100f``.

Compiles every family that targets one of the named architectures (all of them when none is
named, or only those given with --family) and exits non-zero on the first compile error, printing
the compiler output. CI uses it to compile-check kernels that cannot run on its machine: building
needs nvcc and the CUTLASS headers, not a GPU. ``--check-images`` then lists each built module's
cubins and PTX with cuobjdump and fails unless every build target of the family is in it (the
dispatch table routes a capability to a family only where one of those targets loads).
``--check-sass`` disassembles the modules of the families that have SASS rules (``SASS_RULES``) and fails on a
kernel that breaks one: properties of the machine code that the tests cannot see (they still pass when a
compiler or a source change loses one; the kernel only gets slower).
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


# --check-sass. Each rule reads one kernel's instructions (the text of each SASS line up to its ';', predicate
# included) and returns what is wrong with them, or None.
_LOCAL = re.compile(r"^(@!?U?P\w+\s+)?(LDL|STL)\b")


def _no_local_memory(name: str, ins: list[str]) -> str | None:
    """Registers spilled to local memory (LDL / STL): ptxas -v reports them as spill stores and loads."""
    n = sum(1 for i in ins if _LOCAL.match(i))
    return f"{n} local-memory instructions (LDL/STL)" if n else None


def _wgmma_pipelined(name: str, ins: list[str]) -> str | None:
    """ptxas serialises a kernel's wgmma (a wait after every HGMMA) where it cannot prove the asynchronous
    pipeline safe, e.g. when an accumulator is written by other instructions while a wgmma is in flight."""
    hgmma = sum(1 for i in ins if "HGMMA" in i)
    waits = sum(1 for i in ins if "WARPGROUP.DEPBAR" in i)
    if hgmma and waits * 4 > hgmma:
        return f"wgmma serialised: {waits} WARPGROUP.DEPBAR for {hgmma} HGMMA"
    return None


def _softmax_under_pv(name: str, ins: list[str]) -> str | None:
    """The forward's steady state: the softmax's exponentials between the wait for QK(n) (DEPBAR.LE gsb0, 0x1)
    and the wait for PV(n+1) (0x0), so that they run under this warpgroup's own PV. ptxas puts a wgmma wait at
    the top of its basic block (docs/kernels/fmha_fwd_sm90.md, "Keeping the schedule in the SASS")."""
    if "fmha_fwd_sm90_kernel" not in name:
        return None
    best = 0
    for k, i in enumerate(ins):
        if "WARPGROUP.DEPBAR.LE gsb0, 0x1" in i:
            n = 0
            for j in ins[k + 1:]:
                if "WARPGROUP.DEPBAR" in j:
                    break
                n += "MUFU.EX2" in j
            best = max(best, n)
    return None if best >= 32 else f"at most {best} MUFU.EX2 between the QK and the PV waits of the main loop"


_BAR_ARRIVE = re.compile(r"^(@!?U?P\w+\s+)?BAR\.ARV\b")
_HGMMA_A_IN_REGISTERS = re.compile(r"\bHGMMA\.\S+ R\d+, R\d+,")


def _pv_before_publish(name: str, ins: list[str]) -> str | None:
    """The Hopper decode's S warpgroup issues its own PV (an HGMMA whose A operand is in registers) between the
    softmax's exponentials and the barrier arrival that hands P to the V warpgroup, so that the P stores and
    barriers run under that PV (docs/kernels/mla_decode_sm90.md, "From one block's QK to the next")."""
    if "mla_decode_sm90_kernel" not in name:
        return None
    last_exp2, arrivals, with_pv = None, 0, 0
    for k, i in enumerate(ins):
        if "MUFU.EX2" in i:
            last_exp2 = k
        elif _BAR_ARRIVE.match(i) and last_exp2 is not None:
            arrivals += 1
            with_pv += any(_HGMMA_A_IN_REGISTERS.search(j) for j in ins[last_exp2:k])
            last_exp2 = None
    if not arrivals:
        return "no P hand-off (BAR.ARV) after the softmax's exponentials"
    if with_pv == arrivals:
        return None
    return f"{arrivals - with_pv} of {arrivals} P hand-offs without the S warpgroup's PV issued before them"


SASS_RULES = {
    "fmha_fwd_sm90": (_no_local_memory, _wgmma_pipelined, _softmax_under_pv),
    "fmha_bwd_sm90": (_no_local_memory, _wgmma_pipelined),
    "mla_decode_sm80": (_no_local_memory, _wgmma_pipelined, _pv_before_publish),
}

_FUNCTION = re.compile(r"^\s*Function : (\S+)")
_INSTRUCTION = re.compile(r"^\s*/\*[0-9a-f]{4,}\*/\s+([^;]*);")


def kernel_sass(path: str, cuobjdump: str) -> dict[str, list[str]]:
    """{kernel (mangled) name: its instructions} of every cubin in a module file (cuobjdump -sass); a kernel
    that several cubins hold appears once per cubin under the same name, the later one kept."""
    text = subprocess.run([cuobjdump, "-sass", path], capture_output=True, text=True).stdout
    kernels: dict[str, list[str]] = {}
    current = None
    for line in text.splitlines():
        m = _FUNCTION.match(line)
        if m:
            current = kernels.setdefault(m.group(1), [])
            current.clear()
            continue
        m = _INSTRUCTION.match(line)
        if m and current is not None:
            current.append(" ".join(m.group(1).split()))
    return kernels


def sass_problems(family: str, kernels: dict[str, list[str]]) -> list[str]:
    """'kernel: what is wrong' for each kernel of the family's module that breaks one of its SASS_RULES."""
    out = []
    for name, ins in sorted(kernels.items()):
        for rule in SASS_RULES.get(family, ()):
            why = rule(name, ins)
            if why:
                out.append(f"{name}: {why}")
    return out


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
    ap.add_argument("--check-sass", action="store_true",
                    help="after building, check the SASS of the families that have rules (SASS_RULES)")
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
        check_sass = args.check_sass and fam.name in SASS_RULES
        if not (args.check_images or check_sass):
            continue
        tool, path = find_cuobjdump(), getattr(module, "__file__", None)
        if tool is None or path is None:
            print(f"FAIL {fam.name}: --check-images / --check-sass need cuobjdump (CUDA toolkit or Triton) and the "
                  f"module file ({path})")
            failed.append(fam.name)
            continue
        if args.check_images:
            lacks = missing_images(fam, path, tool)
            if lacks:
                print(f"FAIL {fam.name}: {path} has no image for {' '.join(lacks)}")
                failed.append(fam.name)
            else:
                elf, ptx = module_images(path, tool)
                print(f"     images: {' '.join(sorted(elf | ptx))}")
        if check_sass:
            kernels = kernel_sass(path, tool)
            problems = sass_problems(fam.name, kernels) if kernels else ["no SASS found"]
            if problems:
                print(f"FAIL {fam.name}: SASS rules broken:\n     " + "\n     ".join(problems))
                if fam.name not in failed:
                    failed.append(fam.name)
            else:
                rules = ", ".join(r.__name__.lstrip("_").replace("_", " ") for r in SASS_RULES[fam.name])
                print(f"     sass: {len(kernels)} kernels keep: {rules}")
    if failed:
        print(f"mla_autograd.build: {len(failed)} famil{'y' if len(failed) == 1 else 'ies'} failed: {' '.join(failed)}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
