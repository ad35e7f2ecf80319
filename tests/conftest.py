import contextlib
import os
import sys

import pytest
import torch


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (kernel test); none on this machine")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


# Tensor methods that read values on the host: on a GPU each is a device-to-host copy (a sync).
_HOST_READS = ("item", "tolist", "cpu", "numpy", "__bool__", "__int__", "__index__", "__float__")


@pytest.fixture
def host_reads(monkeypatch):
    """A list that records (method, shape) for every host read of tensor values (see _HOST_READS)
    while the test runs."""
    reads = []
    for name in _HOST_READS:
        def spy(t, *args, _real=getattr(torch.Tensor, name), _name=name, **kwargs):
            reads.append((_name, tuple(t.shape)))
            return _real(t, *args, **kwargs)
        monkeypatch.setattr(torch.Tensor, name, spy)
    return reads


# ---- long silent steps: said on the terminal when they start (pytest captures their own output) ----

#: test node id (its end) -> what the test does that takes long, and roughly how long
SLOW_TESTS = {
    "test_build.py::test_wheel_ships_the_kernel_sources":
        "building a wheel of the package with pip (about 45 s on 2 cores)",
    "test_fmha_bwd_sm90_host.py::test_bwd_store_addresses_match_cute_partition":
        "compiling tests/sm90/fmha_bwd_sm90_addr_check.cu with nvcc (about 2 minutes on 2 cores)",
}
#: (test file name, fixture name) -> (kernel family the fixture builds with mla_autograd._build.load_family,
#: roughly how long a build takes)
BUILD_FIXTURES = {
    ("test_sm100_host.py", "fwd"): ("fmha_fwd_sm100", "4 to 10 minutes on 2 cores, cached afterwards"),
    ("test_sm100_host.py", "bwd"): ("fmha_bwd_sm100", "4 to 10 minutes on 2 cores, cached afterwards"),
}


def announce(config, text: str) -> None:
    """One line on the terminal now, through pytest's output capture."""
    line = f"[mla_autograd tests] {text}"
    reporter = config.pluginmanager.get_plugin("terminalreporter")
    if reporter is None:
        print(line, file=sys.__stderr__, flush=True)
        return
    capture = config.pluginmanager.get_plugin("capturemanager")
    with capture.global_and_fixture_disabled() if capture is not None else contextlib.nullcontext():
        writer = getattr(reporter, "_tw", None)
        if getattr(writer, "width_of_current_line", 0):  # after -q's progress dots: a line of its own
            writer.line()
        reporter.write_line(line)


def _family_built(name: str):
    """True if the family is loaded or built in the cache, False if not, None if that cannot be told."""
    try:
        from mla_autograd import _build
        if name in _build._loaded:
            return True
        fam = _build.FAMILIES[name]
        includes, cflags, nvcc = _build._flags(fam, False)
        fp = _build._fingerprint(fam, (includes, cflags, nvcc))
        return (_build.cache_root() / f"{name}-{fp}" / ".built").exists()
    except Exception:  # noqa: BLE001 - only the wording of the announcement depends on it
        return None


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    for suffix, text in SLOW_TESTS.items():
        if item.nodeid.endswith(suffix):
            announce(item.config, f"{item.nodeid}: {text}")


@pytest.hookimpl(tryfirst=True)
def pytest_fixture_setup(fixturedef, request):
    where = os.path.basename(fixturedef.baseid.split("::")[0])
    entry = BUILD_FIXTURES.get((where, fixturedef.argname))
    if entry is None:
        return
    family, duration = entry
    built = _family_built(family)
    if built:
        return
    state = "no cached build" if built is False else "unless already cached"
    announce(request.config, f"{where}: building kernel family {family} for its fixture {fixturedef.argname!r} "
                             f"({state}; {duration})")
