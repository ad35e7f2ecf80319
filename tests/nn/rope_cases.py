"""Rotary-embedding inputs as MultiHeadLatentAttention hands them to apply_rotary (strided views of the
projections, broadcast cos/sin tables), the rotation as torch ops compute it, and the checks that the CPU,
interpreter and GPU tests of mla_autograd.nn.rope share.

Run as a script under Triton's interpreter (``TRITON_INTERPRET=1 python tests/nn/rope_cases.py``, from the
repository root) it runs the Triton kernel on CPU tensors against the torch ops (tests/nn/test_rope.py does).
"""
from __future__ import annotations

import sys

import torch

from mla_autograd.nn import MultiHeadLatentAttention, RotaryEmbedding, apply_rotary
from mla_autograd.nn import rope as rope_mod
from mla_autograd.testing import assert_bitwise

YARN = {"type": "yarn", "factor": 40.0, "original_max_position_embeddings": 128, "mscale": 1.0,
        "mscale_all_dim": 1.0, "beta_fast": 32, "beta_slow": 1}

#: How the layer (or a caller) lays out x and the tables; see rope_inputs.
LAYOUTS = ("q", "q_batch_positions", "k", "packed_q", "packed_k", "transposed", "last_stride_2")


def reference_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool) -> torch.Tensor:
    """The rotation with the float operations apply_rotary has always used (x and cos/sin cast to float32,
    float64 for float64 x; x1 * c - x2 * s and x2 * c + x1 * s; one cast back), written with slices.
    x (..., D) any float dtype; cos/sin (..., D/2) broadcasting against x without its last dim. Returns the
    half-split layout in x's dtype."""
    cd = torch.float64 if x.dtype == torch.float64 else torch.float32
    half = x.shape[-1] // 2
    x1 = (x[..., 0::2] if interleaved else x[..., :half]).to(cd)
    x2 = (x[..., 1::2] if interleaved else x[..., half:]).to(cd)
    c, s = cos.to(cd), sin.to(cd)
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], -1).to(x.dtype)


def rope_inputs(layout: str, *, B: int, S: int, H: int, D: int, dtype: torch.dtype, device, offset: int = 0,
                seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(base, x, cos, sin): x a view of base (a leaf; gradients are taken with respect to it).

    Positions offset .. offset + S - 1 (as a cached continuation has them), YaRN tables (float32):
    - "q": x (B, S, H, D), the rope part of a (B, S, H, 16 + D) query projection; cos/sin (S, 1, D/2).
    - "q_batch_positions": the same with positions (B, S) that differ per sequence: cos/sin (B, S, 1, D/2).
    - "k": x (B, S, D), the rope part of a (B, S, 32 + D) latent projection; cos/sin (S, D/2).
    - "packed_q" / "packed_k": the same packed (B*S, H, D) / (B*S, D), cos/sin (B*S, 1, D/2) / (B*S, D/2).
    - "transposed": x (B, S, H, D), a transpose of a contiguous (B, H, S, D); cos/sin (S, 1, D/2).
    - "last_stride_2": x (B, S, H, D) with last-dim stride 2; cos/sin (S, 1, D/2).
    """
    g = torch.Generator().manual_seed(seed)
    rot = RotaryEmbedding(D, rope_scaling=YARN, max_position_embeddings=4096)

    def randn(*shape):
        return torch.randn(*shape, generator=g, dtype=torch.float32).to(device, dtype)

    pos = torch.arange(offset, offset + S, device=device)
    if layout == "q_batch_positions":
        pos = pos[None] + 1000 * torch.arange(B, device=device)[:, None]
    if layout.startswith("packed"):
        pos = pos.repeat(B)
    cos, sin = rot(pos)
    if layout == "q" or layout == "q_batch_positions":
        base = randn(B, S, H, 16 + D)
        x = base[..., 16:]
    elif layout == "k":
        base = randn(B, S, 32 + D)
        x = base[..., 32:]
    elif layout == "packed_q":
        base = randn(B * S, H, 16 + D)
        x = base[..., 16:]
    elif layout == "packed_k":
        base = randn(B * S, 32 + D)
        x = base[..., 32:]
    elif layout == "transposed":
        base = randn(B, H, S, D)
        x = base.transpose(1, 2)
    elif layout == "last_stride_2":
        base = randn(B, S, H, 2 * D)
        x = base[..., ::2]
    else:
        raise ValueError(layout)
    if layout not in ("k", "packed_k"):  # a head dim: the tables broadcast over it
        cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)
    return base.requires_grad_(True), x, cos, sin


def rotate_and_grad(fn, base: torch.Tensor, x_of_base, cos, sin, interleaved: bool, dy: torch.Tensor):
    """(y, d base) for y = fn(x_of_base(base), cos, sin, interleaved) and the upstream gradient dy."""
    base = base.detach().requires_grad_(True)
    y = fn(x_of_base(base), cos, sin, interleaved)
    (grad,) = torch.autograd.grad(y, base, dy)
    return y.detach(), grad


def check_case(layout: str, interleaved: bool, dtype: torch.dtype, device, **dims) -> None:
    """apply_rotary (forward and the gradient with respect to the projection) equals reference_rotary and
    its autograd bit for bit; asserts that the Triton path served the call where `device` is the kernel's."""
    base, x, cos, sin = rope_inputs(layout, dtype=dtype, device=device, **dims)
    view = _view_of(layout, base, x)
    name = f"{layout} {dims} {dtype} interleaved={interleaved}"
    if device.type in rope_mod._KERNEL_DEVICE_TYPES and dtype in rope_mod._KERNEL_DTYPES:
        assert rope_mod._kernel_takes(x, cos, sin), f"{name}: not served by the Triton kernel"
    dy_base = torch.randn(x.shape, generator=torch.Generator().manual_seed(1)).to(device, dtype)
    dy = dy_base.transpose(-1, -2).contiguous().transpose(-1, -2)  # strided: column-major last two dims
    y, g = rotate_and_grad(lambda x, c, s, il: apply_rotary(x, c, s, interleaved=il), base, view, cos, sin,
                           interleaved, dy)
    y_ref, g_ref = rotate_and_grad(reference_rotary, base, view, cos, sin, interleaved, dy)
    assert y.is_contiguous(), f"{name}: output strides {y.stride()}"
    assert_bitwise(y, y_ref, f"{name}: forward")
    assert_bitwise(g, g_ref, f"{name}: gradient")


def _view_of(layout: str, base: torch.Tensor, x: torch.Tensor):
    """A function base -> x (the same view rope_inputs took)."""
    if layout == "transposed":
        return lambda b: b.transpose(1, 2)
    if layout == "last_stride_2":
        return lambda b: b[..., ::2]
    start = base.shape[-1] - x.shape[-1]
    return lambda b: b[..., start:]


def check_kernel_float32_out(layout: str, interleaved: bool, **dims) -> None:
    """The kernel on bfloat16 x written to a float32 out: forward and backward equal reference_rotary's float32
    values (its result before the one rounding to bfloat16) bit for bit. For the interpreter, whose float32 ->
    bfloat16 conversion truncates where a GPU rounds to nearest even."""
    from mla_autograd.nn import _rope_triton
    base, x, cos, sin = rope_inputs(layout, dtype=torch.bfloat16, device=torch.device("cpu"), **dims)
    assert x.dim() == 4
    cos4, sin4 = cos.expand(*x.shape[:-1], -1), sin.expand(*x.shape[:-1], -1)
    out = torch.empty(x.shape, dtype=torch.float32)
    _rope_triton.rotate(x, cos4, sin4, out, x_interleaved=interleaved, out_interleaved=False, negate_sin=False)
    x32 = x.detach().float().requires_grad_(True)
    y32 = reference_rotary(x32, cos, sin, interleaved)
    assert_bitwise(out, y32.detach(), f"{layout} {dims} interleaved={interleaved}: forward (float32 out)")
    dy = torch.randn(x.shape, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    (g32,) = torch.autograd.grad(y32, x32, dy.float())
    dx = torch.empty(x.shape, dtype=torch.float32)
    _rope_triton.rotate(dy, cos4, sin4, dx, x_interleaved=False, out_interleaved=interleaved, negate_sin=True)
    assert_bitwise(dx, g32, f"{layout} {dims} interleaved={interleaved}: backward (float32 out)")


def check_rotate_heads(device, dtype, *, interleaved: bool, packed: bool, B: int = 2, S: int = 7, H: int = 3,
                       keep: int = 16, D: int = 8, offset: int = 0) -> None:
    """RotaryEmbedding.rotate_heads on a projection's output x (..., H * (keep + D)) that holds the heads side by
    side: the same bits as `rotate` on x's heads view (forward, and the gradient with respect to the tensor x was
    computed from). On the kernel's devices x is rotated in place (the result views x's storage; the `keep`
    columns keep their values); a leaf that requires grad, or an autograd view, is left alone (a new tensor)."""
    torch.manual_seed(3)
    rot = RotaryEmbedding(D, rope_scaling=YARN, max_position_embeddings=4096, interleaved=interleaved)
    pos = torch.arange(offset, offset + S, device=device)
    if packed:
        pos = pos.repeat(B)
    cos, sin = rot(pos)
    cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)
    lead = (B * S,) if packed else (B, S)
    src = torch.randn(*lead, H * (keep + D)).to(device, dtype).requires_grad_(True)
    dy = torch.randn(*lead, H, keep + D).to(device, dtype)
    name = f"rotate_heads {dtype} interleaved={interleaved} packed={packed}"
    kernel = device.type in rope_mod._KERNEL_DEVICE_TYPES and dtype in rope_mod._KERNEL_DTYPES

    y_ref = rot.rotate(src.view(*lead, H, keep + D), cos, sin, keep=keep)
    (g_ref,) = torch.autograd.grad(y_ref, src, dy)
    for grad_in_place in (False, True):
        x = src * 1  # a fresh tensor with a grad_fn, as a linear layer's output
        kept_before = x.detach().view(*lead, H, keep + D)[..., :keep].clone()
        assert rope_mod.RotaryEmbedding._rotates_in_place(x, cos, sin, H, keep) == kernel, name
        y = rot.rotate_heads(x, cos, sin, H, keep=keep, grad_in_place=grad_in_place)
        dy_given = dy.clone()
        (g,) = torch.autograd.grad(y, src, dy_given)
        what = f"{name} grad_in_place={grad_in_place}"
        assert y.shape == y_ref.shape, what
        assert_bitwise(y, y_ref, f"{what}: forward")
        assert_bitwise(g, g_ref, f"{what}: gradient")
        if kernel:
            assert y.data_ptr() == x.data_ptr(), f"{what}: not rotated in place"
            assert_bitwise(x.detach().view(*lead, H, keep + D)[..., :keep], kept_before, f"{what}: kept columns")
        if not (kernel and grad_in_place):  # the given gradient is read, never written
            assert_bitwise(dy_given, dy, f"{what}: upstream gradient overwritten")
        else:  # ... unless the caller said the gradient is its own: rotated where it is
            assert_bitwise(dy_given.view(*lead, -1), g, f"{what}: gradient not rotated in place")
    with torch.no_grad():  # no autograd: in place all the same
        x = src.detach().clone()
        y = rot.rotate_heads(x, cos, sin, H, keep=keep)
        assert_bitwise(y, y_ref, f"{name}: no grad")
        assert (y.data_ptr() == x.data_ptr()) == kernel, f"{name}: no grad, in place {not kernel}"
    # never in place: a leaf that requires grad, a view of another tensor
    for x, what in ((src, "leaf"), ((src * 1)[..., :], "view")):
        before = x.detach().clone()
        assert not rope_mod.RotaryEmbedding._rotates_in_place(x, cos, sin, H, keep), f"{name}: {what}"
        assert_bitwise(rot.rotate_heads(x, cos, sin, H, keep=keep), y_ref, f"{name}: {what}")
        assert_bitwise(x.detach(), before, f"{name}: {what} left alone")


#: A small layer (hidden 64, 4 heads): (Dqk, Dv) = (24, 16) runs attention on the reference path.
SMALL_LAYER = dict(hidden_size=64, num_heads=4, q_lora_rank=24, kv_lora_rank=32, qk_nope_head_dim=16,
                   qk_rope_head_dim=8, v_head_dim=16)


def check_layer_paths_agree(device, dtype, *, interleave: bool, packed: bool, deterministic: bool,
                            dims: dict = SMALL_LAYER, T: int = 13) -> None:
    """A layer's training forward and backward give bit-identical outputs and gradients with its rotary on the
    Triton kernel and on the torch ops (_KERNEL_DEVICE_TYPES emptied). Dense (2, T, hidden) or packed
    (T, hidden) as two sequences."""
    torch.manual_seed(0)
    m = MultiHeadLatentAttention(**dims, rope_scaling=YARN, rope_interleave=interleave).to(device, dtype)
    hidden = dims["hidden_size"]
    x = torch.randn(T, hidden) if packed else torch.randn(2, T, hidden)
    x = x.to(device, dtype)
    cu = torch.tensor([0, T // 3, T], dtype=torch.int32, device=device)
    kw = dict(cu_seqlens=cu, max_seqlen=T - T // 3) if packed else {}
    dy = torch.randn(x.shape, device=device, dtype=dtype)

    def run(kernel: bool):
        torch_calls = []
        kept, real = rope_mod._KERNEL_DEVICE_TYPES, rope_mod._rotate_torch
        rope_mod._rotate_torch = lambda *a: (torch_calls.append(a[0].shape), real(*a))[1]
        if not kernel:
            rope_mod._KERNEL_DEVICE_TYPES = ()
        try:
            m.zero_grad()
            xi = x.detach().requires_grad_(True)
            y = m(xi, deterministic=deterministic, **kw)
            y.backward(dy)
        finally:
            rope_mod._KERNEL_DEVICE_TYPES, rope_mod._rotate_torch = kept, real
        # the kernel serves all four rotations (the query, its nope columns kept, and k_pe; forward and backward),
        # or none
        assert (not torch_calls) if kernel else len(torch_calls) == 2, torch_calls
        return [y.detach(), xi.grad] + [p.grad for p in m.parameters()]

    fused, plain = run(True), run(False)
    names = ["out", "d hidden_states"] + [f"d {n}" for n, _ in m.named_parameters()]
    for n, a, b in zip(names, fused, plain):
        assert_bitwise(a, b, f"layer ({dtype}, interleave={interleave}, packed={packed}): {n}")


def check_rotary_heads_op() -> None:
    """torch.library.opcheck of the in-place op that rotate_heads traces under torch.compile (its schema declares
    the mutation of x, its fake, its dispatch under AOTAutograd), on a projection-like x (..., H * (keep + D))."""
    H, keep, D = 3, 16, 8
    for x_interleaved, out_interleaved, negate_sin in ((True, False, False), (False, True, True),
                                                      (False, False, False)):
        x = torch.randn(2, 5, H * (keep + D))
        cos, sin = torch.randn(5, 1, D // 2), torch.randn(5, 1, D // 2)
        torch.library.opcheck(torch.ops.mla_autograd.rotary_heads_.default,
                              (x, cos, sin, H, keep, x_interleaved, out_interleaved, negate_sin))


def check_layer_compiles(device, dtype, backend, *, dims: dict = SMALL_LAYER, T: int = 13, tol: float = 0.0):
    """torch.compile(fullgraph=True) of a layer's training forward (no graph break) through `backend` (a
    torch.compile backend name): the rotary op is in the traced graph for k_pe, the query is rotated in place by
    rotary_heads_ (once in the forward body of its autograd function, once in the backward body: no out-of-place
    rotary for it), and the compiled output and gradients are the eager ones within tol (relative to each
    tensor's largest magnitude, at least 1)."""
    from torch._dynamo.backends.registry import lookup_backend
    torch.manual_seed(0)
    m = MultiHeadLatentAttention(**dims, rope_scaling=YARN).to(device, dtype)
    x = torch.randn(2, T, dims["hidden_size"]).to(device, dtype)
    dy = torch.randn_like(x)
    graphs = []

    def recording(gm, inputs):
        # the traced graph and its subgraphs (the bodies of autograd functions): (name, targets of its calls)
        graphs.extend((name, [n.target for n in g.graph.nodes if n.op == "call_function"])
                      for name, g in gm.named_modules() if isinstance(g, torch.fx.GraphModule))
        return lookup_backend(backend)(gm, inputs)

    torch._dynamo.reset()
    results = []
    for fn in (m, torch.compile(m, fullgraph=True, backend=recording)):
        m.zero_grad()
        xi = x.clone().requires_grad_(True)
        y = fn(xi)
        y.backward(dy)
        results.append([y.detach(), xi.grad] + [p.grad for p in m.parameters()])
    ops = torch.ops.mla_autograd
    calls = {name: (targets.count(ops.rotary.default), targets.count(ops.rotary_heads_.default))
             for name, targets in graphs}
    # one graph: its outer part rotates k_pe out of place, the query's autograd function in place both ways
    assert calls == {"": (1, 0), "fwd_body_0": (0, 1), "bwd_body_0": (0, 1)}, calls
    names = ["out", "d hidden_states"] + [f"d {n}" for n, _ in m.named_parameters()]
    for n, a, b in zip(names, *results):
        err = (a.double() - b.double()).abs().max().item()
        assert err <= tol * max(1.0, a.double().abs().max().item()), f"compiled layer ({backend}): {n} off by {err}"


def interpreter_main() -> int:
    """The kernel under Triton's interpreter on CPU tensors: float32/float16 through apply_rotary (forward,
    gradient, the layer), bfloat16 into float32 outputs. Prints one line per group; returns the exit code."""
    import os
    assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1"
    cpu = torch.device("cpu")
    rope_mod._KERNEL_DEVICE_TYPES = ("cpu",)
    n = 0
    for layout in LAYOUTS:
        for interleaved in (True, False):
            for dtype in (torch.float32, torch.float16):
                for dims in (dict(B=2, S=7, H=3, D=8, offset=5), dict(B=1, S=5, H=1, D=6, offset=4093),
                             dict(B=1, S=3, H=16, D=64)):
                    check_case(layout, interleaved, dtype, cpu, **dims)
                    n += 1
    print(f"apply_rotary on the kernel == torch ops: {n} cases (float32, float16)")
    n = 0
    for layout in ("q", "q_batch_positions", "transposed", "last_stride_2"):
        for interleaved in (True, False):
            check_kernel_float32_out(layout, interleaved, B=2, S=5, H=3, D=8, offset=11)
            check_kernel_float32_out(layout, interleaved, B=1, S=3, H=16, D=64)
            n += 2
    print(f"bfloat16 in, float32 out == torch ops before rounding: {n} cases")
    for interleaved in (True, False):
        for packed in (False, True):
            for dtype in (torch.float32, torch.float16):
                check_rotate_heads(cpu, dtype, interleaved=interleaved, packed=packed)
    print("rotate_heads in place == rotate: 8 cases (float32, float16)")
    for interleave in (True, False):
        for packed in (False, True):
            check_layer_paths_agree(cpu, torch.float32, interleave=interleave, packed=packed, deterministic=True)
    print("layer forward/backward, kernel == torch ops: 4 cases (float32)")
    check_rotary_heads_op()
    print("opcheck of mla_autograd::rotary_heads_ (both directions, both pair layouts)")
    check_layer_compiles(cpu, torch.float32, "aot_eager", tol=1e-6)
    print("layer under torch.compile(fullgraph=True, backend='aot_eager'): the rotary op traced, as eager")
    return 0


if __name__ == "__main__":
    sys.exit(interpreter_main())
