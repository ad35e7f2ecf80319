"""The rotary embedding on the CPU: the torch path equals the formula it has always computed, the
mla_autograd::rotary op's gradient is the transposed rotation (float64 gradcheck), its torch.library wiring
(opcheck, torch.compile), which calls the Triton kernel takes, and the kernel itself under Triton's
interpreter."""
import importlib.util
import subprocess
from pathlib import Path

import pytest
import torch

from mla_autograd.nn import apply_rotary
from mla_autograd.nn import rope as rope_mod
from mla_autograd.testing import assert_bitwise

from rope_cases import LAYOUTS, check_case, reference_rotary, rope_inputs
from triton_interpreter import run_cases_script

CPU = torch.device("cpu")


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("interleaved", [True, False])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float64])
def test_torch_path_equals_the_formula(layout, interleaved, dtype):
    """Forward and gradient (with respect to the projection x is a view of), bit for bit."""
    check_case(layout, interleaved, dtype, CPU, B=2, S=7, H=3, D=8, offset=4090)


def _tables(*shape, seed=0):
    """cos/sin float64 that are not a rotation's (c**2 + s**2 != 1): the transpose is then told apart from
    the inverse."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g, dtype=torch.float64), torch.randn(*shape, generator=g, dtype=torch.float64)


@pytest.mark.parametrize("interleaved", [True, False])
@pytest.mark.parametrize("inverse", [False, True])
def test_op_gradcheck_float64(interleaved, inverse):
    """The op's registered backward (the op with `inverse` flipped) through the eager Function and through the
    op itself, first and second order, on a strided x with cos/sin broadcast over the heads."""
    base = torch.randn(2, 5, 3, 4 + 6, dtype=torch.float64, requires_grad=True)
    cos, sin = _tables(5, 1, 3)

    def eager(b):
        return rope_mod._rotary(b[..., 4:], cos, sin, interleaved, inverse)

    def op(b):
        return rope_mod.rotary_op(b[..., 4:], cos, sin, interleaved, inverse)

    for f in (eager, op):
        assert torch.autograd.gradcheck(f, (base,))
        assert torch.autograd.gradgradcheck(f, (base,))


@pytest.mark.parametrize("interleaved", [True, False])
def test_op_body_on_cpu_equals_the_formula(interleaved):
    """The op's torch body: forward as reference_rotary, inverse as reference_rotary's gradient, bit for bit."""
    base, x, cos, sin = rope_inputs("q", B=2, S=5, H=3, D=8, dtype=torch.bfloat16, device=CPU, offset=3)
    y = rope_mod.rotary_op(x.detach(), cos, sin, interleaved, False)
    assert_bitwise(y, reference_rotary(x.detach(), cos, sin, interleaved), "forward")
    dy = torch.randn(y.shape).to(torch.bfloat16)
    xr = x.detach().requires_grad_(True)
    (want,) = torch.autograd.grad(reference_rotary(xr, cos, sin, interleaved), xr, dy)
    assert_bitwise(rope_mod.rotary_op(dy, cos, sin, interleaved, True), want, "inverse")


@pytest.mark.parametrize("inverse", [False, True])
def test_opcheck(inverse):
    x = torch.randn(2, 5, 3, 12)[..., 4:]  # a strided view
    cos, sin = (t.float() for t in _tables(5, 1, 4))
    torch.library.opcheck(torch.ops.mla_autograd.rotary.default, (x, cos, sin, True, inverse))
    xg = torch.randn(4, 6, dtype=torch.float64, requires_grad=True)
    c, s = _tables(4, 3)
    torch.library.opcheck(torch.ops.mla_autograd.rotary.default, (xg, c, s, False, inverse))


def test_compile_fullgraph_op():
    """The op under torch.compile(fullgraph=True): one node, its fake gives the shape, its autograd the
    gradient; the same values as eager."""
    base = torch.randn(2, 7, 3, 24)
    cos, sin = (t.float() for t in _tables(7, 1, 4))

    def f(b):
        return rope_mod._rotary(b[..., 16:], cos, sin, True, False).square().sum()

    graphs = []

    def backend(gm, inputs):
        graphs.append(str(gm.graph))
        from torch._dynamo.backends.debugging import aot_eager
        return aot_eager(gm, inputs)

    b1, b2 = base.clone().requires_grad_(True), base.clone().requires_grad_(True)
    torch._dynamo.reset()
    loss = torch.compile(f, fullgraph=True, backend=backend)(b1)
    loss.backward()
    ref = f(b2)
    ref.backward()
    assert any("mla_autograd.rotary" in g for g in graphs), graphs
    torch.testing.assert_close(loss, ref, rtol=0, atol=0)
    torch.testing.assert_close(b1.grad, b2.grad, rtol=0, atol=0)


def test_which_calls_the_kernel_takes(monkeypatch):
    """With the CPU counted as the kernel's device (as under the interpreter): what the kernel takes, and that
    apply_rotary keeps everything else, and cos/sin that need a gradient, on the torch path."""
    monkeypatch.setattr(rope_mod, "_KERNEL_DEVICE_TYPES", ("cpu",))
    takes = rope_mod._kernel_takes
    x = torch.randn(2, 5, 3, 8)
    c = torch.randn(5, 1, 4)
    assert takes(x, c, c) and takes(x.bfloat16(), c, c) and takes(x.half(), c, c)
    assert takes(x[..., 0, :], c[:, 0], c[:, 0]) and takes(x[0, 0, 0], c[0, 0], c[0, 0])  # rank 3, rank 1
    assert takes(x, torch.randn(2, 5, 1, 4).expand(2, 5, 3, 4), torch.randn(2, 5, 3, 4))  # one shape, any strides
    assert not takes(x.double(), c, c)                              # float64: torch path
    assert not takes(x, c.double(), c.double())                     # tables not float32
    assert not takes(x, c, c[..., :3])                              # cos and sin of different shapes
    assert not takes(x, torch.randn(5, 1, 3), torch.randn(5, 1, 3))  # not D/2 angles
    assert not takes(x[..., :7], torch.randn(5, 1, 3), torch.randn(5, 1, 3))  # odd D
    assert not takes(x[None], c, c)                                 # rank 5
    assert not takes(x[:, :1], c, c)                                # cos would broadcast x's shape up
    assert not takes(x[:0], c, c)                                   # empty
    assert takes(x, torch.randn(5, 1, 2), torch.randn(5, 1, 2), keep=4)  # 4 columns kept, 2 pairs rotated
    assert not takes(x, c, c, keep=2) and not takes(x, torch.randn(5, 1, 1), torch.randn(5, 1, 1), keep=5)  # D - keep: 2 pairs; odd
    assert not takes(x, c, c, keep=8)                               # nothing left to rotate
    monkeypatch.setattr(rope_mod, "_KERNEL_DEVICE_TYPES", ())
    assert not takes(x, c, c)
    monkeypatch.setattr(rope_mod, "_KERNEL_DEVICE_TYPES", ("cpu",))
    # the op's body would launch the kernel (outside the interpreter, not on CPU tensors): a stand-in
    monkeypatch.setattr(rope_mod, "_rotary_impl", lambda x, cos, sin, interleaved, inverse, keep: torch.zeros_like(x))
    xr = x.clone().requires_grad_(True)
    assert type(apply_rotary(xr, c, c, interleaved=True).grad_fn).__name__ == "_EagerRotaryBackward"
    cr = c.clone().requires_grad_(True)
    y = apply_rotary(xr, cr, c, interleaved=True)  # cos needs a gradient: torch ops, which give it one
    assert type(y.grad_fn).__name__ == "CatBackward0"  # float32: the last op is the half-split cat
    y.sum().backward()
    assert cr.grad is not None


def test_which_calls_rotate_heads_rotates_in_place(monkeypatch):
    """rotate_heads rotates in place only what the kernel takes, and only a fresh result of an op: never a leaf
    that requires grad, an autograd view, a tensor the heads do not divide, or with tables that need a gradient;
    the rest take `rotate` (a new tensor, the same values: tests/nn/rope_cases.check_rotate_heads)."""
    monkeypatch.setattr(rope_mod, "_KERNEL_DEVICE_TYPES", ("cpu",))
    takes = rope_mod.RotaryEmbedding._rotates_in_place
    leaf = torch.randn(2, 5, 3 * 24, requires_grad=True)
    c = torch.randn(5, 1, 4)
    x = leaf * 1
    assert takes(x, c, c, 3, 16) and takes(x.detach().clone(), c, c, 3, 16)
    assert takes(torch.randn(10, 3 * 24).bfloat16(), torch.randn(10, 1, 4), torch.randn(10, 1, 4), 3, 16)  # packed
    assert not takes(leaf, c, c, 3, 16)                        # a leaf that requires grad
    assert not takes(x[..., :], c, c, 3, 16)                   # an autograd view
    assert not takes(torch.empty_strided((2, 5, 72), (720, 144, 2)), c, c, 3, 16)  # last stride 2
    assert not takes(x, c, c, 5, 16)                           # 72 columns are not 5 heads
    assert not takes(x, c, c, 3, 17)                           # odd rotary width
    assert not takes(x.double(), c, c, 3, 16)                  # float64: torch path
    assert not takes(x, c.clone().requires_grad_(True), c, 3, 16)
    with monkeypatch.context() as traced:  # under torch.compile a view's mutation is functionalized: taken
        traced.setattr(torch.compiler, "is_compiling", lambda: True)
        assert takes(x[..., :], c, c, 3, 16) and not takes(leaf, c, c, 3, 16)
    monkeypatch.setattr(rope_mod, "_KERNEL_DEVICE_TYPES", ())
    assert not takes(x, c, c, 3, 16)
    rot = rope_mod.RotaryEmbedding(8)
    for heads in (5, 0, True, 3.0):
        with pytest.raises(ValueError, match="rotate_heads: heads"):
            rot.rotate_heads(x, c, c, heads, keep=16)


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton (ships with torch)")
def test_triton_kernel_under_the_interpreter():
    """The Triton kernel itself, run on CPU tensors by Triton's interpreter in a fresh process (the interpreter
    is chosen when the kernel module is imported): bit-identical to the torch ops for float32/float16 through
    apply_rotary and the layer, and for bfloat16 into float32 outputs (see rope_cases.interpreter_main)."""
    run_cases_script("rope_cases.py")


ROWS_PER_PROGRAM = 32  # what `rotate` picks for the layer's query: 8192 elements // (128 kept + 64), a power of 2


def _compile_for_sm90(x_interleaved: bool, out_interleaved: bool, negate_sin: bool, in_place: bool = False,
                      keep: int = 128):
    """The kernel compiled ahead of time for an H100/H200 (sm_90; no GPU needed) as `rotate` launches it on the
    layer's bfloat16 query (128 nope columns kept, D = 64 roped, unit last strides, 16-byte aligned rows):
    Triton's compiled kernel, with .asm["ptx"] and .asm["cubin"]."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from mla_autograd.nn import _rope_triton as K
    fn = K._rotary_kernel
    consts = dict(HALF=32, BLOCK_R=ROWS_PER_PROGRAM, BLOCK_P=32, X_INTERLEAVED=x_interleaved,
                  OUT_INTERLEAVED=out_interleaved, NEGATE_SIN=negate_sin, KEEP=keep,
                  BLOCK_K=keep or 1, IN_PLACE=in_place, sx3=1, sc3=1, ss3=1, so3=1)
    ptr = {"x_ptr": "*bf16", "out_ptr": "*bf16", "cos_ptr": "*fp32", "sin_ptr": "*fp32"}
    sig = {n: "constexpr" if n in consts else ptr.get(n, "i32") for n in fn.arg_names}
    # pointers and the row strides of x and out 16-byte aligned, as Triton specializes them at a launch
    aligned = [(fn.arg_names.index(n),) for n in ("x_ptr", "out_ptr", "cos_ptr", "sin_ptr", "sx0", "sx1", "sx2", "so0",
                                                  "so1", "so2")]
    src = ASTSource(fn, sig, constexprs={(fn.arg_names.index(n),): v for n, v in consts.items()},
                    attrs={a: [["tt.divisibility", 16]] for a in aligned})
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(K.LAUNCH_OPTIONS))


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton (ships with torch)")
@pytest.mark.parametrize("direction", ["forward", "backward"])
def test_kernel_in_place_orders_every_load_before_any_store(direction):
    """The in-place launch (out is x, rotate_heads' query): the thread that stores an element is not always the
    one that loaded it, so the kernel puts a barrier of the whole program between its loads and its stores, one
    more than the out-of-place kernel has (Triton's own layout conversions bring barriers of their own)."""
    flags = (True, False, False) if direction == "forward" else (False, True, True)
    def barrier_between_loads_and_stores(ptx: str) -> bool:
        body = ptx[ptx.index(".entry"):]
        first_store = body.index("st.global")
        last_load = body.rfind("ld.global", 0, first_store)
        assert body.find("ld.global", first_store) < 0, "a global load after a global store"
        return "bar.sync" in body[last_load:first_store]

    in_place = _compile_for_sm90(*flags, in_place=True, keep=0).asm["ptx"]
    assert barrier_between_loads_and_stores(in_place)
    # the in-place kernel's own barrier, beside those of Triton's layout conversions (which the out-of-place one has)
    assert in_place.count("bar.sync") == _compile_for_sm90(*flags, keep=0).asm["ptx"].count("bar.sync") + 1


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton (ships with torch)")
@pytest.mark.parametrize("direction", ["forward", "backward"])
def test_kernel_compiles_for_sm90_without_fused_multiply_adds(direction, tmp_path):
    """Through Triton's real compiler and ptxas: the kernel builds, every multiply, add and subtraction is its own
    rounded instruction (no FMA in the PTX nor FFMA in the SASS, which would round x1 * c - x2 * s once where the
    torch ops round twice), and the result is rounded to bfloat16 to nearest even (cvt.rn)."""
    flags = (True, False, False) if direction == "forward" else (False, True, True)
    k = _compile_for_sm90(*flags)
    ptx = k.asm["ptx"]
    assert "fma." not in ptx
    from mla_autograd.nn._rope_triton import LAUNCH_OPTIONS
    pairs_per_thread = ROWS_PER_PROGRAM * 32 // (32 * LAUNCH_OPTIONS["num_warps"])
    assert ptx.count("mul.rn.f32") == 4 * pairs_per_thread and "cvt.rn.bf16" in ptx  # 4 products a pair
    # rows read and written as 16-byte vectors (the interleaved pairs too): what makes it run at memory speed
    assert "ld.global.v4.b32" in ptx and "st.global.v4.b32" in ptx
    nvdisasm = Path(importlib.util.find_spec("triton").origin).parent / "backends" / "nvidia" / "bin" / "nvdisasm"
    if nvdisasm.exists():
        cubin = tmp_path / "rotary.cubin"
        cubin.write_bytes(k.asm["cubin"])
        sass = subprocess.run([str(nvdisasm), str(cubin)], capture_output=True, text=True, check=True).stdout
        assert "FFMA" not in sass and "FMUL" in sass
