"""tools/ab_fa4.py's --compare on CPU: rows of A and B runs matched by shape, the B/A change and the ratios to
FlashAttention-4 computed from the runs' numbers, and the checksum verdict."""
import importlib.util
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _tool():
    spec = importlib.util.spec_from_file_location("ab_fa4_under_test", ROOT / "tools" / "ab_fa4.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _row(label, ours, fa4, sums, S=1024, causal=False):
    return dict(label=label, pass_="fwd", d=192, dv=128, B=16, H=16, S=S, causal=causal, ours_tfs=ours, fa4_tfs=fa4,
                sums=sums)


def _write_runs(tmp_path, runs):
    """Each run's rows as RUN.json in tmp_path; their paths, in the runs' order."""
    paths = []
    for name, rows in runs.items():
        p = tmp_path / f"{name}.json"
        p.write_text(json.dumps(rows))
        paths.append(str(p))
    return paths


def test_compare_matches_rows_and_reports_change_ratio_and_sums(tmp_path, capsys):
    runs = {"A1": [_row("A1", 500, 550, [1.0, 2.0]), _row("A1", 300, 310, [3.0], S=2048, causal=True)],
            "B1": [_row("B1", 520, 550, [1.0, 2.0]), _row("B1", 330, 300, [3.5], S=2048, causal=True)],
            "A2": [_row("A2", 500, 450, [1.0, 2.0])],
            "B2": [_row("B2", 530, 450, [1.0, 2.0])]}
    _tool().main(["--compare", *_write_runs(tmp_path, runs)])
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 2
    s1024 = next(line for line in lines if "S=1024" in line)
    # B/A: mean(520, 530) / mean(500, 500) - 1; vs FA4: mean(500/550, 500/450), mean(520/550, 530/450)
    assert "A 500,500  B 520,530  B/A +0.050" in s1024
    assert f"vs FA4 A {(500 / 550 + 500 / 450) / 2:.3f} B {(520 / 550 + 530 / 450) / 2:.3f}" in s1024
    assert s1024.endswith("same sums")
    s2048 = next(line for line in lines if "S=2048" in line)
    assert "causal=1" in s2048 and "B/A +0.100" in s2048 and s2048.endswith("sums differ")


def test_compare_puts_every_variant_beside_the_baseline(tmp_path, capsys):
    runs = {"A1": [_row("A1", 400, 500, [1.0])], "B1": [_row("B1", 440, 500, [1.0])],
            "C1": [_row("C1", 380, 400, [1.0])]}
    _tool().main(["--compare", *_write_runs(tmp_path, runs)])
    (line,) = capsys.readouterr().out.strip().splitlines()
    assert "A 400  B 440  C 380  B/A +0.100  C/A -0.050" in line
    assert "vs FA4 A 0.800 B 0.880 C 0.950" in line and line.endswith("same sums")
