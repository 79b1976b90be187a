"""The optional parts of a layer's MHLA (:class:`~mhla_diffusers.models.layer.MHLALayer`), each a module its
forward calls: the per-head output norm (``<attention>.mhla.output_norm``), the output gate (``.mhla.gate``), LePE
(``.mhla.lepe``) and the authors' DiT input LayerNorm (``.mhla.input_norm``). Parameters float32, computed in float32
(float64 for float64 inputs).
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from mhla_diffusers.models import spec

__all__ = ["OutputRMSNorm", "OutputGate", "LePE", "InputLayerNorm"]


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
    """``<attention>.mhla.input_norm``: a LayerNorm with weight and bias on the tokens ``[B, N, dim]`` entering the layer.

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
    """The output gate ``<attention>.mhla.gate``: the attention output times a gate computed from the layer's input tokens.

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
    """LePE ``<attention>.mhla.lepe``: a depthwise convolution of the values over the token grid of the call.

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
