import os
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
