"""The torch backend's huge-page hint on the CPU tensors it fills (issue 23, section 3): values never change, and
tensors it cannot apply to (small, meta, another platform) pass through untouched."""

from __future__ import annotations

import pytest
import torch

from mhla_diffusers import BlockLayout, mhla_attention, mixing_init
from mhla_diffusers.ops import torch_ops


def test_hinted_outputs_and_gradients_are_the_unhinted_bits(monkeypatch):
    layout = BlockLayout((64, 64), (4, 4))
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 8, 4096, 64, generator=gen).requires_grad_() for _ in range(3))  # 8 MiB outputs
    mixing = mixing_init(layout)
    grad = torch.randn(1, 8, 4096, 64, generator=gen)

    def run():
        out = mhla_attention(q, k, v, mixing, layout, backend="torch")
        return (out, *torch.autograd.grad(out, (q, k, v), grad))

    assert q.numel() * 4 >= torch_ops._HUGE_HINT_MIN_BYTES  # the hint applies to these sizes
    hinted = run()
    torch_ops._release_workspace()
    monkeypatch.setattr(torch_ops, "_HUGE_HINT_MIN_BYTES", 1 << 62)
    plain = run()
    for a, b in zip(hinted, plain):  # the hint only changes page sizes (a tolerance: buffer addresses may differ)
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("make", [lambda: torch.empty(4, device="meta"), lambda: torch.empty(16),
                                  lambda: torch.empty(1 << 22)])
def test_the_hint_passes_every_tensor_through(make, monkeypatch):
    t = make()
    assert torch_ops._huge_pages(t) is t
    monkeypatch.setattr(torch_ops, "_madvise", lambda: None)  # no madvise (another OS): nothing happens
    assert torch_ops._huge_pages(t) is t
