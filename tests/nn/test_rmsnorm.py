"""RMSNorm on the CPU: which calls its Triton kernels take, how RMSNorm routes calls (the kernels' autograd
Function for eager tensors that need a gradient, the forward kernel alone without autograd, the torch ops under
torch.compile and for tensor subclasses), the Function's gradient and double backward (float64 gradcheck with
the kernels' formulas as torch ops in their place), the kernels themselves under Triton's interpreter, and
their build for an H100 (sm_90)."""
import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from mla_autograd.nn import RMSNorm
from mla_autograd.nn import mla as mla_mod
from mla_autograd.testing import assert_bitwise

from rmsnorm_cases import kernel_formulas_backward, kernel_formulas_forward, torch_rms_norm
from triton_interpreter import run_cases_script

ROOT = Path(__file__).resolve().parents[2]
needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton (ships with torch)")


def test_which_calls_the_kernels_take(monkeypatch):
    """With the CPU counted as the kernels' device (as under the interpreter): x of rank >= 1 in bfloat16/float16/
    float32 with unit last stride whose leading dims flatten in place, up to 8192 wide, a weight of x's dtype,
    device and width; everything else on the torch path."""
    monkeypatch.setattr(mla_mod, "_NORM_KERNEL_DEVICE_TYPES", ("cpu",))
    takes = mla_mod._norm_kernel_takes
    x = torch.randn(2, 6, 40)
    w = torch.randn(40)
    assert takes(x, w) and takes(x.bfloat16(), w.bfloat16()) and takes(x.half(), w.half())
    assert takes(x[0, 0], w) and takes(x[0], w) and takes(x[None, :, None], w)      # rank 1, 2, 5
    base = torch.randn(2, 6, 64)
    assert takes(base[..., 8:48], w)                       # a column slice: rows 64 apart, read in place
    assert takes(torch.randn(2, 12, 40)[:, ::2], w)        # every other row: still one row stride
    assert takes(torch.randn(12, 2, 40)[::2].transpose(0, 1)[:1], w)  # leading size-1 dims do not matter
    assert takes(x, torch.randn(80)[::2])                  # the weight is read through its stride
    assert takes(torch.randn(3, 1)[:, :1], torch.randn(1))  # one column
    assert takes(torch.randn(4, 8192), torch.randn(8192))
    assert not takes(torch.randn(4, 8193), torch.randn(8193))  # wider than the kernels' rows
    assert not takes(torch.randn(6, 2, 40).transpose(0, 1), w)  # leading dims do not flatten without a copy
    assert not takes(torch.randn(2, 6, 80)[..., ::2], w)   # last stride 2
    assert not takes(x.double(), w.double())               # float64: torch path
    assert not takes(x, w.double()) and not takes(x.bfloat16(), w)  # the weight in another dtype
    assert not takes(x, torch.randn(39)) and not takes(x, torch.randn(1, 40))  # the weight's shape
    assert not takes(x, torch.empty(40, device="meta"))    # the weight on another device
    assert not takes(x[:0], w) and not takes(torch.randn(()), torch.randn(1))  # empty, rank 0
    monkeypatch.setattr(mla_mod, "_NORM_KERNEL_DEVICE_TYPES", ())
    assert not takes(x, w)
    monkeypatch.setattr(mla_mod, "_NORM_KERNEL_DEVICE_TYPES", ("cpu",))
    monkeypatch.setattr(mla_mod, "_HAS_TRITON", False)
    assert not takes(x, w)


def test_rows_stride():
    rows = mla_mod._rows_stride
    assert rows(torch.randn(2, 3, 5)) == 5 and rows(torch.randn(7)) == 7
    assert rows(torch.randn(2, 3, 9)[..., 2:7]) == 9
    assert rows(torch.randn(2, 6, 5)[:, ::2]) == 10
    assert rows(torch.randn(3, 2, 5).transpose(0, 1)) is None
    assert rows(torch.randn(5).expand(4, 3, 5)) == 0       # an expanded tensor: every row the same memory
    for t in (torch.randn(2, 3, 9)[..., 2:7], torch.randn(2, 6, 5)[:, ::2], torch.randn(1, 4, 1, 5)[:, 1:3]):
        assert t.view(-1, t.shape[-1]).stride(0) == rows(t)  # what torch's view gives


@pytest.fixture
def stand_ins(monkeypatch):
    """The CPU counted as the kernels' device, float64 taken too, and the kernels' formulas as torch ops in their
    place (they would launch the kernels, which outside the interpreter cannot run on CPU tensors). Returns the
    list of (which, arguments) calls."""
    calls = []
    monkeypatch.setattr(mla_mod, "_NORM_KERNEL_DEVICE_TYPES", ("cpu",))
    monkeypatch.setattr(mla_mod, "_NORM_KERNEL_DTYPES", mla_mod._NORM_KERNEL_DTYPES + (torch.float64,))

    def forward(x, weight, eps, need_rstd):
        calls.append(("forward", need_rstd))
        return kernel_formulas_forward(x, weight, eps, need_rstd)

    def backward(dy, x, weight, rstd, need_dx, need_dw):
        calls.append(("backward", need_dx, need_dw))
        return kernel_formulas_backward(dy, x, weight, rstd, need_dx, need_dw)

    monkeypatch.setattr(mla_mod, "_rms_norm_kernel", forward)
    monkeypatch.setattr(mla_mod, "_rms_norm_kernel_backward", backward)
    return calls


def _norm(n, dtype=torch.float32, seed=0):
    m = RMSNorm(n).to(dtype)
    with torch.no_grad():
        m.weight.copy_(1.0 + 0.1 * torch.randn(n, generator=torch.Generator().manual_seed(seed), dtype=dtype))
    return m


def test_routing(stand_ins):
    """Eager tensors that need a gradient take the Function (forward kernel storing rstd, backward kernel with
    only the gradients asked for); without autograd the forward kernel alone; the weight's Parameter counts as a
    plain tensor, an x of a tensor subclass does not."""
    m = _norm(24)
    x = torch.randn(3, 5, 24, requires_grad=True)
    y = m(x)
    assert type(y.grad_fn).__name__ == "_FusedRMSNormBackward"
    y.sum().backward()  # an expanded gradient (stride 0)
    assert stand_ins == [("forward", True), ("backward", True, True)]
    stand_ins.clear()
    m(x.detach()).backward(torch.randn(3, 5, 24))  # x needs no gradient: the weight's alone
    assert stand_ins == [("forward", True), ("backward", False, True)] and m.weight.grad is not None
    stand_ins.clear()
    m.weight.requires_grad_(False)
    m(x).backward(torch.randn(3, 5, 24))
    assert stand_ins == [("forward", True), ("backward", True, False)]
    m.weight.requires_grad_(True)
    stand_ins.clear()
    with torch.no_grad():
        assert m(x).grad_fn is None
    with torch.inference_mode():
        m(x)
    assert stand_ins == [("forward", False), ("forward", False)]
    stand_ins.clear()

    class Sub(torch.Tensor):
        pass

    y = m(x.detach().as_subclass(Sub))
    assert stand_ins == [] and type(y) is Sub
    m(x.double())  # the module's weight is float32: another dtype, the torch ops (whose promotion gives float64)
    assert stand_ins == []


def test_compiled_module_uses_the_torch_ops(stand_ins):
    """Under torch.compile the torch ops are traced (Inductor fuses them; the kernels would break the graph):
    no kernel call, the eager torch path's values."""
    m = _norm(24)
    x = torch.randn(3, 5, 24)
    torch._dynamo.reset()
    y = torch.compile(m, fullgraph=True, backend="aot_eager")(x)
    assert stand_ins == []
    assert_bitwise(y.detach(), torch_rms_norm(x, m.weight, m.variance_epsilon).detach(), "compiled")


def test_function_gradcheck_float64(stand_ins):
    """The Function's backward (the kernels' formulas in float64) is the gradient of its forward, with x a column
    slice and an odd width: first order through the kernels' formulas, second order through the torch ops the
    backward recomputes under create_graph."""
    m = _norm(7, torch.float64)
    base = torch.randn(2, 3, 11, dtype=torch.float64, requires_grad=True)
    w = m.weight

    def f(b, weight):
        return mla_mod._FusedRMSNorm.apply(b[..., 2:9], weight, 1e-6)

    assert torch.autograd.gradcheck(f, (base, w))
    assert torch.autograd.gradgradcheck(f, (base, w))
    assert ("backward", True, True) in stand_ins


def test_state_dict_and_repr_unchanged():
    m = RMSNorm(12, eps=1e-5)
    assert list(m.state_dict()) == ["weight"] and isinstance(m.weight, nn.Parameter)
    assert repr(m) == "RMSNorm((12,), eps=1e-05)"


@needs_triton
def test_width_limit_agrees_with_the_kernel_module():
    from mla_autograd.nn import _rmsnorm_triton
    assert mla_mod._NORM_KERNEL_MAX_N == _rmsnorm_triton.MAX_N


def test_import_does_not_import_triton():
    code = "import sys, mla_autograd.nn; assert 'triton' not in sys.modules, 'triton imported'"
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr


@needs_triton
def test_kernels_under_the_interpreter():
    """The Triton kernels themselves, run on CPU tensors by Triton's interpreter in a fresh process (the
    interpreter is chosen when the kernel module is imported), float32/float16: see
    rmsnorm_cases.interpreter_main."""
    run_cases_script("rmsnorm_cases.py")


def _compile_for_sm90(direction: str, n: int, dtype: str):
    """A kernel compiled ahead of time for an H100/H200 (sm_90; no GPU needed) as the launches specialize it for
    4096 rows of n columns of `dtype` ("bf16", "fp32") with 16-byte aligned rows and unit strides: Triton's
    compiled kernel, with .asm["ptx"] and .asm["cubin"]."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from mla_autograd.nn import _rmsnorm_triton as K
    block_rows, block_n, num_warps = K._blocks(4096, n)
    if direction == "forward":
        fn = K._rms_norm_fwd_kernel
        consts = dict(N=n, BLOCK_ROWS=block_rows, BLOCK_N=block_n, STORE_RSTD=True, sw=1)
        ptrs = dict(x_ptr=dtype, w_ptr=dtype, y_ptr=dtype, rstd_ptr="fp32")
        aligned = ("x_ptr", "w_ptr", "y_ptr", "rstd_ptr", "sxm")
    else:
        fn = K._rms_norm_bwd_kernel
        consts = dict(N=n, BLOCK_ROWS=block_rows, BLOCK_N=block_n, COMPUTE_DX=True, COMPUTE_DW=True, sw=1, sdyn=1)
        ptrs = dict(dy_ptr=dtype, x_ptr=dtype, w_ptr=dtype, rstd_ptr="fp32", dx_ptr=dtype, dw_ptr="fp32")
        aligned = ("dy_ptr", "x_ptr", "w_ptr", "rstd_ptr", "dx_ptr", "dw_ptr", "sdym", "sxm")
    types = {**{k: f"*{v}" for k, v in ptrs.items()}, "eps": "fp32", "inv_n": "fp32"}
    sig = {a: "constexpr" if a in consts else types.get(a, "i32") for a in fn.arg_names}
    src = ASTSource(fn, sig, constexprs={(fn.arg_names.index(a),): v for a, v in consts.items()},
                    attrs={(fn.arg_names.index(a),): [["tt.divisibility", 16]] for a in aligned})
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(K.LAUNCH_OPTIONS, num_warps=num_warps))


@needs_triton
@pytest.mark.parametrize("direction", ["forward", "backward"])
@pytest.mark.parametrize("n,dtype", [(1536, "bf16"), (512, "bf16"), (7168, "bf16"), (8192, "fp32"), (100, "fp16")])
def test_kernels_compile_for_sm90(direction, n, dtype, tmp_path):
    """Through Triton's real compiler and ptxas, at the layer's widths, the widest rows and an odd width: each
    kernel builds, keeps every product rounded before it is added (no FMA in the PTX), rounds to 16-bit dtypes to
    nearest even (cvt.rn), takes the reciprocal square root as PyTorch's CUDA rsqrt does (rsqrt.approx.f32,
    without flushing subnormals), reads rows in vectors (16 bytes where a row's bytes are a multiple of 16, else 8
    for 100 halves), and fits its registers (ptxas reports no spills)."""
    k = _compile_for_sm90(direction, n, dtype)
    ptx = k.asm["ptx"]
    assert "fma." not in ptx
    row_bytes = n * (4 if dtype == "fp32" else 2)
    assert ("ld.global.v4" if row_bytes % 16 == 0 else "ld.global.v2") in ptx
    if dtype != "fp32":
        ty = dtype.replace("fp", "f")
        assert re.search(rf"cvt\.rn\.{ty}(x2)?\.f32", ptx) and not re.search(rf"cvt\.r[zmp]\.{ty}", ptx)
    if direction == "forward":
        assert re.search(r"rsqrt\.approx\.f32\s", ptx) and "rsqrt.approx.ftz" not in ptx
    ptxas = Path(importlib.util.find_spec("triton").origin).parent / "backends" / "nvidia" / "bin" / "ptxas"
    if ptxas.exists():
        (tmp_path / "k.ptx").write_text(ptx)
        r = subprocess.run([str(ptxas), "-arch=sm_90a", "-v", str(tmp_path / "k.ptx"), "-o", str(tmp_path / "k.cubin")],
                           capture_output=True, text=True)
        assert r.returncode == 0, r.stderr
        report = r.stdout + r.stderr
        assert "0 bytes spill stores" in report and "0 bytes spill loads" in report, report
