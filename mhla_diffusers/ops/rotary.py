"""Rotary position embeddings on interleaved channel pairs, for the MHLA operator's ``rotary=``.

Channel pair ``(x[2i], x[2i + 1])`` of token ``t`` is turned by ``theta[t, i]`` (RoFormer, Su et al.
2021, eq. 34; Wan 2.1's pair convention). The Triton backend applies an :class:`InterleavedRotary`
inside its kernels; see ``docs/operator.md``, "The RoPE variant".
"""

from __future__ import annotations

import torch

__all__ = ["InterleavedRotary"]


class InterleavedRotary:
    """The rotation of interleaved channel pairs of ``[B, heads, N, d]`` features by per-token angles.

    ``cos``, ``sin``: ``[N, d / 2]`` floating tables (operator token order). The result has the features'
    dtype; differentiable in the features (and the tables, except inside the Triton kernels).

    Raises:
        ValueError: tables not equal-shaped 2-D floating tensors; features not ``[B, heads, N, d]``.
    """

    def __init__(self, cos: torch.Tensor, sin: torch.Tensor):
        if not (isinstance(cos, torch.Tensor) and isinstance(sin, torch.Tensor)):
            raise ValueError("cos and sin must be tensors of shape [N, d / 2]")
        if cos.ndim != 2 or cos.shape != sin.shape or not cos.is_floating_point() or not sin.is_floating_point():
            raise ValueError(
                f"cos and sin must be floating tensors of one shape [N, d / 2]; got {tuple(cos.shape)} {cos.dtype}, "
                f"{tuple(sin.shape)} {sin.dtype}"
            )
        if cos.dtype != sin.dtype:  # one dtype for both (the promoted one): the complex form needs it
            dtype = torch.promote_types(cos.dtype, sin.dtype)
            cos, sin = cos.to(dtype), sin.to(dtype)
        self.cos, self.sin = cos, sin
        self._complex: tuple | None = None  # (key, complex table)
        self._tables: dict = {}

    @property
    def num_tokens(self) -> int:
        """``N``, the number of tokens the tables cover."""
        return self.cos.shape[0]

    @property
    def head_dim(self) -> int:
        """``d``, twice the tables' width."""
        return 2 * self.cos.shape[1]

    def check(self, shape) -> None:
        """Raise ``ValueError`` unless ``shape`` is ``[B, heads, N, d]`` for these tables."""
        if len(shape) != 4 or shape[2] != self.num_tokens or shape[-1] != self.head_dim:
            raise ValueError(
                f"features of shape {tuple(shape)} do not match the rotary tables for {self.num_tokens} tokens x "
                f"{self.head_dim} channels"
            )

    def tables(self, device: torch.device, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
        """Detached contiguous ``(cos, sin)`` of ``dtype`` on ``device``, cached until a table is edited."""
        key = (torch.device(device), dtype, self._versions())  # an in-place edit of a table invalidates the copy
        if key not in self._tables:
            self._tables.clear()
            with torch.inference_mode(False), torch.no_grad():  # cached: must not become inference tensors
                self._tables[key] = tuple(t.detach().to(device=key[0], dtype=dtype).contiguous() for t in (self.cos, self.sin))
        return self._tables[key]

    def _versions(self) -> tuple:
        # inference tensors (tables built inside torch.inference_mode, e.g. Wan's per-forward RoPE) have no
        # version counter: the cache then follows the tensor objects only
        return tuple(None if t.is_inference() else t._version for t in (self.cos, self.sin))

    @property
    def requires_grad(self) -> bool:
        """Whether a table requires a gradient (then the rotation is composed in torch)."""
        return self.cos.requires_grad or self.sin.requires_grad

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        self.check(x.shape)
        cos, sin = self.cos.to(x.device), self.sin.to(x.device)
        fast = x.dtype in (torch.float32, torch.float64) and cos.dtype in (torch.float32, torch.float64)
        if fast and not self.requires_grad and not torch.compiler.is_compiling():  # inductor has no complex kernels
            # One complex product (x1 + i x2)(cos + i sin): the same two products and one sum or
            # difference per output as the slice form below, about 5x faster on a CPU.
            key = (x.device, self._versions())
            if self._complex is None or self._complex[0] != key:
                with torch.inference_mode(False):
                    self._complex = (key, torch.complex(cos, sin))
            try:
                pairs = torch.view_as_complex(x.unflatten(-1, (-1, 2)))
            except RuntimeError:  # a view whose strides do not allow it: the copy does
                pairs = torch.view_as_complex(x.contiguous().unflatten(-1, (-1, 2)))
            return torch.view_as_real(pairs * self._complex[1]).flatten(-2).to(x.dtype)
        x1, x2 = x[..., 0::2], x[..., 1::2]
        out = torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).flatten(-2)
        return out.to(x.dtype)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(tokens={self.num_tokens}, head_dim={self.head_dim})"
