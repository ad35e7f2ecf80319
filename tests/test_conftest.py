"""tests/conftest.py's announcements of long silent steps: a line on the terminal, through pytest's output
capture, when a listed test or build fixture starts. Run on a throwaway test file in a pytest subprocess
(nothing is compiled)."""
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import conftest

HERE = Path(__file__).resolve().parent


def test_long_steps_are_announced_through_capture(tmp_path):
    (tmp_path / "conftest.py").write_text(textwrap.dedent(f"""
        import importlib.util
        spec = importlib.util.spec_from_file_location("mla_tests_conftest", {str(HERE / "conftest.py")!r})
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        mod.SLOW_TESTS["test_tmp.py::test_slow"] = "doing something slow (about 1 s)"
        mod.BUILD_FIXTURES[("test_tmp.py", "built")] = ("no_such_family", "about 3 s")
        pytest_runtest_setup = mod.pytest_runtest_setup
        pytest_fixture_setup = mod.pytest_fixture_setup
    """))
    (tmp_path / "test_tmp.py").write_text(textwrap.dedent("""
        import pytest

        @pytest.fixture(scope="module")
        def built():
            print("fixture output, captured")
            return 1

        def test_slow():
            print("test output, captured")

        def test_quick(built):
            pass

        def test_again(built):
            pass
    """))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(HERE.parent), os.environ.get("PYTHONPATH", "")]))
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "test_tmp.py"],
                       cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    lines = r.stdout.splitlines()
    assert "[mla_autograd tests] test_tmp.py::test_slow: doing something slow (about 1 s)" in lines, r.stdout
    fixture_lines = [ln for ln in lines if "building kernel family no_such_family" in ln]
    assert fixture_lines == ["[mla_autograd tests] test_tmp.py: building kernel family no_such_family for its "
                             "fixture 'built' (unless already cached; about 3 s)"], r.stdout  # once: module scope
    assert "captured" not in r.stdout  # the tests' own output stays captured


def test_listed_steps_exist():
    """Every announced test and fixture is still there (a renamed one would go silent again)."""
    for nodeid in conftest.SLOW_TESTS:
        path, name = nodeid.split("::")
        assert f"def {name}(" in (HERE / path).read_text(), nodeid
    for (path, fixture), (family, _) in conftest.BUILD_FIXTURES.items():
        text = (HERE / path).read_text()
        assert f"def {fixture}(" in text and f'load_family("{family}")' in text, (path, fixture)
    assert conftest._family_built("no_such_family") is None
