"""The inputs of ``benchmarks/gpu_check.py``'s cases and the calls they measure, on a GPU or in the interpreter.

The MHLA operator loaded from ``mhla_diffusers/ops`` without running ``mhla_diffusers/__init__.py`` (which
imports diffusers, absent on the GPU machine); q, k, v, the mixing matrix and RoPE tables of a timing or a
correctness case; a closure per method timed (forward, forward + backward); the Triton call of a
correctness case. Used by ``gpu_check_cases.py`` (the measurements) and by ``gpu_check.py --plan``, which
runs these calls with the kernels' launches recorded. Needs torch and triton only.
"""

from __future__ import annotations

import math
import sys
import types
from pathlib import Path

import torch
import torch.nn.functional as F

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent


def import_library():
    """``mhla_diffusers.ops`` (with ``layout``, ``mixing``, ``naive``) without ``mhla_diffusers/__init__.py``.

    Registers a bare package object when the real package is not imported yet, so that diffusers is
    not needed. Returns a namespace ``(ops, BlockLayout, mixing_init)``."""
    if "mhla_diffusers" not in sys.modules:
        pkg = types.ModuleType("mhla_diffusers")
        pkg.__path__ = [str(ROOT / "mhla_diffusers")]
        pkg.__file__ = str(ROOT / "mhla_diffusers" / "__init__.py")
        sys.modules["mhla_diffusers"] = pkg
    from mhla_diffusers import ops
    from mhla_diffusers.ops.layout import BlockLayout
    from mhla_diffusers.ops.mixing import mixing_init

    return types.SimpleNamespace(ops=ops, BlockLayout=BlockLayout, mixing_init=mixing_init)


LIB = import_library()


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


# ----------------------------------------------------------------------------------------------
# Inputs and the methods timed


def random_rotary(n: int, d: int, gen: torch.Generator, device: str):
    """An ``InterleavedRotary`` with random angles (float32 tables ``[n, d / 2]`` on ``device``)."""
    angles = torch.rand(n, d // 2, generator=gen, dtype=torch.float64) * 2 * math.pi
    return LIB.ops.InterleavedRotary(angles.cos().float().to(device), angles.sin().float().to(device))


def make_inputs(batch, heads, grid, d, block_grid, dtype, device, *, rope=False, memory="bnhd", grad_memory="bnhd", empty=False):
    """q, k, v, output gradient (standard normal), the locality mixing and the layout; ``rope``: random tables.

    ``memory="bnhd"``: diffusers' ``[B, N, H, d]`` viewed as ``[B, H, N, d]`` (as a processor passes them).
    ``empty``: zeros instead of draws (shapes and strides only: what ``--plan`` needs)."""
    layout = LIB.BlockLayout(grid, block_grid)
    n = layout.num_tokens
    gen = torch.Generator(device="cpu").manual_seed(0)
    gen_device = torch.Generator(device=device).manual_seed(0)  # large draws where they are used: seconds saved

    def draw(mem):
        dims = (batch, n, heads, d) if mem == "bnhd" else (batch, heads, n, d)
        if empty:
            x = torch.zeros(dims, dtype=dtype, device=device)
        else:
            x = torch.randn(dims, generator=gen_device, device=device).to(dtype)
        return x.transpose(1, 2) if mem == "bnhd" else x

    q, k, v = draw(memory), draw(memory), draw(memory)
    grad_out = draw(grad_memory)
    mixing = LIB.mixing_init(layout).to(device)
    rotary = random_rotary(n, d, gen, device) if rope else None
    return dict(q=q, k=k, v=v, grad_out=grad_out, mixing=mixing, layout=layout, rotary=rotary)


def method_call(method: str, inputs: dict, normalize: bool = True):
    """``f(q, k, v, mixing) -> out`` for a timed method (see gpu_check.METHODS)."""
    ops, layout, rotary = LIB.ops, inputs["layout"], inputs["rotary"]
    if method == "sdpa":
        return lambda q, k, v, mix: F.scaled_dot_product_attention(q, k, v)
    if method == "linear":  # plain ReLU linear attention: one block, Mc = [[1]], the same kernels
        one = LIB.BlockLayout(layout.grid, (1,) * len(layout.grid))
        return lambda q, k, v, mix: ops.mhla_attention(q, k, v, mix, one, backend="triton", normalize=normalize)
    if method in ("triton", "torch"):
        return lambda q, k, v, mix: ops.mhla_attention(q, k, v, mix, layout, backend=method, normalize=normalize)
    if method in ("triton-rope", "torch-rope", "triton-rope-composed"):
        if rotary is None:
            raise ValueError(f"{method} needs rotary tables")
        rot = (lambda x: rotary(x)) if method.endswith("composed") else rotary  # a plain function is not fused
        backend = method.split("-")[0]
        return lambda q, k, v, mix: ops.mhla_attention(q, k, v, mix, layout, backend=backend, normalize=normalize, rotary=rot)
    raise ValueError(f"unknown method {method!r}")


def leaves_of(method: str, inputs: dict) -> tuple[list, list]:
    """``(arguments, differentiated leaves)`` of one fwd+bwd call: fresh leaves of q, k, v and the mixing."""
    mix = torch.ones(1, 1, device=inputs["q"].device) if method == "linear" else inputs["mixing"]
    args = [t.detach().requires_grad_(True) for t in (inputs["q"], inputs["k"], inputs["v"], mix)]
    return args, (args[:3] if method == "sdpa" else args)


def fwd_bwd(method: str, inputs: dict, normalize: bool = True):
    """A closure running forward + backward once; returns ``(out, grads)``."""
    fn = method_call(method, inputs, normalize)

    def run():
        args, wanted = leaves_of(method, inputs)
        out = fn(*args)
        return out, torch.autograd.grad(out, wanted, inputs["grad_out"])

    return run


def forward_only(method: str, inputs: dict, normalize: bool = True):
    """A closure running the forward once without autograd."""
    fn = method_call(method, inputs, normalize)
    mix = torch.ones(1, 1, device=inputs["q"].device) if method == "linear" else inputs["mixing"]

    def run():
        with torch.no_grad():
            return fn(inputs["q"], inputs["k"], inputs["v"], mix)

    return run


# ----------------------------------------------------------------------------------------------
# The inputs and the Triton call of a correctness case


def correctness_inputs(batch, heads, grid, block_grid, d, dtype, opts, device, empty=False) -> dict:
    """The inputs of one correctness case: q, k, v, mixing, output gradient (float64 draws cast to ``dtype``),
    layout and the operator's keywords. ``opts``: normalize, feature_map, scale, absolute, memory, mixing, rotary.
    ``empty``: zeros instead of draws (shapes and strides only)."""
    layout = LIB.BlockLayout(grid, block_grid)
    n, m = layout.num_tokens, layout.num_blocks
    normalize, feature_map = opts.get("normalize", True), opts.get("feature_map", True)
    gen = torch.Generator(device="cpu").manual_seed(0)
    gen_device = torch.Generator(device=device).manual_seed(0)

    def draw(width, scale=1.0, positive=False):
        if empty:
            x = torch.zeros(batch, heads, n, width, dtype=dtype, device=device)
        else:
            x = torch.randn(batch, heads, n, width, generator=gen_device, dtype=torch.float64, device=device) * scale
            x = (x.abs() if positive else x).to(dtype)
        if opts.get("memory") == "bnhd":  # diffusers: [B, N, H, d] viewed as [B, H, N, d]
            x = x.transpose(1, 2).contiguous().transpose(1, 2)
        return x

    positive = bool(opts.get("absolute") or (normalize and not feature_map))
    q, k, v = (draw(d, opts.get("scale", 1.0), positive) for _ in range(3))
    if opts.get("mixing") == "ones":
        mixing = torch.ones(m, m, device=device)
    else:
        mixing = (LIB.mixing_init(layout) * 0.5 + 0.5 * torch.rand(m, m, generator=gen)).to(device)
    grad_out = draw(d)
    rotary = random_rotary(n, d, gen, device) if opts.get("rotary") else None
    kw = dict(normalize=normalize, eps=1e-6, feature_map="relu" if feature_map else None, rotary=rotary)
    return dict(q=q, k=k, v=v, mixing=mixing, grad_out=grad_out, layout=layout, kw=kw)


def run_leaves(fn, x: dict, cast=None):
    """``fn(q, k, v, mixing)`` on fresh leaves (cast to ``cast``); ``(out, (dq, dk, dv, dmixing))``."""
    leaves = [(t.detach().to(cast) if cast else t.detach()).requires_grad_(True) for t in (x["q"], x["k"], x["v"], x["mixing"])]
    out = fn(*leaves)
    grads = torch.autograd.grad(out, leaves, x["grad_out"].to(out.dtype))
    return out.detach(), grads


def triton_function(x: dict, compile_mode: str | None = None):
    """The Triton call of a correctness case, compiled by ``torch.compile(backend=compile_mode)`` if given."""
    layout, kw = x["layout"], x["kw"]

    def call(*a):
        return LIB.ops.mhla_attention(*a, layout, backend="triton", **kw)

    if compile_mode:  # the custom operator inside a compiled graph
        torch._dynamo.reset()
        return torch.compile(call, fullgraph=True, backend=compile_mode)
    return call


def correctness_triton_run(batch, heads, grid, block_grid, d, dtype, opts, device, empty=False):
    """The Triton forward + backward of a correctness case, uncompiled (what ``--plan`` recounts)."""
    x = correctness_inputs(batch, heads, grid, block_grid, d, dtype, opts, device, empty)
    return run_leaves(triton_function(x), x)
