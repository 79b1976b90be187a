"""One tiny model per registered family, for the family contract suite (tests/models/test_family_contract.py)
and the context-parallel check: a new family adds its entry to :data:`TINY`.

Reuse from any test module::

    from helpers_families import TINY, install_one_liner
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from helpers import dit_inputs, run_dit, tiny_dit
from helpers_sana import run_sana, sana_inputs, tiny_sana
from helpers_sana_video import run_sana_video, sana_video_inputs, tiny_sana_video
from helpers_wan import run_wan, tiny_wan, wan_inputs
from helpers_wan_vace import run_wan_vace, tiny_wan_vace, wan_vace_inputs
from torch import nn

from mhla_diffusers.families import attention_modules

__all__ = ["TinyFamily", "TINY", "install_one_liner"]


@dataclass(frozen=True)
class TinyFamily:
    """A family's tiny, deterministic test model.

    Attributes:
        build: ``(num_layers, seed, **variant) -> model`` in eval mode, fp32.
        inputs: ``(batch, seed) -> inputs`` of :attr:`run`; their token count divides by 2 and 3 (context
            parallelism over 2 or 3 processes).
        run: ``(model, inputs) -> output sample`` (no grad).
        call: ``(model, inputs) -> output`` of ``model(..., return_dict=False)[0]`` (the form diffusers' context
            parallelism gathers).
        block_grid: a block grid for those inputs' token grid (M > 1 on every axis that has tokens).
        variants: ``{name: build keywords}``: model variants the contract also runs on (``""``: the default).
        cross_mask: the model passes an attention mask to its cross-attention (SANA's text mask).
        self_layers: the self-attention layers of ``build(num_layers=3)`` (Wan VACE: 3 main + 2 VACE blocks).
    """

    build: Callable[..., nn.Module]
    inputs: Callable[..., Any]
    run: Callable[[nn.Module, Any], torch.Tensor]
    call: Callable[[nn.Module, Any], torch.Tensor]
    block_grid: tuple[int, ...]
    variants: dict[str, dict] = field(default_factory=lambda: {"": {}})
    cross_mask: bool = False
    self_layers: int = 3


TINY: dict[str, TinyFamily] = {
    "dit": TinyFamily(
        build=lambda num_layers=3, seed=0, **kw: tiny_dit(num_layers=num_layers, sample_size=12, seed=seed, **kw),
        inputs=lambda batch=2, seed=0: dit_inputs(batch=batch, size=12, seed=seed),  # 6 x 6 = 36 tokens
        run=run_dit,
        call=lambda m, x: m(x[0], timestep=x[1], class_labels=x[2], return_dict=False)[0],
        block_grid=(2, 3),
    ),
    "sana": TinyFamily(
        build=lambda num_layers=3, seed=0, **kw: tiny_sana(num_layers=num_layers, seed=seed, **kw),
        inputs=lambda batch=2, seed=0: sana_inputs(batch=batch, size=(6, 8), seed=seed),  # 6 x 8 = 48 tokens
        run=run_sana,
        call=lambda m, x: m(x[0], encoder_hidden_states=x[1], timestep=x[2], encoder_attention_mask=x[3], return_dict=False)[0],
        block_grid=(3, 2),
        variants={"": {}, "qk_norm": {"qk_norm": "rms_norm_across_heads"}},  # SANA-Sprint / 1.5: norms over all heads
        cross_mask=True,
    ),
    "wan": TinyFamily(
        build=lambda num_layers=3, seed=0, **kw: tiny_wan(num_layers=num_layers, seed=seed, **kw),
        inputs=lambda batch=2, seed=0: wan_inputs(batch=batch, frames=3, size=(8, 12), seed=seed),  # 3 x 4 x 6 = 72 tokens
        run=run_wan,
        call=lambda m, x: m(**x, return_dict=False)[0],
        block_grid=(1, 2, 3),
    ),
    "sana_video": TinyFamily(
        build=lambda num_layers=3, seed=0, **kw: tiny_sana_video(num_layers=num_layers, seed=seed, **kw),
        inputs=lambda batch=2, seed=0: sana_video_inputs(batch=batch, frames=3, size=(8, 12), seed=seed),  # 3 x 4 x 6
        run=run_sana_video,
        call=lambda m, x: m(x[0], encoder_hidden_states=x[1], timestep=x[2], encoder_attention_mask=x[3], return_dict=False)[0],
        block_grid=(1, 2, 3),
        cross_mask=True,
    ),
    "wan_vace": TinyFamily(
        build=lambda num_layers=3, seed=0, **kw: tiny_wan_vace(num_layers=num_layers, vace_layers=(0, 2), seed=seed, **kw),
        inputs=lambda batch=2, seed=0: wan_vace_inputs(batch=batch, frames=3, size=(8, 12), seed=seed),  # 3 x 4 x 6
        run=run_wan_vace,
        call=lambda m, x: m(**x, return_dict=False)[0],
        block_grid=(1, 2, 3),
        self_layers=5,
    ),
}


def install_one_liner(model: nn.Module, processor) -> None:
    """diffusers' one-liner ``model.set_attn_processor(processor)``; for a model without that method (DiT) the
    same by hand, ``set_processor`` on every attention module (our helpers bypassed)."""
    if hasattr(model, "set_attn_processor"):
        model.set_attn_processor(processor)
    else:
        for attn in attention_modules(model).values():
            attn.set_processor(processor)
