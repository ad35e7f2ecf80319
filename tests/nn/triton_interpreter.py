"""One of this folder's case scripts (rope_cases.py, rmsnorm_cases.py) run by Triton's interpreter on CPU tensors,
in a fresh process: the interpreter is chosen when a kernel module is imported, so it needs TRITON_INTERPRET=1 set
before anything imports triton."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]


def run_cases_script(name: str) -> str:
    """Runs tests/nn/<name> under the interpreter; asserts that it exited 0 and reached its layer cases (the last
    ones it runs), and returns its output."""
    env = dict(os.environ, TRITON_INTERPRET="1",
               PYTHONPATH=os.pathsep.join([str(ROOT), str(HERE), os.environ.get("PYTHONPATH", "")]))
    r = subprocess.run([sys.executable, "-W", "ignore", str(HERE / name)], env=env, cwd=ROOT, capture_output=True,
                       text=True, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "layer forward/backward" in r.stdout, r.stdout
    return r.stdout
