"""A layer's MHLA state: its mixing matrix ``<attention module>.mhla_mixing`` and, when asked, its
per-head output norm ``<attention module>.mhla_output_norm``, output gate ``<attention module>.mhla_gate``
and LePE convolution ``<attention module>.mhla_lepe``, and the authors' DiT layer's input LayerNorm
``<attention module>.mhla_input_norm`` (registered submodules: in ``state_dict()``, following ``.to()``), created
once, at install or at the bare one-liner's first forward.
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from mhla_diffusers.models import spec
from mhla_diffusers.ops.mixing import MixingMatrix

__all__ = ["OutputRMSNorm", "OutputGate", "LePE", "InputLayerNorm", "attach", "create_layer_state", "layer_requires_grad"]


def _accumulation(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


class OutputRMSNorm(nn.Module):
    """Per-head RMSNorm of the attention output ``[B, heads, N, head_dim]`` (the authors' Wan recipe, normaliser off).

    ``y = x / sqrt(mean(x^2) + eps) * weight[h]`` over the head dim, in float32 (float64 for float64);
    ``weight`` starts at ones. The per-head form is this project's reading of ``rms_output: true``.
    """

    def __init__(self, heads: int, head_dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = float(eps)
        self.weight = nn.Parameter(torch.ones(heads, head_dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x``: ``[B, heads, N, head_dim]`` -> same shape, float32 (float64 for float64 ``x``)."""
        if x.ndim != 4 or x.shape[1] != self.weight.shape[0] or x.shape[-1] != self.weight.shape[1]:
            raise ValueError(f"expected [B, {self.weight.shape[0]}, N, {self.weight.shape[1]}]; got {tuple(x.shape)}")
        acc = torch.float64 if x.dtype == torch.float64 else torch.float32
        x = x.to(acc)
        x = x * torch.rsqrt(x.square().mean(dim=-1, keepdim=True) + self.eps)
        return x * self.weight.to(acc)[:, None, :]

    def extra_repr(self) -> str:
        return f"heads={self.weight.shape[0]}, head_dim={self.weight.shape[1]}, eps={self.eps}"


class InputLayerNorm(nn.LayerNorm):
    """``<attention>.mhla_input_norm``: a LayerNorm with weight and bias on the tokens ``[B, N, dim]`` entering the layer.

    The authors' DiT layer (``MHLA4DiT``) normalises its input with ``nn.LayerNorm(dim)`` (eps 1e-5) before its q, k,
    v projection; this is that norm, for their imported weights. Computed in float32 (float64 for float64 tokens)
    and returned in the tokens' dtype; weight ones and bias zeros at the start (not the identity: a fresh
    retrofit does not use it).
    """

    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__(dim, eps=eps)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        acc = _accumulation(tokens.dtype)
        out = F.layer_norm(tokens.to(acc), self.normalized_shape, self.weight.to(acc), self.bias.to(acc), self.eps)
        return out.to(tokens.dtype)


class OutputGate(nn.Module):
    """The output gate ``<attention>.mhla_gate``: the attention output times a gate computed from the layer's input tokens.

    ``g = W x + b`` (``x``: the tokens entering the self-attention, ``[B, N, dim]``; ``W``: ``[heads * head_dim,
    dim]``), per channel of the ``[B, heads, N, head_dim]`` output: ``form="neutral"``: ``out * 2 sigmoid(g)`` with
    ``W = 0``, ``b = 0`` at the start (``2 sigmoid(0) = 1``: exactly the output without gate); ``form="authors"``:
    ``out * SiLU(g)`` with ``nn.Linear``'s default init (the authors' ``g_norm(out) * SiLU(g(x))``). Computed in
    float32 (float64 for float64 inputs) and returned in that dtype; parameters float32.
    """

    def __init__(self, in_features: int, heads: int, head_dim: int, form: str = "neutral"):
        super().__init__()
        if form not in spec.GATE_FORMS:
            raise ValueError(f"form must be one of {list(spec.GATE_FORMS)}; got {form!r}")
        self.form, self.heads = form, int(heads)
        if form == "authors":
            linear = nn.Linear(in_features, heads * head_dim)  # PyTorch's default init, as the authors' nn.Linear
            weight, bias = linear.weight.detach().clone(), linear.bias.detach().clone()
        else:
            weight, bias = torch.zeros(heads * head_dim, in_features), torch.zeros(heads * head_dim)
        self.weight, self.bias = nn.Parameter(weight), nn.Parameter(bias)

    def gate(self, tokens: torch.Tensor) -> torch.Tensor:
        """The factor ``[B, heads, N, head_dim]`` for the tokens ``[B, N, dim]`` (accumulation dtype)."""
        acc = _accumulation(tokens.dtype)
        g = F.linear(tokens.to(acc), self.weight.to(acc), self.bias.to(acc))
        g = 2.0 * torch.sigmoid(g) if self.form == "neutral" else F.silu(g)
        return g.unflatten(-1, (self.heads, -1)).transpose(1, 2)

    def forward(self, out: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """``out`` ``[B, heads, N, head_dim]`` times the gate of ``tokens`` ``[B, N, dim]``."""
        factor = self.gate(tokens)
        if out.shape != factor.shape:
            raise ValueError(f"the gate gives {tuple(factor.shape)} for an attention output {tuple(out.shape)}")
        return out.to(factor.dtype) * factor

    def extra_repr(self) -> str:
        return f"in_features={self.weight.shape[1]}, out_features={self.weight.shape[0]}, form={self.form!r}"


class LePE(nn.Module):
    """LePE ``<attention>.mhla_lepe``: a depthwise convolution of the values over the token grid of the call.

    ``lepe(v)``: the values after ``to_v`` (``[B, N, C]``, ``C = heads * head_dim``) as ``[B, C, T, H, W]``, a
    depthwise convolution with bias (``kernel`` 3 x 3: Conv2d over each frame's ``(H, W)``; 3 x 3 x 3: Conv3d
    over ``(T, H, W)``), zero padding, back to ``[B, heads, N, head_dim]``; added to the attention output. Weight
    ``[C, 1, *kernel]``, bias ``[C]``, float32; ``init="zeros"`` (the output without LePE at the start) or
    ``"authors"`` (PyTorch's default conv init, as the authors' ``nn.Conv2d`` / ``nn.Conv3d``). Computed in
    float32 (float64 for float64 values).
    """

    def __init__(self, channels: int, kernel: Sequence[int] = (3, 3), init: str = "zeros"):
        super().__init__()
        spec.check_lepe_init(init)
        kernel = tuple(int(k) for k in kernel)
        if len(kernel) not in (2, 3) or not all(k >= 1 and k % 2 for k in kernel):
            raise ValueError(f"kernel must be 2 or 3 odd positive sizes; got {kernel!r}")
        self.kernel = kernel
        if init == "authors":
            conv = (nn.Conv2d if len(kernel) == 2 else nn.Conv3d)(channels, channels, kernel, groups=channels)
            weight, bias = conv.weight.detach().clone(), conv.bias.detach().clone()
        else:
            weight, bias = torch.zeros(channels, 1, *kernel), torch.zeros(channels)
        self.weight, self.bias = nn.Parameter(weight), nn.Parameter(bias)

    def forward(self, value: torch.Tensor, grid: Sequence[int]) -> torch.Tensor:
        """``value`` ``[B, heads, N, head_dim]`` on the token grid ``(T, H, W)`` -> ``lepe(v)``, same shape, accumulation dtype."""
        b, h, n, d = value.shape
        t, hh, ww = (int(x) for x in grid)
        channels = h * d
        if channels != self.weight.shape[0] or n != t * hh * ww:
            raise ValueError(
                f"LePE has {self.weight.shape[0]} channels for a token grid of N tokens; got values {tuple(value.shape)} "
                f"on the grid {tuple(grid)}"
            )
        acc = _accumulation(value.dtype)
        weight, bias = self.weight.to(acc), self.bias.to(acc)
        x = value.to(acc).permute(0, 1, 3, 2).reshape(b, channels, t, hh, ww)  # channel c = head * d + i, as to_v's
        pad = tuple(k // 2 for k in self.kernel)
        if len(self.kernel) == 3:
            y = F.conv3d(x, weight, bias, padding=pad, groups=channels)
        else:  # each frame alone (image families have one)
            frames = x.transpose(1, 2).reshape(b * t, channels, hh, ww)
            y = F.conv2d(frames, weight, bias, padding=pad, groups=channels)
            y = y.reshape(b, t, channels, hh, ww).transpose(1, 2)
        return y.reshape(b, h, d, n).transpose(2, 3)

    def extra_repr(self) -> str:
        return f"channels={self.weight.shape[0]}, kernel={self.kernel}"


def create_layer_state(
    processor, attn, block_grid, family, init: str, requires_grad: bool, lepe_init: str = "zeros"
) -> MixingMatrix:
    """Add ``mhla_mixing`` (fp32, on the layer's device) and what ``processor`` asks for: ``mhla_output_norm``,
    ``mhla_gate``, ``mhla_lepe``, ``mhla_input_norm``. ``init``: the mixing matrix's start
    (:func:`~mhla_diffusers.models.spec.check_mixing_init`;
    ``"authors_constant"``: matrix and output-norm weight at 1e-6); ``lepe_init``: ``"zeros"`` or ``"authors"``."""
    spec.check_mixing_init(init)
    spec.check_lepe_init(lepe_init)
    device = next(attn.parameters()).device
    constant = init == spec.AUTHORS_CONSTANT
    # The bare one-liner creates parameters at the first forward, often inside a pipeline's
    # torch.inference_mode() / no_grad(): build them as ordinary tensors anyway.
    with torch.inference_mode(False), torch.enable_grad():
        mixing = MixingMatrix(block_grid, init="uniform" if constant else init)
        if constant:
            with torch.no_grad():
                mixing.weight.fill_(spec.AUTHORS_CONSTANT_VALUE)
        mixing = mixing.to(device).requires_grad_(requires_grad)
        attn.add_module("mhla_mixing", mixing)
        heads, head_dim = attn.heads, _output_head_dim(attn)
        if spec.resolve_output_norm(processor, family) and getattr(attn, "mhla_output_norm", None) is None:
            norm = OutputRMSNorm(heads, head_dim)
            if constant:
                with torch.no_grad():
                    norm.weight.fill_(spec.AUTHORS_CONSTANT_VALUE)
            attn.add_module("mhla_output_norm", norm.to(device).requires_grad_(requires_grad))
        gate = spec.resolve_gate(processor)
        if gate is not None and getattr(attn, "mhla_gate", None) is None:
            module = OutputGate(_input_dim(attn), heads, head_dim, gate)
            attn.add_module("mhla_gate", module.to(device).requires_grad_(requires_grad))
        if spec.resolve_input_norm(processor) and getattr(attn, "mhla_input_norm", None) is None:
            attn.add_module("mhla_input_norm", InputLayerNorm(_input_dim(attn)).to(device).requires_grad_(requires_grad))
        if spec.resolve_lepe(processor) and getattr(attn, "mhla_lepe", None) is None:
            kernel = getattr(family, "lepe_kernel", (3, 3))
            module = LePE(heads * head_dim, kernel, lepe_init)
            attn.add_module("mhla_lepe", module.to(device).requires_grad_(requires_grad))
    mixing.verified = True  # made to this processor's settings
    return mixing


def attach(
    processor, attn, reference_grid: Sequence[int], init="locality", family=None, requires_grad=True, lepe_init="zeros"
) -> MixingMatrix:
    """The layer's mixing matrix: created if it has none, else checked against ``processor``
    (:func:`~mhla_diffusers.models.spec.check_layer`; raises ``ValueError`` on a contradiction)."""
    family = family or processor.family
    mixing = getattr(attn, "mhla_mixing", None)
    if mixing is None:
        spec.check_family_settings(processor, family)
        grid = spec.resolve_block_grid(processor, reference_grid, family)
        return create_layer_state(processor, attn, grid, family, init, requires_grad, lepe_init)
    spec.check_layer(processor, attn, reference_grid, family)
    return mixing


def layer_requires_grad(attn) -> bool:
    """Whether the attention module's own projection weights are trainable (``to_q`` / ``to_k`` /
    ``to_v`` / fused ``to_qkv``; any of its parameters if it has none of these)."""
    weights = [getattr(getattr(attn, name, None), "weight", None) for name in ("to_q", "to_k", "to_v", "to_qkv")]
    weights = [w for w in weights if isinstance(w, torch.Tensor)] or list(attn.parameters())
    return any(w.requires_grad for w in weights)


def _input_dim(attn) -> int:
    """Channels of the tokens entering the layer (the query projection's input)."""
    for name in ("to_q", "to_qkv"):
        layer = getattr(attn, name, None)
        if layer is not None and hasattr(layer, "in_features"):
            return int(layer.in_features)
    return int(attn.query_dim)


def _output_head_dim(attn) -> int:
    """Channels per head of the attention output (the value head dim)."""
    to_v = getattr(attn, "to_v", None)
    if to_v is not None and hasattr(to_v, "out_features"):
        return to_v.out_features // attn.heads
    return attn.inner_dim // attn.heads
