"""RMSNorm inputs as the layer hands them to its norms (contiguous, a column slice of a wider projection, every
other row), the torch path and a float64 reference, and the checks that the CPU, interpreter and GPU tests of
RMSNorm's Triton kernels share.

What the checks hold the kernels to (see `check_case` and `check_exact_case`):
- forward: y is bit-identical to the torch ops given the kernel's rstd (``weight * (float32(x) * rstd)`` rounded
  as the torch path rounds); rstd differs from the torch path's only through the order of the float32 sum of
  squares (and, on the CPU, the torch path dividing that sum by N where the kernel multiplies by float32(1/N),
  as torch's CUDA mean does): at most RSTD_RTOL relative. So y is within Y_ULPS of the torch path's y, and
  bit-identical to it for inputs whose sum of squares is exact in any order (`exact_inputs`) where both
  scale the sum alike (on CUDA for every N, on the CPU for N a power of two).
- backward: dx and d weight against autograd through the torch ops in float64: the kernel's error at most
  twice the torch path's in the same precision, plus a floor of one float32 rounding of the largest value.

Run as a script under Triton's interpreter (``TRITON_INTERPRET=1 python tests/nn/rmsnorm_cases.py``, from the
repository root) it runs the kernels on CPU tensors against the torch ops (tests/nn/test_rmsnorm.py does).
"""
from __future__ import annotations

import contextlib
import sys

import torch

from mla_autograd.nn import MultiHeadLatentAttention, RMSNorm
from mla_autograd.nn import mla as mla_mod
from mla_autograd.testing import assert_bitwise, assert_error_within, init_layer_weights

#: How x lies in memory (see norm_inputs); the kernels read each in place.
LAYOUTS = ("contiguous", "column_slice", "every_other_row")
#: rstd against the torch path's: relative, about 32 float32 roundings (the two sums of squares' rounding
#: errors, each at most about (terms a thread adds + log2 N) roundings, plus the reciprocal square root's).
RSTD_RTOL = 2e-6
#: y against the torch path's, in units in the last place of x's dtype: in float32 the rstd difference
#: (RSTD_RTOL, 17 ulps) plus the product's rounding; in bfloat16/float16 the normalized value rounded one ulp
#: apart, which the weight's product can carry to two ulps of y.
Y_ULPS = {torch.float32: 18, torch.float16: 2, torch.bfloat16: 2}


def ulp_distance(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """|a - b| (float64) in units in the last place of a's dtype at the larger of |a|, |b| (subnormal spacing
    below the smallest normal)."""
    fi = torch.finfo(a.dtype)
    a64, b64 = a.double(), b.double()
    mag = torch.maximum(a64.abs(), b64.abs()).clamp_min(fi.tiny)
    return (a64 - b64).abs() / (torch.exp2(torch.floor(torch.log2(mag))) * fi.eps)


def torch_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The torch path (transformers' DeepseekV3RMSNorm), differentiable through its ops."""
    return mla_mod._rms_norm_torch(x, weight, eps)


def torch_rstd(x: torch.Tensor, eps: float) -> torch.Tensor:
    """The torch path's reciprocal root mean square of each row (float32), shape x.shape[:-1]."""
    h = x.to(torch.float32)
    return torch.rsqrt(h.pow(2).mean(-1) + eps)


def kernel_formulas_forward(x: torch.Tensor, weight: torch.Tensor, eps: float,
                            need_rstd: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The forward kernel's formulas as torch ops, in float32 (float64 for float64 x), with the signature of
    mla._rms_norm_kernel: a stand-in for the kernel where none can run (and, in float64, for gradcheck)."""
    cd = torch.float64 if x.dtype == torch.float64 else torch.float32
    n = x.shape[-1]
    xc = x.reshape(-1, n).to(cd)
    inv_n = torch.full((), n, dtype=cd).reciprocal()
    rstd = torch.rsqrt((xc * xc).sum(-1) * inv_n + eps)
    h = (xc * rstd[:, None]).to(x.dtype).to(cd)
    y = (weight.to(cd) * h).to(x.dtype).view(x.shape)
    return y, (rstd if need_rstd else None)


def kernel_formulas_backward(dy, x, weight, rstd, need_dx: bool, need_dw: bool):
    """The backward kernel's formulas as torch ops (see kernel_formulas_forward), with the signature of
    mla._rms_norm_kernel_backward."""
    cd = torch.float64 if x.dtype == torch.float64 else torch.float32
    n = x.shape[-1]
    xc, dyc = x.reshape(-1, n).to(cd), dy.reshape(-1, n).to(cd)
    xhat = xc * rstd[:, None].to(cd)
    dx = dw = None
    if need_dx:
        g = (dyc * weight.to(cd)).to(x.dtype).to(cd)
        c = (g * xhat).sum(-1, keepdim=True) * torch.full((), n, dtype=cd).reciprocal()
        dx = (rstd[:, None].to(cd) * (g - xhat * c)).to(x.dtype).view(x.shape)
    if need_dw:
        dw = (dyc * xhat.to(x.dtype).to(cd)).sum(0).to(weight.dtype)
    return dx, dw


def exact_values(*shape, generator: torch.Generator) -> torch.Tensor:
    """float32 multiples of 1/8 in [-4, 4], each row scaled by a power of two s in [1/8, 8]: exact in bfloat16,
    float16 and float32, and every partial sum of a row's squares (multiples of s**2 / 64 below 16 * N * s**2, at
    most 2**23 steps for rows of up to 8192 columns) is exact in float32, so the sum is the same in any order."""
    k = torch.randint(-32, 33, shape, generator=generator).to(torch.float32) / 8
    scale = torch.exp2(torch.randint(-3, 4, (*shape[:-1], 1), generator=generator).to(torch.float32))
    return k * scale


def norm_inputs(layout: str, shape: tuple, dtype: torch.dtype, device, *, seed: int = 0, exact: bool = False):
    """(base, x_of_base, weight, dy): x = x_of_base(base) of `shape` (..., N), base a leaf of dtype (gradients are
    taken with respect to it), weight (N,) of dtype around 1, dy of `shape` and dtype.

    - "contiguous": x is base.
    - "column_slice": x = base[..., 8:8 + N] of base (..., N + 24), as the layer's latent is the first columns of
      kv_a_proj_with_mqa's output: rows wider than N.
    - "every_other_row": x = base[..., ::2, :] of base (..., 2 * S, N) (1-D shapes: as "contiguous").
    exact: x's values from exact_values (sums of squares exact in any order).
    """
    g = torch.Generator().manual_seed(seed)
    *lead, n = shape
    if layout == "contiguous" or (layout == "every_other_row" and not lead):
        base_shape, x_of_base = shape, (lambda b: b)
    elif layout == "column_slice":
        base_shape, x_of_base = (*lead, n + 24), (lambda b: b[..., 8:8 + n])
    elif layout == "every_other_row":
        base_shape, x_of_base = (*lead[:-1], 2 * lead[-1], n), (lambda b: b[..., ::2, :])
    else:
        raise ValueError(layout)
    values = exact_values(*base_shape, generator=g) if exact else torch.randn(*base_shape, generator=g)
    base = values.to(device, dtype).requires_grad_(True)
    weight = (1.0 + 0.1 * torch.randn(n, generator=g)).to(device, dtype)
    dy = torch.randn(*shape, generator=g).to(device, dtype)
    return base, x_of_base, weight, dy


@contextlib.contextmanager
def kernel_calls(expect_kernel: bool):
    """Counts the kernels' launches through RMSNorm while the block runs; on exit asserts that the forward and the
    backward each ran once on the kernel (expect_kernel) or not at all. With expect_kernel False the kernels'
    device list is emptied, so RMSNorm runs the torch ops."""
    calls = {"forward": 0, "backward": 0}
    fwd, bwd, kept = mla_mod._rms_norm_kernel, mla_mod._rms_norm_kernel_backward, mla_mod._NORM_KERNEL_DEVICE_TYPES

    def counting(name, fn):
        def wrapper(*args, **kwargs):
            calls[name] += 1
            return fn(*args, **kwargs)
        return wrapper

    mla_mod._rms_norm_kernel = counting("forward", fwd)
    mla_mod._rms_norm_kernel_backward = counting("backward", bwd)
    if not expect_kernel:
        mla_mod._NORM_KERNEL_DEVICE_TYPES = ()
    try:
        yield calls
    finally:
        mla_mod._rms_norm_kernel, mla_mod._rms_norm_kernel_backward = fwd, bwd
        mla_mod._NORM_KERNEL_DEVICE_TYPES = kept


def norm_and_grads(layout, shape, dtype, device, eps, *, kernel: bool, exact: bool = False, seed: int = 0):
    """(x, y, d base, d weight) through RMSNorm(N, eps) with norm_inputs' tensors, on the kernels or the torch
    ops (asserting which ran)."""
    base, x_of_base, weight, dy = norm_inputs(layout, shape, dtype, device, seed=seed, exact=exact)
    m = RMSNorm(shape[-1], eps).to(device, dtype)
    with torch.no_grad():
        m.weight.copy_(weight)
    with kernel_calls(kernel) as calls:
        x = x_of_base(base)
        y = m(x)
        dbase, dw = torch.autograd.grad(y, (base, m.weight), dy)
    want = 1 if kernel else 0
    assert calls == {"forward": want, "backward": want}, f"{layout} {shape} {dtype}: kernel calls {calls}"
    return x.detach(), y.detach(), dbase, dw


def reference_grads(layout, shape, dtype, device, eps, *, exact: bool = False, seed: int = 0):
    """(y, d base, d weight) of the torch ops in float64 on norm_inputs' values (the float32 statistics of the
    torch path become float64 ones there), cast to nothing: float64 on the CPU."""
    base, x_of_base, weight, dy = norm_inputs(layout, shape, dtype, device, seed=seed, exact=exact)
    b64 = base.detach().cpu().double().requires_grad_(True)
    w64 = weight.cpu().double().requires_grad_(True)
    y64 = torch_rms_norm(x_of_base(b64), w64, eps)
    db, dw = torch.autograd.grad(y64, (b64, w64), dy.cpu().double())
    return y64.detach(), db, dw


def _floor(ref: torch.Tensor) -> float:
    """The tolerance rule's absolute floor: a float32 ulp of ref's largest magnitude (a float32 gradient summed in
    another order can be that far off where the torch path's happens to be exact)."""
    return 2.0 ** -23 * max(ref.abs().max().item(), 1e-30)


def check_case(layout: str, shape: tuple, dtype: torch.dtype, device, eps: float = 1e-6, seed: int = 0) -> dict:
    """The kernels against the torch ops on norm_inputs(layout, shape, dtype): the forward bit for bit given the
    kernel's rstd, rstd within RSTD_RTOL, y within Y_ULPS, dx and d weight within twice the torch path's error
    against float64 (plus _floor). Returns what it measured (for printing)."""
    name = f"{layout} {shape} {dtype}"
    x, y_k, db_k, dw_k = norm_and_grads(layout, shape, dtype, device, eps, kernel=True, seed=seed)
    _, y_t, db_t, dw_t = norm_and_grads(layout, shape, dtype, device, eps, kernel=False, seed=seed)
    _, db_64, dw_64 = reference_grads(layout, shape, dtype, device, eps, seed=seed)
    weight = norm_inputs(layout, shape, dtype, device, seed=seed)[2]
    assert mla_mod._norm_kernel_takes(x, weight), f"{name}: not served by the kernels"
    assert y_k.is_contiguous() and y_k.shape == x.shape and y_k.dtype == dtype, f"{name}: {y_k.shape} {y_k.stride()}"

    _, rstd = mla_mod._rms_norm_kernel(x, weight, eps, need_rstd=True)
    rstd = rstd.view(x.shape[:-1])
    # y is the torch ops' given the kernel's rstd: h = x * rstd rounded to x's dtype, then weight * h rounded once
    assert_bitwise(y_k, weight * (x.to(torch.float32) * rstd[..., None]).to(dtype), f"{name}: y given rstd")
    rstd_t = torch_rstd(x, eps)
    rstd_err = ((rstd.double() - rstd_t.double()).abs() / rstd_t.double()).max().item()
    assert rstd_err <= RSTD_RTOL, f"{name}: rstd off the torch path's by {rstd_err:.3g} (relative)"
    ulps = ulp_distance(y_k, y_t)
    assert ulps.max().item() <= Y_ULPS[dtype], f"{name}: y {ulps.max().item():g} ulps off the torch path's"
    # without autograd: the forward alone (no rstd stored), the same values
    with torch.no_grad():
        m = RMSNorm(shape[-1], eps).to(device, dtype)
        m.weight.copy_(weight)
        with kernel_calls(True) as calls:
            assert_bitwise(m(x), y_k, f"{name}: y without autograd")
        assert calls == {"forward": 1, "backward": 0}, calls

    # the float64 reference lives on the CPU: compare there
    assert_error_within(db_k.cpu(), db_64, db_t.cpu(), factor=2.0, eps=_floor(db_64), name=f"{name}: dx")
    assert_error_within(dw_k.cpu(), dw_64, dw_t.cpu(), factor=2.0, eps=_floor(dw_64), name=f"{name}: d weight")
    return dict(rstd_rtol=rstd_err, y_ulps=ulps.max().item(), y_differ=int((ulps > 0).sum()), numel=y_k.numel())


def check_exact_case(layout: str, shape: tuple, dtype: torch.dtype, device, eps: float = 1e-6) -> None:
    """exact_values inputs, whose sums of squares do not depend on the order: y bit-identical to the torch ops'
    (the caller picks N so that the torch path scales the sum as the kernel does: see the module docstring)."""
    name = f"{layout} {shape} {dtype} (exact sums)"
    _, y_k, _, _ = norm_and_grads(layout, shape, dtype, device, eps, kernel=True, exact=True)
    _, y_t, _, _ = norm_and_grads(layout, shape, dtype, device, eps, kernel=False, exact=True)
    assert_bitwise(y_k, y_t, f"{name}: y")


def check_partial_grads(shape: tuple, dtype: torch.dtype, device, eps: float = 1e-6) -> None:
    """Only the gradients asked for: x alone or the weight alone requiring grad gives the same bits as both, and
    None for the other."""
    base, x_of_base, weight, dy = norm_inputs("column_slice", shape, dtype, device)
    x = x_of_base(base.detach())
    results = {}
    for which in ("both", "x", "weight"):
        xi = x.clone().requires_grad_(which in ("both", "x"))
        m = RMSNorm(shape[-1], eps).to(device, dtype)
        with torch.no_grad():
            m.weight.copy_(weight)
        m.weight.requires_grad_(which in ("both", "weight"))
        with kernel_calls(True):
            m(xi).backward(dy)
        results[which] = (xi.grad, m.weight.grad)
    assert results["x"][1] is None and results["weight"][0] is None
    assert_bitwise(results["x"][0], results["both"][0], f"{shape} {dtype}: dx with x alone requiring grad")
    assert_bitwise(results["weight"][1], results["both"][1], f"{shape} {dtype}: d weight with the weight alone")


def check_strided_gradients(shape: tuple, dtype: torch.dtype, device, eps: float = 1e-6) -> None:
    """Upstream gradients that are not contiguous give the bits of their contiguous copies: column-major last two
    dims (read through their strides, or copied once where the leading dims do not flatten in place) and the
    stride-0 gradient of y.sum()."""
    base, x_of_base, weight, dy = norm_inputs("column_slice", shape, dtype, device)
    m = RMSNorm(shape[-1], eps).to(device, dtype)
    with torch.no_grad():
        m.weight.copy_(weight)
    ones = torch.ones((), dtype=dtype, device=device).expand(shape)
    column_major = dy.transpose(-1, -2).contiguous().transpose(-1, -2) if len(shape) > 1 else dy
    for name, g in (("column-major", column_major), ("expanded", ones)):
        grads = []
        for grad in (g, g.contiguous()):
            with kernel_calls(True):
                grads.append(torch.autograd.grad(m(x_of_base(base)), (base, m.weight), grad))
        for n, a, b in zip(("dx", "d weight"), *grads):
            assert_bitwise(a, b, f"{shape} {dtype}: {name} dy, {n}")


def check_double_backward(shape: tuple, dtype: torch.dtype, device, eps: float = 1e-6) -> None:
    """create_graph=True through the kernel path: the gradients and their gradients are the torch path's, bit for
    bit (the backward recomputes the torch ops when the graph of the gradient is recorded)."""
    out = []
    for kernel in (True, False):
        base, x_of_base, weight, dy = norm_inputs("column_slice", shape, dtype, device)
        m = RMSNorm(shape[-1], eps).to(device, dtype)
        with torch.no_grad():
            m.weight.copy_(weight)
        with kernel_calls(kernel) as calls:
            y = m(x_of_base(base))
            dx, dw = torch.autograd.grad(y, (base, m.weight), dy, create_graph=True)
            (dx.float().square().sum() + dw.float().square().sum()).backward()
        assert calls["forward"] == int(kernel) and calls["backward"] == 0, calls
        out.append((dx.detach(), dw.detach(), base.grad, m.weight.grad))
    for n, a, b in zip(("dx", "d weight", "d2 x", "d2 weight"), *out):
        assert_bitwise(a, b, f"{shape} {dtype}: double backward, {n}")


def check_layer_paths(device, dtype, *, dims: dict, T: int, packed: bool = False) -> None:
    """A q_lora layer's training forward and backward with its two norms on the kernels and on the torch ops,
    against a float64 twin on the CPU: the output, d hidden_states and every parameter's gradient within twice
    the torch-norm layer's error (plus _floor)."""
    torch.manual_seed(0)
    ref = MultiHeadLatentAttention(**dims).double()
    init_layer_weights(ref)
    m = MultiHeadLatentAttention(**dims).to(device, dtype)
    m.load_state_dict(ref.state_dict())
    hidden = dims["hidden_size"]
    x64 = torch.randn(T, hidden, dtype=torch.float64) if packed else torch.randn(2, T, hidden, dtype=torch.float64)
    dy64 = torch.randn_like(x64)
    kw = {}
    if packed:
        kw = dict(cu_seqlens=torch.tensor([0, T // 3, T], dtype=torch.int32), max_seqlen=T - T // 3)

    def run(layer, x, dy, kwargs):
        layer.zero_grad()
        xi = x.detach().requires_grad_(True)
        y = layer(xi, **kwargs)
        y.backward(dy)
        return [y.detach(), xi.grad] + [p.grad for p in layer.parameters()]

    want = run(ref, x64, dy64, kw)
    kw_dev = {k: (v.to(device) if torch.is_tensor(v) else v) for k, v in kw.items()}
    got = {}
    for kernel in (True, False):
        with kernel_calls(kernel) as calls:
            got[kernel] = run(m, x64.to(device, dtype), dy64.to(device, dtype), kw_dev)
        n = 2 if kernel else 0  # q_a_layernorm and kv_a_layernorm
        assert calls == {"forward": n, "backward": n}, calls
    names = ["out", "d hidden_states"] + [f"d {n}" for n, _ in m.named_parameters()]
    for n, a, b, r in zip(names, got[True], got[False], want):
        assert_error_within(a.cpu(), r, b.cpu(), factor=2.0, eps=_floor(r),
                            name=f"layer ({dtype}, packed={packed}): {n}")


#: (shape, layout) pairs the interpreter runs: the layer's widths (1536, 512), odd widths (100, 7) and row counts,
#: one row, the widest rows the kernels take, and rows that share no block size with the grid.
INTERPRETER_CASES = [((37, 1536), "contiguous"), ((2, 37, 512), "column_slice"), ((2, 37, 512), "every_other_row"),
                     ((3, 5, 100), "contiguous"), ((3, 5, 100), "every_other_row"), ((11, 7), "column_slice"),
                     ((7,), "contiguous"), ((1, 1, 1536), "column_slice"), ((3, 8192), "contiguous"),
                     ((5, 300), "column_slice")]


def interpreter_main() -> int:
    """The kernels under Triton's interpreter on CPU tensors, float32 and float16 (its float32 -> bfloat16
    conversion truncates where a GPU rounds to nearest even, so bfloat16 is left to the GPU tests). Prints one
    line per group; returns the exit code."""
    import os
    assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1"
    cpu = torch.device("cpu")
    mla_mod._NORM_KERNEL_DEVICE_TYPES = ("cpu",)
    worst = {torch.float32: [0.0, 0.0, 0], torch.float16: [0.0, 0.0, 0]}
    for dtype in (torch.float32, torch.float16):
        for shape, layout in INTERPRETER_CASES:
            r = check_case(layout, shape, dtype, cpu)
            w = worst[dtype]
            w[0], w[1], w[2] = max(w[0], r["rstd_rtol"]), max(w[1], r["y_ulps"]), w[2] + r["y_differ"]
    for dtype, (rtol, ulps, differ) in worst.items():
        print(f"kernels vs torch ops, {dtype}: {len(INTERPRETER_CASES)} cases; y bit-identical given rstd; rstd within "
              f"{rtol:.2g} relative, y within {ulps:g} ulps ({differ} elements differ); dx, d weight within 2x")
    n = 0
    for dtype in (torch.float32, torch.float16):
        for shape, layout in (((2, 37, 512), "column_slice"), ((5, 8192), "contiguous"), ((16,), "contiguous"),
                              ((3, 7, 64), "every_other_row")):
            check_exact_case(layout, shape, dtype, cpu)  # N a power of two: the CPU's torch mean divides by N
            n += 1
    print(f"exact sums of squares: y bit-identical to the torch ops, {n} cases")
    for dtype in (torch.float32, torch.float16):
        check_partial_grads((3, 5, 100), dtype, cpu)
        check_double_backward((3, 5, 100), dtype, cpu)
        for shape in ((1, 5, 100), (3, 5, 100), (9, 33)):
            check_strided_gradients(shape, dtype, cpu)
    print("only the gradients asked for; strided upstream gradients; double backward as the torch ops")
    small = dict(hidden_size=64, num_heads=4, q_lora_rank=24, kv_lora_rank=32, qk_nope_head_dim=16,
                 qk_rope_head_dim=8, v_head_dim=16)
    for packed in (False, True):
        check_layer_paths(cpu, torch.float32, dims=small, T=13, packed=packed)
    print("layer forward/backward with the kernels within 2x of the torch norms' error: 2 cases (float32)")
    return 0


if __name__ == "__main__":
    sys.exit(interpreter_main())
