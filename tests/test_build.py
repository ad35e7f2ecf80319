"""The JIT builder: family registry, flags per arch, cache keys, the prebuild CLI (no compiling here:
CI's compile check runs `python -m mla_autograd.build` itself)."""
import pytest

from mla_autograd import _build, build


def test_every_family_has_sources_and_an_api_file():
    for fam in _build.FAMILIES.values():
        names = [p.name for p in fam.sources()]
        assert names, f"{fam.name} has no sources"
        assert any(n.endswith("_api.cpp") for n in names), f"{fam.name} has no *_api.cpp host layer"


def test_arch_flags_are_per_family():
    if _build.cutlass_dirs() is None:
        pytest.skip("nvidia-cutlass not installed")
    _, _, nvcc90 = _build._flags(_build.FAMILIES["fmha_fwd_sm90"], False)
    _, _, nvcc100 = _build._flags(_build.FAMILIES["fmha_bwd_sm100"], False)
    _, _, nvcc80 = _build._flags(_build.FAMILIES["mla_decode_sm80"], True)
    assert [f for f in nvcc90 if "gencode" in f] == ["-gencode=arch=compute_90a,code=sm_90a"]
    assert [f for f in nvcc100 if "gencode" in f] == ["-gencode=arch=compute_100f,code=sm_100f"]
    assert [f for f in nvcc80 if "gencode" in f] == ["-gencode=arch=compute_80,code=sm_80",
                                                     "-gencode=arch=compute_90a,code=sm_90a",
                                                     "-gencode=arch=compute_90,code=compute_90"]
    assert "-Xptxas=-v" in nvcc80 and "-Xptxas=-v" not in nvcc90


def test_fingerprint_changes_with_sources_and_flags(tmp_path, monkeypatch):
    (tmp_path / "x").mkdir()
    src = tmp_path / "x" / "fam_a.cu"
    src.write_text("// v1\n")
    monkeypatch.setattr(_build, "csrc_dir", lambda: tmp_path)
    fam = _build.Family("fam_a", "x", ("sm_90a",), ("attn_fwd",), frozenset(), frozenset())
    a = _build._fingerprint(fam, ("flags",))
    assert a == _build._fingerprint(fam, ("flags",))
    assert a != _build._fingerprint(fam, ("other",))
    (tmp_path / "x" / "shared.cuh").write_text("// header\n")
    b = _build._fingerprint(fam, ("flags",))
    assert b != a, "a header change must rebuild"
    src.write_text("// v2\n")
    assert _build._fingerprint(fam, ("flags",)) != b


def test_fingerprint_covers_the_arch_folder(tmp_path, monkeypatch):
    """A family's folder is csrc/<arch>/<folder>; the headers its arch's families share sit in csrc/<arch>/
    (csrc/sm90/sm90_attn_common.cuh), so a change there must rebuild the family too."""
    (tmp_path / "x" / "fam").mkdir(parents=True)
    (tmp_path / "x" / "fam" / "fam_a.cu").write_text("// v1\n")
    monkeypatch.setattr(_build, "csrc_dir", lambda: tmp_path)
    fam = _build.Family("fam_a", "x/fam", ("sm_90a",), ("attn_fwd",), frozenset(), frozenset())
    assert [p.name for p in fam.sources()] == ["fam_a.cu"]
    a = _build._fingerprint(fam, ("flags",))
    (tmp_path / "x" / "x_shared.cuh").write_text("// shared by the arch's families\n")
    assert _build._fingerprint(fam, ("flags",)) != a, "a shared arch header change must rebuild"


def test_cli_selects_families_by_arch(monkeypatch, capsys):
    built = []
    monkeypatch.setattr(build, "load_family", lambda name, **kw: built.append(name))
    monkeypatch.setattr(build, "family_available", lambda name: (True, ""))
    assert build.main(["--arch", "sm_100a"]) == 0
    assert sorted(built) == ["fmha_bwd_sm100", "fmha_fwd_sm100"]
    built.clear()
    assert build.main(["--arch", "sm_100f"]) == 0
    assert sorted(built) == ["fmha_bwd_sm100", "fmha_fwd_sm100"]
    built.clear()
    assert build.main(["--arch", "sm_90a"]) == 0
    assert sorted(built) == ["fmha_bwd_sm90", "fmha_fwd_sm90", "mla_decode_sm80"]
    built.clear()
    assert build.main(["--arch", "sm_80"]) == 0
    assert built == ["mla_decode_sm80"]


def test_cli_fails_loudly(monkeypatch, capsys):
    def boom(name, **kw):
        raise RuntimeError("error: identifier undefined")
    monkeypatch.setattr(build, "load_family", boom)
    monkeypatch.setattr(build, "family_available", lambda name: (True, ""))
    assert build.main(["--family", "fmha_fwd_sm90"]) == 1
    out = capsys.readouterr().out
    assert "FAIL fmha_fwd_sm90" in out and "identifier undefined" in out


def test_cli_skip_missing_only_skips_missing_sources(monkeypatch, capsys):
    monkeypatch.setattr(build, "family_available", lambda name: (False, f"kernel family {name} has no sources in x"))
    assert build.main(["--family", "fmha_fwd_sm90", "--skip-missing"]) == 0
    monkeypatch.setattr(build, "family_available", lambda name: (False, "no CUDA toolkit (nvcc) found"))
    assert build.main(["--family", "fmha_fwd_sm90", "--skip-missing"]) == 1


def test_wheel_ships_the_kernel_sources(tmp_path):
    """A regular (non-editable) install must carry csrc/ (as mla_autograd/_csrc): kernels are compiled
    from it on first use, and without it every call would fall back to the reference path."""
    import subprocess
    import sys
    import zipfile
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    r = subprocess.run([sys.executable, "-m", "pip", "wheel", str(root), "-w", str(tmp_path), "--no-deps",
                        "--no-build-isolation", "-q"], capture_output=True, text=True, timeout=600)
    if r.returncode != 0 and "No module named" in r.stderr:
        pytest.skip(f"cannot build a wheel here: {r.stderr.strip()[-200:]}")
    assert r.returncode == 0, r.stderr[-2000:]
    (whl,) = tmp_path.glob("mla_autograd-*.whl")
    names = set(zipfile.ZipFile(whl).namelist())
    for fam in _build.FAMILIES.values():
        for src in fam.sources():
            rel = src.relative_to(_build.csrc_dir()).as_posix()
            assert f"mla_autograd/_csrc/{rel}" in names, f"wheel lacks {rel}"
    assert "mla_autograd/_csrc/common/checks.h" in names


def test_image_check_reads_cuobjdump_listings(monkeypatch):
    """--check-images: a module lacking a target's cubin or PTX fails. cuobjdump names arch- and
    family-specific cubins by number (t.2.sm_90a.cubin, x.sm_100.cubin for sm_100f)."""
    import subprocess
    listings = {"--list-elf": "ELF file    1: m.1.sm_80.cubin\nELF file    2: m.2.sm_90a.cubin\n",
                "--list-ptx": "PTX file    1: m.1.sm_90.ptx\n"}

    def fake_run(cmd, capture_output, text):
        return subprocess.CompletedProcess(cmd, 0, listings[cmd[1]], "")
    monkeypatch.setattr(build.subprocess, "run", fake_run)
    fam = _build.FAMILIES["mla_decode_sm80"]
    assert build.module_images("m.so", "cuobjdump") == ({"sm_80", "sm_90a"}, {"compute_90"})
    assert build.missing_images(fam, "m.so", "cuobjdump") == []
    listings["--list-ptx"] = ""
    assert build.missing_images(fam, "m.so", "cuobjdump") == ["compute_90"]
    listings["--list-elf"] = "ELF file    1: fmha_fwd_sm100_bf16_mla.sm_100.cubin\n"
    assert build.missing_images(_build.FAMILIES["fmha_fwd_sm100"], "m.so", "cuobjdump") == []
    assert build.missing_images(_build.FAMILIES["fmha_fwd_sm90"], "m.so", "cuobjdump") == ["sm_90a"]


def test_image_check_on_a_real_object(tmp_path):
    """cuobjdump's real listing format, on a two-line kernel built for an SM80-style target set."""
    import shutil
    import subprocess
    tool = build.find_cuobjdump()
    if tool is None or shutil.which("nvcc") is None:
        pytest.skip("needs nvcc and cuobjdump")
    src = tmp_path / "k.cu"
    src.write_text("__global__ void k(float* x) { x[0] = 1.f; }\n")
    obj = tmp_path / "k.o"
    fam = _build.Family("k", "x", ("sm_80", "sm_90", "compute_90"), ("decode",), frozenset(), frozenset())
    subprocess.run(["nvcc", *fam.gencode_flags(), "-c", str(src), "-o", str(obj)], check=True, timeout=300)
    assert build.missing_images(fam, str(obj), tool) == []
    assert build.missing_images(_build.FAMILIES["fmha_fwd_sm90"], str(obj), tool) == ["sm_90a"]


SASS_LISTING = """
\tcode for sm_90a
\t\tFunction : _ZN8mla_sm9020fmha_fwd_sm90_kernelIfEEvv
\t.headerflags\t@"EF_CUDA_VIRTUAL_SM(EF_CUDA_SM90)"
        /*0000*/                   LDC R1, c[0x0][0x28] ;                                  /* 0x00000a00ff017b82 */
                                                                                           /* 0x000fe20000000800 */
        /*0010*/                   HGMMA.64x128x16.F32.BF16 R88, gdesc[UR8], R88, gsb0 ;   /* 0x01e0000008587df0 */
        /*0020*/                   HGMMA.64x128x16.F32.BF16 R24, R152, gdesc[UR4].tnspB, R24, gsb0 ;  /* 0x0 */
        /*0030*/                   WARPGROUP.DEPBAR.LE gsb0, 0x1 ;                         /* 0x00008000000079c5 */
{loop}
        /*0060*/                   WARPGROUP.DEPBAR.LE gsb0, 0x0 ;                         /* 0x00008000000079c5 */
        /*0070*/              @!P0 BRA 0x30 ;                                              /* 0x0000007800b08947 */
        /*0080*/                   EXIT ;                                                  /* 0x000000000000794d */
\t\t..........
\t\tFunction : _ZN8mla_sm9012postprocessEv
        /*0000*/                   STL [R1], R2 ;                                          /* 0x0 */
        /*0010*/                   EXIT ;                                                  /* 0x0 */
"""
FWD = "_ZN8mla_sm9020fmha_fwd_sm90_kernelIfEEvv"
POST = "_ZN8mla_sm9012postprocessEv"


def _sass(loop: str) -> str:
    return SASS_LISTING.replace("{loop}", loop)


def test_kernel_sass_reads_cuobjdump_listings(monkeypatch):
    """--check-sass: cuobjdump -sass's listing split into kernels, one instruction per entry, predicate kept."""
    import subprocess
    listing = _sass("        /*0040*/                   MUFU.EX2 R3, R3 ;   /* 0x0 */")
    monkeypatch.setattr(build.subprocess, "run",
                        lambda cmd, capture_output, text: subprocess.CompletedProcess(cmd, 0, listing, ""))
    kernels = build.kernel_sass("m.so", "cuobjdump")
    assert sorted(kernels) == sorted([FWD, POST])
    assert kernels[FWD][0] == "LDC R1, c[0x0][0x28]" and "@!P0 BRA 0x30" in kernels[FWD]
    assert kernels[POST] == ["STL [R1], R2", "EXIT"]


def test_sass_rules_catch_what_they_name():
    """Each rule on a kernel that keeps it and on one that breaks it (the shapes the real SASS took: a spill,
    a serialised wgmma pipeline, the PV wait hoisted above the softmax)."""
    ex2 = ["MUFU.EX2 R3, R3"] * 40
    good = ["HGMMA.64x128x16.F32.BF16 R88, gdesc[UR8], R88, gsb0"] * 20 + [
        "WARPGROUP.DEPBAR.LE gsb0, 0x1", "FMNMX R1, R2, R3, !PT", *ex2, "WARPGROUP.DEPBAR.LE gsb0, 0x0"]
    assert build.sass_problems("fmha_fwd_sm90", {FWD: good}) == []
    hoisted = good[:21] + ["FMNMX R1, R2, R3, !PT", "WARPGROUP.DEPBAR.LE gsb0, 0x0", *ex2]
    (why,) = build.sass_problems("fmha_fwd_sm90", {FWD: hoisted})
    assert "0 MUFU.EX2 between the QK and the PV waits" in why
    serialised = [x for _ in range(20) for x in ("HGMMA.64x128x16.F32.BF16 R88, gdesc[UR8], R88, gsb0",
                                                  "WARPGROUP.DEPBAR.LE gsb0, 0x0")] + good[20:]
    (why,) = build.sass_problems("fmha_fwd_sm90", {FWD: serialised})
    assert "wgmma serialised: 22 WARPGROUP.DEPBAR for 20 HGMMA" in why
    spilled = good + ["@!P1 LDL.64 R4, [R1+0x8]", "STL [R1], R2", "LDLIKE R1"]
    (why,) = build.sass_problems("fmha_fwd_sm90", {FWD: spilled})
    assert "2 local-memory instructions" in why
    # the backward has no softmax rule; kernels other than the forward's main kernel are not held to it
    assert build.sass_problems("fmha_bwd_sm90", {FWD: hoisted}) == []
    assert build.sass_problems("fmha_fwd_sm90", {POST: ["EXIT"]}) == []
    assert build.sass_problems("fmha_fwd_sm100", {POST: ["STL [R1], R2"]}) == []  # no rules for that family


DECODE90 = "_ZN15mla_decode_sm9022mla_decode_sm90_kernelIN7cutlass10bfloat16_tE13__nv_bfloat16EEvNS_14Sm90DecodeArgsE"
DECODE80 = "_ZN15mla_decode_sm8017mla_decode_kernelI13__nv_bfloat16Li64EEEvNS_12DecodeParamsE"


def test_decode_sass_rules_catch_what_they_name():
    """The decode family: no local memory in any kernel; in the Hopper kernel, the S warpgroup's own PV (A from
    registers) issued between the exponentials and each P hand-off (the shape of the real SASS: MUFU.EX2s, the
    RS HGMMAs, then the shared stores and BAR.ARV), and P published before that PV caught."""
    ex2 = ["MUFU.EX2 R154, R154"] * 32
    pv_rs = ["WARPGROUP.ARRIVE", *["HGMMA.64x256x16.F32.BF16 R24, R184, gdesc[UR12].tnspB, R24"] * 3,
             "HGMMA.64x256x16.F32.BF16 R24, R196, gdesc[UR12].tnspB, R24, gsb0"]
    publish = ["@P1 BAR.SYNC.DEFER_BLOCKING 0x2, 0x100", *["STS [R5], R190"] * 16, "MEMBAR.ALL.CTA",
               "BAR.ARV 0x1, 0x100"]
    qk = ["HGMMA.64x64x16.F32.BF16 R152, gdesc[UR16], R152"] * 15 + [
        "HGMMA.64x64x16.F32.BF16 R152, gdesc[UR16], R152, gsb0", "WARPGROUP.DEPBAR.LE gsb0, 0x0"]
    wg2 = ["BAR.SYNC.DEFER_BLOCKING 0x1, 0x100", "HGMMA.64x256x16.F32.BF16 R24, gdesc[UR4].tnspB, R24, gsb0",
           "WARPGROUP.DEPBAR.LE gsb0, 0x0", "@!P1 BAR.ARV 0x2, 0x100"]
    good = wg2 + qk + (ex2 + pv_rs + publish + qk) * 2
    hmma = "HMMA.16816.F32.BF16 R4, R8, R12, R4"
    assert build.sass_problems("mla_decode_sm80", {DECODE90: good, DECODE80: [hmma]}) == []
    late_pv = wg2 + qk + (ex2 + publish + pv_rs + qk) * 2
    (why,) = build.sass_problems("mla_decode_sm80", {DECODE90: late_pv})
    assert "2 of 2 P hand-offs without the S warpgroup's PV issued before them" in why
    half = wg2 + qk + ex2 + pv_rs + publish + qk + ex2 + publish + pv_rs
    (why,) = build.sass_problems("mla_decode_sm80", {DECODE90: half})
    assert "1 of 2 P hand-offs" in why
    (why,) = build.sass_problems("mla_decode_sm80", {DECODE90: wg2 + qk})
    assert "no P hand-off" in why  # no softmax at all: not the kernel the rule knows
    (why,) = build.sass_problems("mla_decode_sm80", {DECODE80: [hmma, "STL [R1], R2"]})
    assert "1 local-memory instructions" in why
