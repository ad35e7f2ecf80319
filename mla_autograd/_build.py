"""JIT build of the CUDA kernel families.

Each family (the registry in ``_kernels``) is one extension module built from
``csrc/<arch>/<folder>/<family>*.{cu,cpp}`` with its own build targets, so an sm_100f instantiation never sees an
sm_80 flag and vice versa. Modules
are built on first use with torch.utils.cpp_extension + ninja into a cache directory whose name
hashes the sources (headers included), the flags, and the torch / CUDA / CUTLASS versions; a file
lock serialises concurrent builds of the same family. ``python -m mla_autograd.build`` prebuilds
(and CI compile-checks) families for named architectures.
"""
from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import importlib.util
import os
import sys
import threading
from pathlib import Path
from types import ModuleType

from ._kernels import FAMILIES, Family  # the registry: sources, build targets, what each family serves

__all__ = ["FAMILIES", "Family", "load_family", "family_available", "csrc_dir", "cutlass_dirs"]


def csrc_dir() -> Path:
    """The csrc/ tree: beside the package in a checkout or editable install, else shipped inside it."""
    here = Path(__file__).resolve().parent
    for cand in (here.parent / "csrc", here / "_csrc"):
        if cand.is_dir():
            return cand
    return here.parent / "csrc"


@functools.lru_cache(maxsize=None)
def cutlass_dirs() -> tuple[Path, Path] | None:
    """(include, examples) of the installed nvidia-cutlass wheel, or None if it is not installed."""
    spec = importlib.util.find_spec("cutlass_library")
    if spec is None or not spec.submodule_search_locations:
        return None
    root = Path(list(spec.submodule_search_locations)[0]) / "source"
    inc, ex = root / "include", root / "examples"
    if not (inc / "cute").is_dir():
        return None
    return inc, ex


def _looks_like_cuda_home(d: str | None) -> bool:
    return bool(d) and os.path.isfile(os.path.join(d, "include", "cuda_runtime.h")) and \
        os.path.isdir(os.path.join(d, "lib64"))


@functools.lru_cache(maxsize=None)
def _cuda_home() -> str | None:
    """The CUDA toolkit root. torch guesses it from `which nvcc`, which is wrong when nvcc is a
    wrapper script outside the toolkit (e.g. /usr/local/bin/nvcc): then -lcudart is not found."""
    from torch.utils import cpp_extension
    cands = [os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), cpp_extension.CUDA_HOME, "/usr/local/cuda"]
    import shutil
    nvcc = shutil.which("nvcc")
    if nvcc:
        try:  # follow a wrapper script's `exec /path/to/bin/nvcc`
            text = open(nvcc, "rb").read(4096).decode("utf-8", "ignore")
            for tok in text.split():
                if tok.endswith("/bin/nvcc"):
                    cands.insert(3, os.path.dirname(os.path.dirname(tok)))
        except OSError:
            pass
    for c in cands:
        if _looks_like_cuda_home(c):
            if cpp_extension.CUDA_HOME != c:
                cpp_extension.CUDA_HOME = c  # the ninja file takes include/lib paths from this global
            return c
    return None


def _cccl_dirs() -> list[str]:
    # g++ (for .cpp files that include CUTLASS) needs CCCL's include dir; nvcc finds it by itself.
    homes = [h for h in (_cuda_home(), os.environ.get("CUDA_HOME"), "/usr/local/cuda") if h]
    for h in homes:
        for sub in ("include/cccl", "targets/x86_64-linux/include/cccl", "targets/sbsa-linux/include/cccl"):
            d = os.path.join(h, sub)
            if os.path.isdir(d):
                return [d]
    return []


def _pip_cuda_header_dirs() -> list[str]:
    """Header dirs of the nvidia-* wheels torch depends on (cusparse.h, cublas_v2.h, ...): ATen's CUDA
    headers include them and a bare toolkit may lack them. Searched last (-idirafter), so they
    never shadow the toolkit's own headers."""
    spec = importlib.util.find_spec("nvidia")
    if spec is None or not spec.submodule_search_locations:
        return []
    out = []
    for root in spec.submodule_search_locations:
        for inc in sorted(Path(root).glob("*/include")):
            if (inc / "cusparse.h").is_file() or (inc / "cublas_v2.h").is_file():
                out.append(str(inc))
    return out


def _flags(fam: Family, ptxas_verbose: bool) -> tuple[list[str], list[str], list[str]]:
    """(include dirs, C++ flags, nvcc flags) for a family."""
    cut = cutlass_dirs()
    if cut is None:
        raise RuntimeError("mla_autograd: the CUDA kernels need CUTLASS/CuTe headers from "
                           "`pip install nvidia-cutlass==4.2.0.0`")
    inc, ex = cut
    # 77_blackwell_fmha: CUTLASS's example-77 headers include "kernel/...", "collective/..." relative to it.
    includes = [str(csrc_dir()), str(inc), str(ex), str(ex / "common"), str(ex / "77_blackwell_fmha")] + _cccl_dirs()
    # torch >= 2.12 headers need C++20; CUTLASS 4.2 compiles as C++17 or C++20.
    cflags = ["-O3", "-std=c++20"] + [f for d in _pip_cuda_header_dirs() for f in ("-idirafter", d)]
    nvcc = ["-O3", "-std=c++20", "--expt-relaxed-constexpr", "--expt-extended-lambda",
            "-lineinfo", "-DNDEBUG", "-U__CUDA_NO_HALF_OPERATORS__", "-U__CUDA_NO_HALF_CONVERSIONS__",
            "-U__CUDA_NO_BFLOAT16_CONVERSIONS__", "-U__CUDA_NO_HALF2_OPERATORS__"]
    nvcc += fam.gencode_flags()
    if ptxas_verbose:
        nvcc.append("-Xptxas=-v")
    return includes, cflags, nvcc


def _fingerprint(fam: Family, flags: tuple) -> str:
    import torch
    h = hashlib.sha256()
    # The family's arch folder (csrc/sm90 for csrc/sm90/fmha_fwd), not its own folder alone: it holds the headers
    # that the arch's families share (csrc/sm90/sm90_attn_common.cuh).
    roots = [csrc_dir() / Path(fam.subdir).parts[0], csrc_dir() / "common"] + [csrc_dir() / d for d in fam.shared_dirs]
    for root in roots:
        if not root.is_dir():
            continue
        for p in sorted(root.rglob("*")):
            if p.is_file() and p.suffix in (".cu", ".cpp", ".cuh", ".h", ".hpp"):
                # Headers of the arch folder count for every family in it: a shared header change rebuilds all.
                h.update(str(p.relative_to(csrc_dir())).encode())
                h.update(p.read_bytes())
    h.update(repr(flags).encode())
    h.update(torch.__version__.encode())
    h.update(str(torch.version.cuda).encode())
    try:
        from importlib.metadata import version
        h.update(version("nvidia-cutlass").encode())
    except Exception:  # pragma: no cover - cutlass missing is reported by _flags
        pass
    return h.hexdigest()[:16]


def cache_root() -> Path:
    env = os.environ.get("MLA_AUTOGRAD_CACHE")
    if env:
        return Path(env)
    import torch
    base = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"))
    tag = f"torch{torch.__version__.split('+')[0]}-cu{torch.version.cuda}-py{sys.version_info[0]}{sys.version_info[1]}"
    return base / "mla_autograd" / tag


@contextlib.contextmanager
def _file_lock(path: Path):
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


_loaded: dict[str, ModuleType] = {}
_load_lock = threading.Lock()


def family_available(name: str) -> tuple[bool, str]:
    """Whether a family could be built here: (ok, reason if not). Does not build."""
    fam = FAMILIES[name]
    if not fam.sources():
        return False, f"kernel family {name} has no sources in csrc/{fam.subdir}/"
    if cutlass_dirs() is None:
        return False, "nvidia-cutlass (CUTLASS/CuTe headers) is not installed"
    if _cuda_home() is None:
        return False, "no CUDA toolkit (nvcc) found to build the kernels"
    return True, ""


def load_family(name: str, *, verbose: bool = False, ptxas_verbose: bool = False) -> ModuleType:
    """Build (once, cached on disk) and import the extension module of a kernel family."""
    key = name
    mod = _loaded.get(key)
    if mod is not None:
        return mod
    with _load_lock:
        if key in _loaded:
            return _loaded[key]
        fam = FAMILIES[name]
        ok, why = family_available(name)
        if not ok:
            raise RuntimeError(f"mla_autograd: cannot build {name}: {why}")
        from torch.utils import cpp_extension
        # -Xptxas=-v changes only what the compiler prints: it goes to nvcc through NVCC_APPEND_FLAGS,
        # outside the ninja command line, so a verbose prebuild and later plain loads share one build
        # (a changed command line would make ninja rebuild silently on the next load).
        includes, cflags, nvcc = _flags(fam, False)
        fp = _fingerprint(fam, (includes, cflags, nvcc))
        build_dir = cache_root() / f"{name}-{fp}"
        build_dir.mkdir(parents=True, exist_ok=True)
        marker = build_dir / ".built"
        with _file_lock(build_dir.parent / f".{name}-{fp}.lock"):
            if marker.exists() and ptxas_verbose:
                print(f"mla_autograd: {name} is already built in {build_dir}: no ptxas report "
                      f"(delete that folder to rebuild with one)", file=sys.stderr, flush=True)
            if not marker.exists():
                print(f"mla_autograd: building {name} for {' '.join(fam.targets)} (first use; cached in {build_dir})",
                      file=sys.stderr, flush=True)
            # torch's own build lock (build_dir/lock, FileBaton in older torch) is left behind when a
            # build is killed, and then every later load waits on it forever. Under our lock no other
            # builder can be running, so any such file is stale.
            (build_dir / "lock").unlink(missing_ok=True)
            env_before = os.environ.get("NVCC_APPEND_FLAGS")
            if ptxas_verbose:
                os.environ["NVCC_APPEND_FLAGS"] = f"{env_before or ''} -Xptxas=-v".strip()
            try:
                mod = cpp_extension.load(
                    name=f"mla_autograd_{name}_{fp}",
                    sources=[str(p) for p in fam.sources()],
                    extra_include_paths=includes,
                    extra_cflags=cflags,
                    extra_cuda_cflags=nvcc,
                    build_directory=str(build_dir),
                    verbose=verbose,
                    with_cuda=True,
                )
            finally:
                if ptxas_verbose:
                    if env_before is None:
                        os.environ.pop("NVCC_APPEND_FLAGS", None)
                    else:
                        os.environ["NVCC_APPEND_FLAGS"] = env_before
            marker.touch()
        _loaded[key] = mod
        return mod
