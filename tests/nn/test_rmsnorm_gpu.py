"""RMSNorm's Triton kernels on the GPU against the torch ops they replace (bfloat16/float16/float32; the layer's
widths 1536 and 512 and DeepSeek-V3's hidden size 7168; contiguous rows, a column slice of a wider projection,
every other row): y bit-identical given the kernel's rstd and within rmsnorm_cases.Y_ULPS of the torch ops', bit
for bit where the sum of squares is exact, dx and d weight within twice the torch ops' error against float64;
and the layer's outputs and gradients with the kernels within twice the error of the layer on the torch ops."""
import pytest
import torch

from rmsnorm_cases import (LAYOUTS, check_case, check_double_backward, check_exact_case, check_layer_paths,
                           check_partial_grads, check_strided_gradients)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

CUDA = torch.device("cuda")
DTYPES = [torch.bfloat16, torch.float16, torch.float32]
#: q_a_layernorm's rows in a DeepSeek-V3 training step (B=1, S=4096), kv_a_layernorm's with an odd row count, and
#: a decoder's input norm at hidden 7168 (one program a row)
SHAPES = [(1, 4096, 1536), (2, 37, 512), (3, 5, 7168)]
#: DeepSeek-V3's head dims with fewer heads: the attention kernels serve (192, 128)
DEEPSEEK = dict(hidden_size=512, num_heads=16, q_lora_rank=192, kv_lora_rank=512, qk_nope_head_dim=128,
                qk_rope_head_dim=64, v_head_dim=128)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_kernels_against_torch_ops(shape, layout, dtype):
    check_case(layout, shape, dtype, CUDA)


@pytest.mark.parametrize("shape", SHAPES + [(4, 9, 100), (13, 7)])
@pytest.mark.parametrize("dtype", DTYPES)
def test_exact_sums_bit_identical(shape, dtype):
    """Sums of squares exact in any order: y bit-identical to the torch ops for every width, since torch's CUDA
    mean multiplies the float32 sum by float32(1/N) as the kernel does (for row counts times N exact in float32,
    as here) and both take rsqrt.approx.f32."""
    for layout in ("contiguous", "column_slice"):
        check_exact_case(layout, shape, dtype, CUDA)


@pytest.mark.parametrize("dtype", DTYPES)
def test_only_the_gradients_asked_for(dtype):
    check_partial_grads((2, 37, 512), dtype, CUDA)


@pytest.mark.parametrize("dtype", DTYPES)
def test_strided_upstream_gradients(dtype):
    for shape in ((1, 37, 512), (2, 37, 512), (301, 1536)):
        check_strided_gradients(shape, dtype, CUDA)


def test_double_backward_as_torch_ops():
    check_double_backward((2, 37, 512), torch.bfloat16, CUDA)


@pytest.mark.parametrize("packed", [False, True])
def test_layer_with_kernels_within_2x_of_torch_norms(packed):
    """DeepSeek dims in bfloat16 (attention and rotary on their kernels too): outputs, d hidden_states and every
    parameter's gradient against a float64 twin."""
    check_layer_paths(CUDA, torch.bfloat16, dims=DEEPSEEK, T=301, packed=packed)
