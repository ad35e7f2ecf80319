"""Host-only check of fmha_bwd_sm90's hand-computed shared-memory store addresses (no GPU needed).

The backward kernel stores its dQ block and (swapped schedule) dS^T pairs through addresses built from one
or two base registers plus compile-time offsets instead of CuTe's per-element partition: that took its
register spills to zero. tests/sm90/fmha_bwd_sm90_addr_check.cu compares those formulas with CuTe's own
partition for every consumer thread, both buffers, bf16 and fp16, d = 64/128/192; a wrong formula would
corrupt gradients only on a GPU, which CI does not have. Compiling it takes about 2 minutes on 2 cores.
"""
from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from mla_autograd import _build

ROOT = Path(__file__).resolve().parents[1]


def test_bwd_store_addresses_match_cute_partition(tmp_path):
    home = _build._cuda_home()
    if home is None:
        pytest.skip("no CUDA toolkit (nvcc) found")
    try:
        includes, _, nvcc_flags = _build._flags(_build.FAMILIES["fmha_bwd_sm90"], False)
    except RuntimeError as e:  # no CUTLASS headers
        pytest.skip(str(e))
    exe = tmp_path / "addr_check"
    cmd = [os.path.join(home, "bin", "nvcc"), *nvcc_flags, *[f"-I{d}" for d in includes],
           str(ROOT / "tests" / "sm90" / "fmha_bwd_sm90_addr_check.cu"), "-o", str(exe)]
    build = subprocess.run(cmd, capture_output=True, text=True, timeout=1200)
    assert build.returncode == 0, build.stderr[-3000:]
    run = subprocess.run([str(exe)], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0 and run.stdout.strip().endswith("ALL OK"), run.stdout[-3000:] + run.stderr[-2000:]
