"""The registry of kernel families: what each one is built from, for which GPUs, and what it serves.

Everything else reads this one table: the JIT builder (`_build`: sources and nvcc targets), the dispatch
table (`_dispatch`: which compute capabilities, dtypes and head dims a family serves), ``explain()``, the
prebuild CLI and its image check (`build`), and the tests. A family serves a compute capability exactly
when one of its build targets yields code that loads there, so routing can never send a call to a module
without a loadable image.

Build targets (nvcc's names):

- ``sm_XY``: SASS for X.Y; runs on X.Z for every Z >= Y (same major).
- ``sm_XYa``: architecture-specific SASS (wgmma on sm_90a, tcgen05 on sm_100a); runs on X.Y only.
- ``sm_XYf``: family-specific SASS (CUDA >= 12.9); runs on X.Z for Z >= Y: sm_100f on 10.0 and 10.3.
- ``compute_XY``: PTX, compiled by the driver at load time on any capability >= X.Y.
"""
from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import torch

__all__ = ["Target", "Family", "FAMILIES"]

_TARGET_RE = re.compile(r"^(sm|compute)_(\d+)(\d)([af]?)$")


@dataclasses.dataclass(frozen=True)
class Target:
    """One nvcc code target, e.g. ``Target("sm_90a")`` or ``Target("compute_90")`` (PTX)."""

    name: str

    def __post_init__(self):
        if not _TARGET_RE.match(self.name):
            raise ValueError(f"not an nvcc code target: {self.name!r} (expected sm_XY[a|f] or compute_XY)")

    @property
    def _parts(self) -> tuple[str, int, int, str]:
        kind, major, minor, suffix = _TARGET_RE.match(self.name).groups()
        return kind, int(major), int(minor), suffix

    @property
    def is_ptx(self) -> bool:
        return self._parts[0] == "compute"

    @property
    def capability(self) -> tuple[int, int]:
        """The (major, minor) the target is compiled for."""
        _, major, minor, _ = self._parts
        return major, minor

    @property
    def gencode(self) -> str:
        """The nvcc flag that builds this target."""
        kind, major, minor, suffix = self._parts
        arch = f"compute_{major}{minor}{suffix}"
        return f"-gencode=arch={arch},code={arch if kind == 'compute' else self.name}"

    def loads_on(self, cap: tuple[int, int]) -> bool:
        """Whether code built for this target loads on a GPU of compute capability ``cap``."""
        kind, major, minor, suffix = self._parts
        if kind == "compute":
            return tuple(cap) >= (major, minor)
        if suffix == "a":
            return tuple(cap) == (major, minor)
        return cap[0] == major and cap[1] >= minor  # plain SASS, or a family ('f') target

    def loads_text(self) -> str:
        """Where it loads, in words: "9.0", "10.0-10.x", ">= 9.0 (PTX)"."""
        kind, major, minor, suffix = self._parts
        if kind == "compute":
            return f">= {major}.{minor} (PTX)"
        if suffix == "a":
            return f"{major}.{minor}"
        return f"{major}.{minor}-{major}.x"


@dataclasses.dataclass(frozen=True)
class Family:
    """One kernel family = one extension module.

    name: module/family name, also the prefix of its source files in ``csrc/<subdir>/``.
    subdir: the family's folder under csrc/ (``<arch>/<folder>``, e.g. "sm90/fmha_fwd") holding its config, params,
        kernel and host layer. Headers shared by the families of one arch live in ``csrc/<arch>/`` above the family
        folders; headers shared by all in ``csrc/common/``.
    targets: nvcc code targets every build of this family compiles (see the module docstring).
    ops: the dispatch ops it serves ("attn_fwd", "attn_bwd", "mla_fwd", "mla_bwd", "decode").
    dims: head-dim pairs it serves: (Dqk, Dv) for attention, (Dc, Dr) for decode.
    dtypes: input dtypes it serves.
    mla_dims: for "mla_fwd" / "mla_bwd" (MLA's split query and key read in place, no concatenation), the part head
        dims (Dn, Dr, Dv) it serves: q_nope / k_nope Dn, q_pe / k_pe Dr, v Dv.
    shared_dirs: folders of csrc/ besides its own arch folder and csrc/common whose headers its sources include
        (a change there rebuilds it).
    guards_values: its kernels are memory-safe for any values inside the length and page tensors
        (cu_seqlens, block_table, cache_seqlens): they clamp them on the device, so calls need no value check
        (and no host sync). For a family without it, the call checks the values first (one device reduction and
        an 8-byte copy) unless MLA_AUTOGRAD_CHECK_VALUES=0.
    """

    name: str
    subdir: str
    targets: tuple[str, ...]
    ops: tuple[str, ...]
    dims: frozenset
    dtypes: frozenset
    guards_values: bool = True
    mla_dims: frozenset = frozenset()
    shared_dirs: tuple[str, ...] = ()

    def __post_init__(self):
        for t in self.targets:
            Target(t)  # validates the name

    def dims_for(self, op: str) -> frozenset:
        """The head dims the family serves for a dispatch op: mla_dims for "mla_fwd" / "mla_bwd", else dims."""
        return self.mla_dims if op in MLA_OPS else self.dims

    def target_objects(self) -> tuple[Target, ...]:
        return tuple(Target(t) for t in self.targets)

    def gencode_flags(self) -> list[str]:
        return [t.gencode for t in self.target_objects()]

    def image_for(self, cap: tuple[int, int]) -> Target | None:
        """The build target whose code loads on ``cap`` (SASS preferred over PTX), or None."""
        loading = [t for t in self.target_objects() if t.loads_on(cap)]
        loading.sort(key=lambda t: (t.is_ptx, [-c for c in t.capability]))
        return loading[0] if loading else None

    def serves(self, cap: tuple[int, int]) -> bool:
        return self.image_for(cap) is not None

    def capability_text(self) -> str:
        """Where the build loads, in words, e.g. "9.0" or "8.0-8.x, 9.0-9.x, >= 9.0 (PTX)"."""
        return ", ".join(t.loads_text() for t in self.target_objects())

    def matches_arch(self, arch: str) -> bool:
        """Whether a build for ``arch`` (a target name; "sm_90" and "sm_90a" name the same chip here)
        should include this family: some target of the family is compiled for that (major, minor)."""
        want = Target(arch).capability
        return any(t.capability == want for t in self.target_objects())

    def sources(self) -> list[Path]:
        from ._build import csrc_dir
        d = csrc_dir() / self.subdir
        if not d.is_dir():
            return []
        return sorted(p for p in d.iterdir()
                      if p.name.startswith(self.name) and p.suffix in (".cu", ".cpp"))


_HALF = frozenset({torch.bfloat16, torch.float16})
# The ops on MLA's split query and key (dims (Dn, Dr, Dv)): the forward and the backward that read them in place.
MLA_OPS = ("mla_fwd", "mla_bwd")

FAMILIES: dict[str, Family] = {f.name: f for f in (
    # mla_fwd: the 192/128 kernel with its Q and K tiles filled from the parts by two TMA descriptors each
    # (fmha_fwd_sm90_hdim192_mla.cu).
    Family("fmha_fwd_sm90", "sm90/fmha_fwd", ("sm_90a",), ("attn_fwd", "mla_fwd"),
           frozenset({(192, 128), (128, 128), (64, 64)}), _HALF, mla_dims=frozenset({(128, 64, 128)})),
    # mla_bwd: the 192/128 backward with its Q and K tiles filled from the parts and dK stored as dk_nope and dk_pe
    # (fmha_bwd_sm90_hdim192_mla.cu).
    Family("fmha_bwd_sm90", "sm90/fmha_bwd", ("sm_90a",), ("attn_bwd", "mla_bwd"),
           frozenset({(192, 128), (128, 128), (64, 64)}), _HALF, mla_dims=frozenset({(128, 64, 128)})),
    # Family SASS: one cubin loads on B200/GB200 (10.0) and B300/GB300 (10.3). CUTLASS example 77's
    # kernels compile for sm_100a or sm_100f alike (both enable tcgen05/TMEM).
    # CUTLASS example 77's kernels read cu_seqlens as given; the host layer launches them with a copy sanitised
    # on the device (csrc/sm100/fmha/sm100_fmha_cu.h), so any values are memory-safe.
    Family("fmha_fwd_sm100", "sm100/fmha", ("sm_100f",), ("attn_fwd",),
           frozenset({(192, 128), (128, 128)}), _HALF),
    Family("fmha_bwd_sm100", "sm100/fmha", ("sm_100f",), ("attn_bwd",),
           frozenset({(192, 128), (128, 128)}), _HALF),
    # mma.sync/cp.async/ldmatrix code: native sm_80 (8.x) and sm_90 cubins, plus compute_90 PTX for newer
    # GPUs (10.x, 12.x). The PTX is compute_90, not compute_80, because the host enables programmatic
    # dependent launch on >= 9.0 and only code compiled for >= 9.0 contains the griddepcontrol.wait that
    # makes that safe.
    # On 9.0 its 64-row tiles run the Hopper wgmma + TMA kernel (csrc/sm90/mla_decode, compiled into this
    # module's sm_90a cubin; empty in the other images): hence sm_90a rather than sm_90, which loads on the
    # same (and only) 9.x chips.
    Family("mla_decode_sm80", "sm80/mla_decode", ("sm_80", "sm_90a", "compute_90"), ("decode",),
           frozenset({(512, 64)}), _HALF, shared_dirs=("sm90",)),
)}

