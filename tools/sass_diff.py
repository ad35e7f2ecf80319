"""Compare the SASS of two builds of one extension module, kernel by kernel: the proof that a change which
only moves code (host layers, headers, names) leaves every kernel as it was.

    python tools/sass_diff.py BEFORE.so AFTER.so [--show N]

Dumps both with ``cuobjdump -sass`` (found as ``python -m mla_autograd.build --check-images`` finds it),
splits the listing per architecture and function, and compares each function's instructions with their
encodings (the ``/* 0x... */`` comments); anonymous-namespace hashes in names are ignored. Exit status 0 when every function of both is identical, 1 otherwise;
prints the functions that differ, are missing on one side, and the first N differing lines of each.
"""
from __future__ import annotations

import argparse
import re
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from mla_autograd.build import find_cuobjdump  # noqa: E402

_ARCH = re.compile(r"^\s*arch = (\S+)")
_FUNC = re.compile(r"^\s*Function : (\S+)")
# nvcc names an anonymous namespace after a hash of its translation unit, which changes with any edit to it
_ANON = re.compile(r"_GLOBAL__N__[0-9a-f]+_")


def sass_by_function(path: str, tool: str) -> dict[tuple[str, str], list[str]]:
    """{(arch, mangled function name): its SASS lines} of one module file."""
    text = subprocess.run([tool, "-sass", path], capture_output=True, text=True, check=True).stdout
    out: dict[tuple[str, str], list[str]] = {}
    arch, key = "?", None
    for line in text.splitlines():
        m = _ARCH.match(line)
        if m:
            arch, key = m.group(1), None
            continue
        m = _FUNC.match(line)
        if m:
            key = (arch, _ANON.sub("_GLOBAL__N__", m.group(1)))
            out[key] = []
            continue
        if key is not None and line.strip():
            out[key].append(_ANON.sub("_GLOBAL__N__", line.strip()))
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("before")
    ap.add_argument("after")
    ap.add_argument("--show", type=int, default=4, help="differing lines to print per function")
    a = ap.parse_args()
    tool = find_cuobjdump()
    if tool is None:
        print("sass_diff: no cuobjdump (CUDA toolkit or Triton)")
        return 2
    before, after = sass_by_function(a.before, tool), sass_by_function(a.after, tool)
    same = [k for k in before if k in after and before[k] == after[k]]
    differ = [k for k in before if k in after and before[k] != after[k]]
    only = sorted(set(before) ^ set(after))
    print(f"{len(same)} functions identical, {len(differ)} differ, {len(only)} on one side only "
          f"({len(before)} before, {len(after)} after)")
    for k in differ:
        lines = [(x, y) for x, y in zip(before[k], after[k]) if x != y]
        print(f"DIFFER {k[0]} {k[1]}: {len(before[k])} vs {len(after[k])} lines, {len(lines)} differ")
        for x, y in lines[: a.show]:
            print(f"   - {x}\n   + {y}")
    for k in only:
        print(f"ONLY {'before' if k in before else 'after'} {k[0]} {k[1]}")
    return 0 if not differ and not only and before else 1


if __name__ == "__main__":
    sys.exit(main())
