"""Packaging hook: ship csrc/ inside the wheel as mla_autograd/_csrc.

The kernels are compiled on first use (mla_autograd/_build.py), so an installed package needs their
sources. A checkout or editable install finds csrc/ beside the package; a regular install finds this
copy (`_build.csrc_dir()` looks in both places).
"""
import shutil
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py


class BuildPyWithCsrc(build_py):
    def run(self):
        super().run()
        if getattr(self, "editable_mode", False):
            return
        src = Path(__file__).resolve().parent / "csrc"
        dst = Path(self.build_lib) / "mla_autograd" / "_csrc"
        if dst.exists():
            shutil.rmtree(dst)
        shutil.copytree(src, dst)


setup(cmdclass={"build_py": BuildPyWithCsrc})
