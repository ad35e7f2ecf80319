"""The public API on a GPU: the dispatch table routes to the kernels, and a whole training step
through autograd matches the reference path's gradients (the rule: error <= 2x plain PyTorch's)."""
import pytest
import torch

import mla_autograd as M
from mla_autograd.testing import assert_error_within, naive_attention

pytestmark = pytest.mark.gpu

DIMS = [(192, 128), (128, 128), (64, 64)]


def _has_cap(major, minor=None):
    if not torch.cuda.is_available():
        return False
    cap = torch.cuda.get_device_capability()
    return cap[0] == major and (minor is None or cap[1] == minor)


@pytest.mark.skipif(not _has_cap(9, 0), reason="SM90 kernels need compute capability 9.0")
@pytest.mark.parametrize("dims", DIMS)
def test_dispatch_picks_sm90(dims):
    q = torch.randn(1, 8, 2, dims[0], device="cuda", dtype=torch.bfloat16)
    v = torch.randn(1, 8, 2, dims[1], device="cuda", dtype=torch.bfloat16)
    e = M.explain(q, q, v, causal=True)
    assert e.forward.backend == "sm90", str(e)
    assert e.backward.backend == "sm90", str(e)


@pytest.mark.parametrize("dims", DIMS)
@pytest.mark.parametrize("causal,align", [(False, "bottom_right"), (True, "top_left"), (True, "bottom_right")])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_training_step_matches_reference(dims, causal, align, dtype):
    """loss.backward through the public API (whatever backend serves it) vs the float32 reference."""
    B, Sq, Sk, Hq, Hkv = 2, 177, 241, 8, 2
    dqk, dv = dims
    g = torch.Generator(device="cuda").manual_seed(1)
    q = torch.randn(B, Sq, Hq, dqk, device="cuda", dtype=dtype, generator=g).requires_grad_()
    k = torch.randn(B, Sk, Hkv, dqk, device="cuda", dtype=dtype, generator=g).requires_grad_()
    v = torch.randn(B, Sk, Hkv, dv, device="cuda", dtype=dtype, generator=g).requires_grad_()
    w = torch.randn(B, Sq, Hq, dv, device="cuda", dtype=torch.float32, generator=g)
    br = align == "bottom_right"

    def loss_of(out):
        return (out.float() * w).sum()

    out = M.attention(q, k, v, causal=causal, causal_align=align)
    grads = torch.autograd.grad(loss_of(out), (q, k, v))

    qf, kf, vf = (t.detach().float().requires_grad_() for t in (q, k, v))
    ref = naive_attention(qf, kf, vf, causal=causal, bottom_right=br)
    ref_grads = torch.autograd.grad(loss_of(ref), (qf, kf, vf))
    low = naive_attention(q, k, v, causal=causal, bottom_right=br)
    low_grads = torch.autograd.grad(loss_of(low), (q, k, v))

    assert_error_within(out, ref, low, name="out")
    for name, a, r, b in zip(("dq", "dk", "dv"), grads, ref_grads, low_grads):
        assert_error_within(a, r, b, name=name, factor=2.0, eps=1e-4)
