"""A layer's MHLA state: its mixing matrix ``<attention module>.mhla_mixing`` and, when asked, its
per-head output norm ``<attention module>.mhla_output_norm`` (registered submodules: in
``state_dict()``, following ``.to()``), created once, at install or at the bare one-liner's first forward.
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch import nn

from mhla_diffusers.models import spec
from mhla_diffusers.ops.mixing import MixingMatrix

__all__ = ["OutputRMSNorm", "attach", "create_layer_state", "layer_requires_grad"]


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


def create_layer_state(processor, attn, block_grid, family, init: str, requires_grad: bool) -> MixingMatrix:
    """Add ``mhla_mixing`` (fp32, on the layer's device) and, if ``processor`` asks for one, ``mhla_output_norm``."""
    device = next(attn.parameters()).device
    # The bare one-liner creates parameters at the first forward, often inside a pipeline's
    # torch.inference_mode() / no_grad(): build them as ordinary tensors anyway.
    with torch.inference_mode(False), torch.enable_grad():
        mixing = MixingMatrix(block_grid, init=init).to(device).requires_grad_(requires_grad)
        attn.add_module("mhla_mixing", mixing)
        if spec.resolve_output_norm(processor, family) and getattr(attn, "mhla_output_norm", None) is None:
            norm = OutputRMSNorm(attn.heads, _output_head_dim(attn)).to(device).requires_grad_(requires_grad)
            attn.add_module("mhla_output_norm", norm)
    mixing.verified = True  # made to this processor's settings
    return mixing


def attach(processor, attn, reference_grid: Sequence[int], init="locality", family=None, requires_grad=True) -> MixingMatrix:
    """The layer's mixing matrix: created if it has none, else checked against ``processor``
    (:func:`~mhla_diffusers.models.spec.check_layer`; raises ``ValueError`` on a contradiction)."""
    family = family or processor.family
    mixing = getattr(attn, "mhla_mixing", None)
    if mixing is None:
        grid = spec.resolve_block_grid(processor, reference_grid, family)
        return create_layer_state(processor, attn, grid, family, init, requires_grad)
    spec.check_layer(processor, attn, reference_grid, family)
    return mixing


def layer_requires_grad(attn) -> bool:
    """Whether the attention module's own projection weights are trainable (``to_q`` / ``to_k`` /
    ``to_v`` / fused ``to_qkv``; any of its parameters if it has none of these)."""
    weights = [getattr(getattr(attn, name, None), "weight", None) for name in ("to_q", "to_k", "to_v", "to_qkv")]
    weights = [w for w in weights if isinstance(w, torch.Tensor)] or list(attn.parameters())
    return any(w.requires_grad for w in weights)


def _output_head_dim(attn) -> int:
    """Channels per head of the attention output (the value head dim)."""
    to_v = getattr(attn, "to_v", None)
    if to_v is not None and hasattr(to_v, "out_features"):
        return to_v.out_features // attn.heads
    return attn.inner_dim // attn.heads
