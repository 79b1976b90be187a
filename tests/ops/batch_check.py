"""CASES C03 at operator level: a sample's output and q, k, v gradients are the same bits alone and
at every position of batches of 1, 2, 3 and 5 (CFG runs cond + uncond in one batch).

Shared by ``tests/ops/test_ops.py`` (torch backend, in process) and ``tests/ops/triton_interpret_check.py``
(Triton kernels, in the interpreter's own process); imports only torch.

The backends make this hold by construction (no reduction order depends on the batch size or on
a sample's position: see the module docstrings of ``mhla_diffusers.ops.torch_ops`` and
``triton_ops``), so the comparison is ``torch.equal``. The mixing gradient is a sum over the batch
and is not compared.
"""

from __future__ import annotations

from typing import Callable, Iterator, Sequence

import torch

NAMES = ("out", "dq", "dk", "dv")


def placements(sizes: Sequence[int] = (1, 2, 3, 5)) -> Iterator[tuple[int, list[int]]]:
    """``(batch size, positions of the sample)``: every position of every size, two batches per size
    (the sample at the even positions, then at the odd ones; other rows random)."""
    for size in sizes:
        for parity in (0, 1):
            positions = [p for p in range(size) if p % 2 == parity]
            if positions:
                yield size, positions


def differences(
    run: Callable[..., Sequence[torch.Tensor]],
    sample: Sequence[torch.Tensor],
    sizes: Sequence[int] = (1, 2, 3, 5),
    seed: int = 0,
) -> list[str]:
    """Where a sample's results change with its batch; ``[]`` when they never do.

    Args:
        run: ``run(q, k, v, grad_out) -> (out, dq, dk, dv)`` for ``[B, ...]`` tensors (it may
            change their memory layout; it must not mix rows).
        sample: ``(q, k, v, grad_out)``, each of batch size 1.
        sizes: the batch sizes tried.
        seed: for the other rows (drawn in float64, then cast to each tensor's dtype).

    Returns:
        One line per differing tensor: ``"size 3, position 1: dk (max |diff| 6e-08)"``.
    """
    alone = run(*sample)
    gen = torch.Generator().manual_seed(seed)
    found = []
    for size, positions in placements(sizes):
        batch = []
        for x in sample:
            rows = torch.randn((size, *x.shape[1:]), generator=gen, dtype=torch.float64).to(x.dtype)
            rows[positions] = x
            batch.append(rows)
        results = run(*batch)
        for pos in positions:
            for name, ref, got in zip(NAMES, alone, results):
                row = got[pos : pos + 1]
                if not torch.equal(row, ref):
                    diff = (row.double() - ref.double()).abs().max().item()
                    found.append(f"size {size}, position {pos}: {name} (max |diff| {diff:.3g})")
    return found


def mhla_runner(mhla_attention, mixing, layout, memory: str = "contiguous", **kwargs) -> Callable:
    """A ``run`` for :func:`differences`: ``mhla_attention(q, k, v, mixing, layout, **kwargs)`` forward and
    backward (the mixing matrix requires grad too, so every backward branch runs). ``memory="bnhd"``
    passes q, k, v and the output gradient in diffusers' ``[B, N, H, d]`` storage viewed as ``[B, H, N, d]``."""

    def run(q, k, v, grad_out):
        tensors = [q, k, v, grad_out]
        if memory == "bnhd":
            tensors = [t.transpose(1, 2).contiguous().transpose(1, 2) for t in tensors]
        leaves = [t.clone().requires_grad_() for t in tensors[:3]] + [mixing.clone().requires_grad_()]
        out = mhla_attention(*leaves[:3], leaves[3], layout, **kwargs)
        grads = torch.autograd.grad(out, leaves, tensors[3])
        return (out.detach(), *grads[:3])

    return run
