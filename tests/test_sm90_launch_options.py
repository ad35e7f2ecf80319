"""The SM90 families' test-only launch options (fwd_with_options / bwd_with_options): every bad options
dict is refused with an error naming the entry point and the key, before anything else is read. Runs on a
CPU: the options are parsed before the tensors are looked at (the modules build with nvcc, no GPU)."""
import shutil

import pytest
import torch

from mla_autograd._build import family_available, load_family

for _fam in ("fmha_fwd_sm90", "fmha_bwd_sm90"):
    _ok, _why = family_available(_fam)
    if not _ok:
        pytest.skip(f"cannot build {_fam} here: {_why}", allow_module_level=True)
if shutil.which("nvcc") is None:
    pytest.skip("nvcc not found", allow_module_level=True)

BAD = [
    ({1: 2}, "options keys must be strings"),
    ({"l2_group": True}, r"options\['l2_group'\] must be an int"),
    ({"l2_group": 1.5}, r"options\['l2_group'\] must be an int"),
    ({"l2_group": -1}, r"options\['l2_group'\] must be in \[0, 2\^31\), got -1"),
    ({"l2_group": 2 ** 31}, r"options\['l2_group'\] must be in \[0, 2\^31\)"),
    ({"stages": 2}, "unknown option 'stages'"),
]


def _tensors():
    t = torch.zeros(1, 8, 1, 64, dtype=torch.bfloat16)
    lse = torch.zeros(1, 1, 8)
    return t, lse


@pytest.mark.parametrize("options,match", BAD + [({"ctas": True}, r"options\['ctas'\] must be an int"),
                                                 ({"ctas": -2}, r"options\['ctas'\] must be in \[0, 2\^31\), got -2"),
                                                 ({"dynamic": 1}, r"options\['dynamic'\] must be a bool"),
                                                 ({"wide_keys": 0}, r"options\['wide_keys'\] must be a bool"),
                                                 ({"longest_first": 1}, r"options\['longest_first'\] must be a bool"),
                                                 ({"staged_epilogue": 1},
                                                  r"options\['staged_epilogue'\] must be a bool")])
def test_fwd_options_refused(options, match):
    t, lse = _tensors()
    with pytest.raises(RuntimeError, match="fmha_fwd_sm90: " + match):
        load_family("fmha_fwd_sm90").fwd_with_options(t, t, t, t, lse, None, None, 8, 8, 0.125, False, True, options)


@pytest.mark.parametrize("options,match", BAD + [({"poison_workspace": 1}, r"options\['poison_workspace'\] must be a bool"),
                                                 ({"longest_first": 0}, r"options\['longest_first'\] must be a bool"),
                                                 ({"dq_wg_barriers": 1}, r"options\['dq_wg_barriers'\] must be a bool"),
                                                 ({"zero_whole_grads": "yes"},
                                                  r"options\['zero_whole_grads'\] must be a bool")])
def test_bwd_options_refused(options, match):
    t, lse = _tensors()
    with pytest.raises(RuntimeError, match="fmha_bwd_sm90: " + match):
        load_family("fmha_bwd_sm90").bwd_with_options(t, t, t, t, t, lse, t, t, t, None, None, 8, 8, 0.125, False,
                                                      True, False, options)
