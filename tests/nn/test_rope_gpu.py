"""The rotary embedding's Triton kernel on the GPU: bit-identical to the torch ops it replaces (forward and
gradient; bfloat16/float16/float32, interleaved or rotate_half pairs, strided views of the projections, odd
sequence lengths, position offsets, 1/16/128 heads), rotating the query's heads in place, in the layer (outputs and
every gradient), and under torch.compile(fullgraph=True)."""
import pytest
import torch

from mla_autograd.nn import RotaryEmbedding, apply_rotary
from mla_autograd.testing import assert_bitwise

from rope_cases import LAYOUTS, YARN, check_case, check_layer_compiles, check_layer_paths_agree, check_rotate_heads

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

CUDA = torch.device("cuda")
DTYPES = [torch.bfloat16, torch.float16, torch.float32]
#: DeepSeek-V3's head dims with fewer heads: the attention kernels serve (192, 128)
DEEPSEEK = dict(hidden_size=512, num_heads=16, q_lora_rank=192, kv_lora_rank=512, qk_nope_head_dim=128,
                qk_rope_head_dim=64, v_head_dim=128)


# the key layouts ("k", "packed_k") have no head dim: one head only
_LAYOUT_HEADS = [(layout, H) for layout in LAYOUTS for H in (1, 16, 128)
                 if H == 1 or layout not in ("k", "packed_k")]


@pytest.mark.parametrize("layout,H", _LAYOUT_HEADS)
@pytest.mark.parametrize("interleaved", [True, False])
@pytest.mark.parametrize("dtype", DTYPES)
def test_kernel_equals_torch_ops_bitwise(layout, H, interleaved, dtype):
    """S = 301 (odd, not a multiple of any block), positions from 4000 (a cached continuation), D = 64."""
    check_case(layout, interleaved, dtype, CUDA, B=2, S=301, H=H, D=64, offset=4000)


@pytest.mark.parametrize("D", [2, 6, 8, 128])
@pytest.mark.parametrize("interleaved", [True, False])
def test_kernel_other_rope_dims(D, interleaved):
    """D/2 not a power of two (masked pairs), a single pair, and a wider rope part; one position."""
    for S in (1, 33):
        check_case("q", interleaved, torch.bfloat16, CUDA, B=1, S=S, H=3, D=D, offset=7)


@pytest.mark.parametrize("interleaved", [True, False])
@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
def test_rotate_heads_in_place_equals_rotate(interleaved, packed, dtype):
    """The query's rotation in place (the layer's: 128 nope columns kept of 192, 16 and 128 heads, S = 301):
    the bits of `rotate` forward and backward, the kept columns untouched, a user's gradient never written."""
    for H in (16, 128):
        check_rotate_heads(CUDA, dtype, interleaved=interleaved, packed=packed, B=2, S=301, H=H, keep=128, D=64,
                           offset=4000)


@pytest.mark.parametrize("interleave", [True, False])
@pytest.mark.parametrize("packed", [False, True])
def test_layer_outputs_and_gradients_unchanged(interleave, packed):
    """DeepSeek dims in bfloat16, deterministic backward: the layer with the kernel and with the torch ops
    gives the same bits for its output, d hidden_states and every parameter's gradient."""
    check_layer_paths_agree(CUDA, torch.bfloat16, interleave=interleave, packed=packed, deterministic=True,
                            dims=DEEPSEEK, T=301)


@pytest.mark.parametrize("dtype", DTYPES)
def test_compiled_rotation_equals_eager_bitwise(dtype):
    """Under torch.compile the op is opaque: the compiled rotation (forward, gradient) is the eager kernel's."""
    base = torch.randn(2, 301, 16, 192, device=CUDA, dtype=dtype)
    pos = torch.arange(301, device=CUDA)
    cos, sin = RotaryEmbedding(64, rope_scaling=YARN)(pos)

    def f(b):
        return apply_rotary(b[..., 128:], cos.unsqueeze(-2), sin.unsqueeze(-2), interleaved=True)

    dy = torch.randn(2, 301, 16, 64, device=CUDA, dtype=dtype)
    out = []
    for fn in (f, torch.compile(f, fullgraph=True)):
        b = base.clone().requires_grad_(True)
        y = fn(b)
        y.backward(dy)
        out.append((y.detach(), b.grad))
    assert_bitwise(out[1][0], out[0][0], "forward")
    assert_bitwise(out[1][1], out[0][1], "gradient")


@pytest.mark.parametrize("interleaved", [True, False])
@pytest.mark.parametrize("dtype", DTYPES)
def test_compiled_rotate_heads_equals_eager_bitwise(interleaved, dtype):
    """rotate_heads on a fresh projection-like tensor under torch.compile (inductor), where it rotates the query
    in place both ways through rotary_heads_: the result and the gradient have the eager call's bits, the kept
    columns pass through untouched. S = 301, 128 heads of 128 + 64 columns, positions from 4000."""
    H, keep, D, S = 128, 128, 64, 301
    rot = RotaryEmbedding(D, rope_scaling=YARN, interleaved=interleaved)
    cos, sin = rot(torch.arange(4000, 4000 + S, device=CUDA))
    base = torch.randn(2, S, H * (keep + D), device=CUDA, dtype=dtype)
    dy = torch.randn(2, S, H, keep + D, device=CUDA, dtype=dtype)

    def f(b):
        q = b * 2  # a fresh tensor (exact), as the projection's output is
        y = rot.rotate_heads(q, cos.unsqueeze(-2), sin.unsqueeze(-2), H, keep=keep, grad_in_place=True)
        return y, (y * dy).sum()  # y's gradient is a fresh tensor (dy * 1), which the backward may overwrite

    out = []
    torch._dynamo.reset()
    for fn in (f, torch.compile(f, fullgraph=True)):
        b = base.clone().requires_grad_(True)
        y, loss = fn(b)
        loss.backward()
        out.append((y.detach(), b.grad))
    assert_bitwise(out[1][0], out[0][0], "forward")
    assert_bitwise(out[1][1], out[0][1], "gradient")
    assert_bitwise(out[1][0][..., :keep], (base * 2).view(2, S, H, keep + D)[..., :keep], "kept columns")


def test_compile_fullgraph_layer_training_step():
    """torch.compile(fullgraph=True) of the layer's training forward with inductor: no graph break, the rotary op
    in the graph, outputs and gradients as eager within bfloat16 rounding."""
    check_layer_compiles(CUDA, torch.bfloat16, "inductor", dims=DEEPSEEK, T=301, tol=2e-2)
