"""Install and remove MHLA on a diffusers transformer; ``set_attn_processor`` for any model.

:func:`apply_mhla` turns ``layers=`` into layer indices (:mod:`mhla_diffusers.selection`: the fixed
rules, or ``"auto"`` from sensitivity scores) and installs MHLA there
(:func:`~mhla_diffusers.models.installer.install_mhla`). The installer's functions and the cost
model (:mod:`mhla_diffusers.selection.cost`) are re-exported here, at their historical path.
"""

from __future__ import annotations

from typing import Any, Iterable, Mapping, Sequence

from torch import nn

from mhla_diffusers.families import attention_modules, family_of, self_attention_modules
from mhla_diffusers.models.installer import (
    idle_mhla_layers,
    install_mhla,
    is_mhla_model,
    mhla_spec,
    record_selection,
    remove_mhla,
    set_attn_processor,
)
from mhla_diffusers.models.processor import materialize_mhla, pending_mhla_layers
from mhla_diffusers.selection.auto import auto_layers
from mhla_diffusers.selection.cost import attention_cost, layer_attention_flops
from mhla_diffusers.selection.hybrid import select_layers

__all__ = [
    "apply_mhla",
    "attention_cost",
    "layer_attention_flops",
    "remove_mhla",
    "set_attn_processor",
    "attention_modules",
    "is_mhla_model",
    "idle_mhla_layers",
    "mhla_spec",
    "pending_mhla_layers",
    "materialize_mhla",
    "record_selection",
]


def apply_mhla(
    transformer: nn.Module,
    layers: str | Sequence[int] = "all",
    *,
    num_blocks: int | None = None,
    block_grid: Sequence[int] | str | None = None,
    normalize: bool = True,
    eps: float | None = None,
    backend: str = "auto",
    init: str = "locality",
    output_norm: bool | None = None,
    feature_eps: float = 0.0,
    mixing_clamp: bool = True,
    keep_softmax: int | None = None,
    max_attention_cost: float | None = None,
    calibration: Iterable[Mapping[str, Any]] | None = None,
    sensitivity=None,
) -> list[str]:
    """Replace self-attention with MHLA on the selected layers of a diffusers transformer.

    Creates every selected layer's mixing matrix now (fp32, on the layer's device, the paper's
    locality init), so they exist before an optimizer is built, under the state-dict keys
    ``<attention path>.mhla_mixing.weight``; installs one shared :class:`MHLAProcessor` on those
    layers (others keep their processor, bit for bit) and the hooks that publish the token grid.

    Args:
        transformer: a supported diffusers transformer (``DiTTransformer2DModel``,
            ``SanaTransformer2DModel``, ``WanTransformer3DModel``).
        layers: ``"all"``, ``"hybrid"`` (the stock attention kept on layers 0, 3, 6, ...; Wan2.1-1.3B:
            MHLA on 20 of 30), layer indices, or ``"auto"``: the layers MHLA damages most (per
            :func:`~mhla_diffusers.layer_sensitivity`) keep their stock attention — the ``keep_softmax``
            most sensitive ones, or the most sensitive ones that fit ``max_attention_cost`` (see
            :func:`~mhla_diffusers.selection.hybrid.select_auto`). The choice, the scores and how they were
            measured are recorded on the model for :func:`mhla_spec` (``"selection"`` in ``mhla_config.json``).
        num_blocks: target number of blocks ``M`` (block grid chosen from the model's native token
            grid, near-square blocks, ``M^2 <= N``); ``None``: the family default (Wan: 105, the
            paper's, = ``(3, 5, 7)`` on 21 x 30 x 52), else ``round(sqrt(N) / 2)``.
        block_grid: explicit ``(bt, bh, bw)`` or a preset name of the family (Wan: ``"paper"``,
            ``"authors"`` = ``(3, 5, 10)``); overrides ``num_blocks``.
        normalize, eps, backend, output_norm, feature_eps: see :class:`MHLAProcessor` (``eps=None``: the
            family default; ``output_norm=None``: Wan gets the per-head output RMSNorm when ``normalize=False``;
            ``feature_eps``: ``phi = ReLU + feature_eps``, 0 by default).
        init: ``"locality"`` (paper) or ``"uniform"`` (all ones = plain linear attention at init).
        mixing_clamp: the mixing matrices are used clamped to ``[0, 1]`` (the paper's, default) or as
            stored (``False``, see :class:`~mhla_diffusers.MixingMatrix`; the authors' Wan model).
        keep_softmax: ``layers="auto"``: how many layers keep their stock attention, ``0 <= K < L``
            (``0`` is exactly ``layers="all"``).
        max_attention_cost: ``layers="auto"``: ``0 < F <= 1``, the attention cost allowed as a fraction of the
            stock model's, from the cost model of :func:`attention_cost` at the native resolution.
        calibration: ``layers="auto"``: inputs to measure the sensitivity on (a list of dicts of keyword
            arguments for the transformer's forward, see :func:`~mhla_diffusers.calibration_inputs`),
            measured with this call's ``num_blocks`` / ``block_grid`` / ``normalize`` and the defaults of
            :func:`~mhla_diffusers.layer_sensitivity`.
        sensitivity: ``layers="auto"``: precomputed scores instead of ``calibration`` (a
            :class:`~mhla_diffusers.LayerSensitivity`, ``{index: score}`` or one score per layer).

    Returns:
        Names of the converted attention modules.

    Raises:
        ValueError: unsupported model, bad ``layers``, a block grid that does not fit the model's
            native token grid, or a selected layer that already has MHLA (``remove_mhla`` first);
            ``"auto"`` without ``calibration`` / ``sensitivity`` (or with both), with both or neither of
            ``keep_softmax`` / ``max_attention_cost``, ``K`` out of range, a budget outside ``(0, 1]``,
            below the all-MHLA cost or keeping every layer; these options without ``layers="auto"``.
    """
    family = family_of(transformer)
    modules = self_attention_modules(transformer, family)
    auto = {"keep_softmax": keep_softmax, "max_attention_cost": max_attention_cost, "calibration": calibration,
            "sensitivity": sensitivity}
    selection = None
    if isinstance(layers, str) and layers == "auto":
        chosen, selection = auto_layers(transformer, len(modules), num_blocks, block_grid, normalize, **auto)
    else:
        given = [name for name, value in auto.items() if value is not None]
        if given:
            raise ValueError(f"{', '.join(given)} only apply with layers='auto'; got layers={layers!r}")
        chosen = select_layers(len(modules), layers)
    names = install_mhla(
        transformer, chosen, num_blocks=num_blocks, block_grid=block_grid, normalize=normalize, eps=eps, backend=backend,
        init=init, output_norm=output_norm, feature_eps=feature_eps, mixing_clamp=mixing_clamp,
    )
    if selection is not None:
        record_selection(transformer, selection)
    return names
