"""tools/ncu_source_summary.py on CPU: a small Nsight Compute source-page CSV (the layout `ncu --page source --csv
--print-source sass` writes) read back, its busiest lines and the stretches between sync instructions."""
import csv
import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

HEADER = ["Address", "Source", "Warp Stall Sampling (All Samples)", "Warp Stall Sampling (Not-issued Samples)",
          "Instructions Executed", "stall_barrier", "stall_long_sb", "stall_wait", "stall_barrier (Not Issued)"]
# (SASS, samples, executed, barrier, long_sb, wait)
LINES = [
    ("MOV R1, c[0x0][0x28]", 2, 10, 0, 0, 2),
    ("FMNMX R2, R3, R4, !PT", 5, 10, 0, 0, 5),
    ("BAR.SYNC.DEFER_BLOCKING 0x1, 0x100", 1, 10, 1, 0, 0),
    ("@!P1 BRA 0x100", 40, 10, 40, 0, 0),           # the warp held at the barrier is sampled here
    ("SYNCS.PHASECHK.TRANS64.TRYWAIT P1, [R5], R2", 3, 10, 0, 0, 3),
    ("@!P1 BRA 0x200", 30, 10, 0, 30, 0),           # the mbarrier wait's retry branch
    ("HGMMA.64x64x16.F32.BF16 R152, gdesc[UR16], R152", 4, 10, 0, 0, 4),
    ("WARPGROUP.DEPBAR.LE gsb0, 0x0", 15, 10, 15, 0, 0),
    ("MUFU.EX2 R7, R7", 0, 10, 0, 0, 0),
    ("EXIT", 0, 10, 0, 0, 0),
]


def _tool():
    spec = importlib.util.spec_from_file_location("ncu_source_summary_under_test",
                                                  ROOT / "tools" / "ncu_source_summary.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _write(tmp_path):
    path = tmp_path / "sass.csv"
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["Kernel Name", "void my_kernel<int>(Args)"])
        w.writerow(HEADER)
        for i, (src, s, e, b, l, wt) in enumerate(LINES):
            w.writerow([hex(0x1000 + 16 * i), "      " + src, str(s), str(s), f"{e:,}", str(b), str(l), str(wt), "0"])
    return path


def test_read_keeps_every_line_with_its_samples_and_reasons(tmp_path):
    tool = _tool()
    kernel, rows = tool.read(str(_write(tmp_path)))
    assert kernel == "void my_kernel<int>(Args)"
    assert [r["source"] for r in rows] == [src for src, *_ in LINES]
    assert [r["samples"] for r in rows] == [s for _, s, *_ in LINES]
    assert rows[3]["reasons"] == {"barrier": 40, "long_sb": 0, "wait": 0}
    assert all(r["executed"] == 10 for r in rows)  # "10" and thousands separators parse alike


def test_top_lines_are_the_busiest_in_source_order(tmp_path):
    tool = _tool()
    _, rows = tool.read(str(_write(tmp_path)))
    assert [r["line"] for r in tool.top_lines(rows, 3)] == [3, 5, 7]


def test_stretches_close_one_line_after_each_sync_instruction(tmp_path):
    tool = _tool()
    _, rows = tool.read(str(_write(tmp_path)))
    got = [(s["first"], s["last"], s["samples"], s["source"].split()[0]) for s in tool.stretches(rows)]
    assert got == [
        (0, 3, 2 + 5 + 1 + 40, "BAR.SYNC.DEFER_BLOCKING"),  # the barrier's wait, sampled on the next line, counts here
        (4, 5, 3 + 30, "SYNCS.PHASECHK.TRANS64.TRYWAIT"),
        (6, 8, 4 + 15 + 0, "WARPGROUP.DEPBAR.LE"),
    ]
    assert sum(s["samples"] for s in tool.stretches(rows)) == sum(r["samples"] for r in rows)


def test_main_prints_a_report_and_fails_without_samples(tmp_path, capsys):
    tool = _tool()
    assert tool.main([str(_write(tmp_path)), "--top", "2", "--min-share", "10"]) == 0
    out = capsys.readouterr().out
    assert "100 samples over 10 SASS lines" in out and "@!P1 BRA 0x100" in out
    empty = tmp_path / "empty.csv"
    with open(empty, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["Kernel Name", "k"])
        w.writerow(HEADER)
        w.writerow(["0x0", "EXIT", "0", "0", "1", "0", "0", "0", "0"])
    assert tool.main([str(empty)]) == 1
