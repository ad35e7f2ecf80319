"""The CUDA error policy of csrc/common/cuda_check.h, read off the sources of the families that follow it
(no compiling): launchers (.cu/.cuh) include no torch header and return their cudaError_t, host layers raise
it with MLA_CUDA_CHECK, and no other convention (c10's checks, throws, prints, status structs, a dynamic
shared memory attribute set at every launch) is left."""
import re

import pytest

from mla_autograd import _build

CSRC = _build.csrc_dir()
FAMILY_SOURCES = sorted([*CSRC.glob("sm80/mla_decode/mla_decode_sm80_*"), *CSRC.glob("sm90/fmha_fwd/fmha_fwd_sm90_*"),
                         *CSRC.glob("sm90/fmha_bwd/fmha_bwd_sm90_*"), *CSRC.glob("sm100/fmha/*")])
OTHER_CONVENTIONS = ("C10_CUDA_CHECK", "C10_CUDA_KERNEL_LAUNCH_CHECK", "throw ", "fprintf(", "LaunchStatus",
                     "cudaFuncSetAttribute")


def code_of(path):
    """The file's text without comments."""
    text = re.sub(r"/\*.*?\*/", "", path.read_text(), flags=re.S)
    return re.sub(r"//[^\n]*", "", text)


@pytest.mark.parametrize("path", FAMILY_SOURCES, ids=lambda p: p.name)
def test_one_error_convention(path):
    code = code_of(path)
    for word in OTHER_CONVENTIONS:
        assert word not in code, f"{path.name} uses {word.strip()}: common/cuda_check.h says how errors go"
    if path.suffix in (".cu", ".cuh"):
        assert "MLA_CUDA_CHECK" not in code and "torch/" not in code and "c10/" not in code, \
            f"{path.name} is nvcc-compiled: its launchers return cudaError_t (MLA_CUDA_TRY)"


def test_launch_checks_name_the_family():
    for path in FAMILY_SOURCES:
        for m in re.finditer(r"MLA_CUDA_CHECK\((.*?);\n", code_of(path), flags=re.S):
            assert re.search(r'"(mla_decode_sm80|fmha_fwd_sm90|fmha_bwd_sm90|fmha_fwd_sm100|fmha_bwd_sm100): |, family, ',
                             m.group(1)), f"{path.name}: {m.group(0)!r} does not name its family"
