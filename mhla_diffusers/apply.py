""":func:`apply_mhla`: MHLA on the layers ``layers=`` names, above both the installer and the selection.

``layers=`` becomes layer indices through :mod:`mhla_diffusers.selection` (the fixed rules, or ``"auto"`` from
sensitivity scores); :func:`~mhla_diffusers.models.installer.install_mhla` installs MHLA there. ``models/``
never imports ``selection/``; ``selection/`` builds on ``models/``; this module uses both.
"""

from __future__ import annotations

from typing import Any, Iterable, Mapping, Sequence

from torch import nn

from mhla_diffusers.families import family_of, self_attention_modules
from mhla_diffusers.models import spec
from mhla_diffusers.models.installer import install_mhla, record_selection
from mhla_diffusers.selection.auto import auto_layers
from mhla_diffusers.selection.cost import MeasuredCost
from mhla_diffusers.selection.hybrid import select_layers

__all__ = ["apply_mhla"]


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
    feature_power: float = 1.0,
    rope: str | None = None,
    gate: bool | str | None = None,
    lepe: bool = False,
    lepe_init: str = "zeros",
    input_norm: bool = False,
    denominator: str = "paper",
    keep_softmax: int | None = None,
    max_attention_cost: float | None = None,
    calibration: Iterable[Mapping[str, Any]] | None = None,
    sensitivity=None,
    cost: str | MeasuredCost = "flops",
) -> list[str]:
    """Replace self-attention with MHLA (paper Sec. 3.2) on the selected layers of a diffusers transformer.

    Gives each selected layer its MHLA now: ``<attention path>.mhla``
    (:class:`~mhla_diffusers.models.layer.MHLALayer`: every setting below, the mixing matrix, fp32 on the layer's
    device, locality init, key ``<attention path>.mhla.mixing.weight``; with ``gate`` / ``lepe`` also ``.mhla.gate`` /
    ``.mhla.lepe``), and installs one shared :class:`MHLAProcessor` that runs them, plus the grid hooks.

    Args:
        transformer: a ``DiTTransformer2DModel``, ``SanaTransformer2DModel`` or ``WanTransformer3DModel``.
        layers: ``"all"``, ``"hybrid"`` (stock on 0, 3, 6, ...), indices, or ``"auto"`` (most sensitive keep stock).
        num_blocks: target ``M`` (``None``: family default, Wan 105, else ``round(sqrt(N) / 2)``).
        block_grid: ``(bt, bh, bw)`` or a family preset; overrides ``num_blocks``.
        normalize: see :class:`MHLAProcessor`.
        eps: see :class:`MHLAProcessor`.
        backend: see :class:`MHLAProcessor`.
        init: the mixing matrix's start: a name of :class:`~mhla_diffusers.MixingMatrix` (``"locality"``, the
            paper's; ``"uniform"``, ...) or ``"authors_constant"`` (matrix and output-norm weight at 1e-6).
        output_norm: see :class:`MHLAProcessor`.
        feature_eps: see :class:`MHLAProcessor`.
        mixing_clamp: clamp to ``[0, 1]`` (default) or not.
        feature_power: see :class:`MHLAProcessor` (``phi = ReLU(x) ** p``).
        rope: see :class:`MHLAProcessor` (``"after"`` / ``"before"`` / ``"none"``; Wan).
        gate: see :class:`MHLAProcessor` (``"neutral"`` / ``True``, ``"authors"``; ``None`` / ``False``: none).
        lepe: a LePE depthwise convolution on the values (see :class:`MHLAProcessor`).
        lepe_init: ``"zeros"`` (the output without LePE at the start) or ``"authors"`` (PyTorch's conv init); only
            with ``lepe=True``.
        input_norm: a LayerNorm on the layer's input tokens (the authors' DiT layer; for their imported weights).
        denominator: see :class:`MHLAProcessor` (``"paper"`` or the authors' DiT layer's ``"authors_dit"``).
        keep_softmax: ``layers="auto"`` only: ``K`` stock layers.
        max_attention_cost: ``layers="auto"`` only: a cost budget ``0 < F <= 1``.
        calibration: ``layers="auto"`` only: the inputs the scores are measured on.
        sensitivity (LayerSensitivity | Mapping | Sequence): ``layers="auto"`` only: the scores, given.
        cost: ``layers="auto"`` only: how layers are priced for ``max_attention_cost`` (and the recorded cost):
            ``"flops"`` (the FLOP model at the native token grid), ``"measured"`` (each layer's attention operator
            timed on this device at the native grid) or a :class:`~mhla_diffusers.selection.cost.MeasuredCost`
            (another grid, a cache file).

    Returns:
        Names of the converted attention modules.

    Raises:
        ValueError: unsupported model, bad ``layers`` or block grid, a layer that already has MHLA
            (``remove_mhla`` first), or inconsistent ``"auto"`` options.

    Every argument's rules: ``docs/processor.md`` (``apply_mhla`` in full).
    """
    family = family_of(transformer)
    modules = self_attention_modules(transformer, family)
    # bad settings are refused before anything is measured or installed
    spec.check_settings(num_blocks, block_grid, normalize, eps, backend, feature_eps, feature_power=feature_power, rope=rope,
                        gate=gate, lepe=lepe, input_norm=input_norm, denominator=denominator)
    spec.check_mixing_init(init)
    spec.check_lepe_init(lepe_init)
    if lepe_init != "zeros" and not lepe:
        raise ValueError(f"lepe_init={lepe_init!r} is LePE's start: it only applies with lepe=True")
    auto = {"keep_softmax": keep_softmax, "max_attention_cost": max_attention_cost, "calibration": calibration,
            "sensitivity": sensitivity, "cost": cost}
    chosen, selection = _chosen_layers(transformer, len(modules), layers, auto, num_blocks, block_grid, normalize, backend)
    names = install_mhla(
        transformer, chosen, num_blocks=num_blocks, block_grid=block_grid, normalize=normalize, eps=eps, backend=backend,
        init=init, output_norm=output_norm, feature_eps=feature_eps, mixing_clamp=mixing_clamp, feature_power=feature_power,
        rope=rope, gate=gate, lepe=lepe, lepe_init=lepe_init, input_norm=input_norm, denominator=denominator,
    )
    if selection is not None:
        record_selection(transformer, selection)
    return names


def _chosen_layers(transformer, num_layers: int, layers, auto: dict, num_blocks, block_grid, normalize, backend):
    """``(layer indices, selection record or None)`` for ``layers=``: a fixed rule or indices
    (:func:`~mhla_diffusers.selection.hybrid.select_layers`), or ``"auto"`` with the options in ``auto``.

    Raises:
        ValueError: bad ``layers``; an ``"auto"`` option given with another ``layers``.
    """
    if isinstance(layers, str) and layers == "auto":
        return auto_layers(transformer, num_layers, num_blocks, block_grid, normalize, backend=backend, **auto)
    given = [name for name, value in auto.items() if value is not None and not (name == "cost" and value == "flops")]
    if given:
        raise ValueError(f"{', '.join(given)} only apply with layers='auto'; got layers={layers!r}")
    return select_layers(num_layers, layers), None
