"""Install and remove MHLA on a diffusers transformer; ``set_attn_processor`` for any model."""

from __future__ import annotations

import warnings
from typing import Any, Iterable, Mapping, Sequence

from torch import nn

from mhla_diffusers.families import attention_modules, family_of, self_attention_modules, stock_processor
from mhla_diffusers.models.grid import install_grid_hooks, remove_grid_hooks
from mhla_diffusers.models.hybrid import attention_flops, scores_list, select_auto, select_layers
from mhla_diffusers.models.processor import (
    _CHECKED_BY,
    _SOURCE_CHECKED,
    _WARNED,
    MHLAProcessor,
    materialize_mhla,
    pending_mhla_layers,
    remove_load_hook,
)
from mhla_diffusers.models.provenance import warn_fresh_mixing

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
            :func:`~mhla_diffusers.models.hybrid.select_auto`). The choice, the scores and how they were
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
        chosen, selection = _auto_layers(transformer, len(modules), num_blocks, block_grid, normalize, **auto)
    else:
        given = [name for name, value in auto.items() if value is not None]
        if given:
            raise ValueError(f"{', '.join(given)} only apply with layers='auto'; got layers={layers!r}")
        chosen = select_layers(len(modules), layers)
    reference = family.reference_grid(transformer.config)
    processor = MHLAProcessor(
        num_blocks=num_blocks,
        block_grid=block_grid,
        normalize=normalize,
        eps=family.default_eps if eps is None else eps,
        backend=backend,
        output_norm=output_norm,
        feature_eps=feature_eps,
        family=family,  # a layer called on its own (outside the model's forward) follows its family too
    )
    resolved = processor.resolve_block_grid(reference, family)
    processor.block_grid, processor.block_grid_preset = resolved, None
    processor.output_norm = processor.resolve_output_norm(family)
    for axis, (n, b) in enumerate(zip(reference, resolved)):
        if b > n:
            raise ValueError(
                f"block grid {resolved} does not fit the model's native token grid {reference} on axis {'THW'[axis]}"
            )
    already = [modules[i][0] for i in chosen if getattr(modules[i][1], "mhla_mixing", None) is not None]
    if already:
        idle = idle_mhla_layers(transformer)
        if set(already) <= set(idle):
            raise ValueError(
                f"{already} keep the mixing matrices of an earlier MHLA install but run {sorted(set(idle.values()))} "
                "(set by set_attn_processor): call mhla_diffusers.remove_mhla(transformer) first to install MHLA "
                "afresh, or set_attn_processor(MHLAProcessor()) to run those matrices again"
            )
        raise ValueError(f"MHLA is already installed on {already}; call mhla_diffusers.remove_mhla(transformer) first")
    warn_fresh_mixing(transformer)
    names = []
    for i in chosen:
        name, attn = modules[i]
        mixing = processor.attach(attn, reference, init=init, family=family)
        mixing.clamp = bool(mixing_clamp)
        attn.set_processor(processor)
        names.append(name)
    install_grid_hooks(transformer)
    if selection is not None:
        record_selection(transformer, selection)
    return names


def _auto_layers(transformer, num_layers, num_blocks, block_grid, normalize, *, keep_softmax, max_attention_cost,
                 calibration, sensitivity) -> tuple[list[int], dict]:
    """``layers="auto"`` of :func:`apply_mhla`: ``(MHLA layer indices, the selection record)``."""
    # sensitivity.py builds on this module (it installs MHLA on one layer at a time): imported here, not above
    from mhla_diffusers.models.sensitivity import LayerSensitivity, layer_sensitivity

    if (calibration is None) == (sensitivity is None):
        raise ValueError(
            "layers='auto' needs calibration inputs (calibration=[{...forward kwargs...}, ...], e.g. from "
            "mhla_diffusers.calibration_inputs(pipe)) or precomputed scores (sensitivity=), exactly one of them"
        )
    if (keep_softmax is None) == (max_attention_cost is None):
        raise ValueError("layers='auto' needs exactly one of keep_softmax=K or max_attention_cost=F")
    stock, mhla = layer_attention_flops(transformer, num_blocks=num_blocks, block_grid=block_grid)
    budget = dict(keep_softmax=keep_softmax, max_attention_cost=max_attention_cost, stock_costs=stock, mhla_costs=mhla)
    if sensitivity is None:
        select_auto([0.0] * num_layers, **budget)  # a request no ranking can meet fails before the measurement
        sensitivity = layer_sensitivity(transformer, calibration, num_blocks=num_blocks, block_grid=block_grid, normalize=normalize)
    else:
        _check_sensitivity_grid(transformer, sensitivity, num_blocks, block_grid)
    scores = scores_list(sensitivity, num_layers)
    chosen = select_auto(scores, **budget)
    record = {"method": "auto"}
    if keep_softmax is not None:
        record["keep_softmax"] = int(keep_softmax)
    else:
        record["max_attention_cost"] = float(max_attention_cost)
    record["attention_cost"] = _cost_fraction(stock, mhla, chosen)
    record["softmax_layers"] = [i for i in range(num_layers) if i not in chosen]
    record["scores"] = scores
    if isinstance(sensitivity, LayerSensitivity):
        record["sensitivity"] = dict(sensitivity.settings)
    return chosen, record


def _check_sensitivity_grid(transformer, sensitivity, num_blocks, block_grid) -> None:
    """Warn when precomputed scores (a :class:`~mhla_diffusers.models.sensitivity.LayerSensitivity`) were measured
    at another block grid than the one these settings install: they rank the layers for that grid."""
    measured = getattr(sensitivity, "settings", {}).get("block_grid")
    if measured is None:
        return
    family = family_of(transformer)
    grid = MHLAProcessor(num_blocks=num_blocks, block_grid=block_grid).resolve_block_grid(family.reference_grid(transformer.config), family)
    if tuple(measured) != tuple(grid):
        warnings.warn(
            f"apply_mhla(layers='auto'): the sensitivity scores were measured with block grid {tuple(measured)} but this "
            f"call installs block grid {tuple(grid)}: the ranking may differ; measure again with the installed grid "
            f"(layer_sensitivity(..., num_blocks= / block_grid= as here)) or pass the grid the scores were measured at",
            UserWarning,
            stacklevel=3,
        )


_SELECTION = "_mhla_selection"  # transformer.__dict__ key: how apply_mhla(layers="auto") chose the layers


def record_selection(transformer: nn.Module, selection: dict) -> None:
    """Remember how the MHLA layers of ``transformer`` were chosen (``layers="auto"``), for :func:`mhla_spec`.

    Loading a converted folder puts its recorded selection back, so a re-saved model keeps it;
    :func:`remove_mhla` forgets it, and :func:`mhla_spec` drops it once the MHLA layers differ from it.
    """
    transformer.__dict__[_SELECTION] = dict(selection)


def _cost_fraction(stock: Sequence[int], mhla: Sequence[int], chosen: Sequence[int]) -> float:
    cost = sum(mhla[i] if i in chosen else stock[i] for i in range(len(stock)))
    return cost / sum(stock)


def layer_attention_flops(
    transformer: nn.Module, *, num_blocks: int | None = None, block_grid: Sequence[int] | str | None = None
) -> tuple[list[int], list[int]]:
    """Per self-attention layer, the attention FLOPs at the model's native token grid (``N`` tokens,
    the family's :attr:`~mhla_diffusers.models.families.Family.reference_grid`) of the stock layer
    (softmax ``heads * 4 N^2 d``; SANA's linear attention ``heads * 4 N d^2``) and of MHLA with the block
    grid these settings give (``heads * (4 N d^2 + 2 M^2 d^2)``), see
    :func:`~mhla_diffusers.models.hybrid.attention_flops`. Returns ``(stock, mhla)``, two lists of ints.
    """
    family = family_of(transformer)
    reference = family.reference_grid(transformer.config)
    grid = MHLAProcessor(num_blocks=num_blocks, block_grid=block_grid).resolve_block_grid(reference, family)
    tokens, blocks = reference[0] * reference[1] * reference[2], grid[0] * grid[1] * grid[2]
    stock, mhla = [], []
    for _, attn in self_attention_modules(transformer, family):
        heads = int(attn.heads)
        head_dim = (attn.to_q.out_features if hasattr(attn, "to_q") else attn.inner_dim) // heads
        stock.append(attention_flops(family.stock_attention, tokens, head_dim, heads))
        mhla.append(attention_flops("mhla", tokens, head_dim, heads, blocks))
    return stock, mhla


def attention_cost(
    transformer: nn.Module,
    layers: str | Sequence[int] = "all",
    *,
    num_blocks: int | None = None,
    block_grid: Sequence[int] | str | None = None,
) -> float:
    """The attention cost of the model with MHLA on ``layers``, as a fraction of the stock model's.

    ``sum over layers of (MHLA FLOPs if converted else stock FLOPs) / sum of stock FLOPs``, per layer
    from :func:`layer_attention_flops`: at the native token grid (``N`` tokens), softmax
    ``heads * 4 N^2 d`` vs MHLA ``heads * (4 N d^2 + 2 M^2 d^2)`` (projections, the same for both,
    excluded). E.g. the demo DiT (4 heads x 32, M = 16 at N = 256): MHLA costs 0.14 of softmax per layer.

    Args:
        layers: as :func:`apply_mhla` takes them (not ``"auto"``): the layers that would be MHLA.
        num_blocks, block_grid: the MHLA settings (as :func:`apply_mhla`).

    Raises:
        ValueError: unsupported model or bad ``layers``.
    """
    stock, mhla = layer_attention_flops(transformer, num_blocks=num_blocks, block_grid=block_grid)
    return _cost_fraction(stock, mhla, select_layers(len(stock), layers))


def remove_mhla(transformer: nn.Module) -> list[str]:
    """Undo :func:`apply_mhla` / MHLA processors: stock processors back, mixing matrices removed.

    Returns the names of the attention modules that had MHLA.
    """
    family = family_of(transformer)
    removed = []
    for key, attn in attention_modules(transformer).items():
        had = getattr(attn, "mhla_mixing", None) is not None
        for name in [n for n in attn._modules if n.startswith("mhla_")]:  # mixing matrix, output norm
            delattr(attn, name)
        if isinstance(attn.processor, MHLAProcessor):
            attn.set_processor(stock_processor(family, key[: -len(".processor")]))
            had = True
        attn.__dict__.pop("_mhla_grids", None)
        attn.__dict__.pop(_CHECKED_BY, None)
        remove_load_hook(attn)
        if had:
            removed.append(key[: -len(".processor")])
    for key in (_WARNED, _SOURCE_CHECKED, _SELECTION):  # the one-liner's once-per-model warnings may come again
        transformer.__dict__.pop(key, None)
    remove_grid_hooks(transformer)
    return removed


def set_attn_processor(model: nn.Module, processor) -> None:
    """``model.set_attn_processor`` for every diffusers model, including those lacking it (DiT).

    Args:
        model: a diffusers model with attention modules.
        processor: one processor for every attention layer, or a dict ``{"<path>.processor": proc}``;
            unlike diffusers' own method the dict may be partial (other layers keep theirs).

    For :class:`MHLAProcessor` entries on a supported transformer, the mixing matrices of the
    self-attention layers are created now and the grid hooks installed; cross-attention layers
    given an :class:`MHLAProcessor` run the stock computation.

    Raises:
        ValueError: for dict keys that name no attention layer.
    """
    current = attention_modules(model)
    if isinstance(processor, Mapping):
        unknown = sorted(set(processor) - set(current))
        if unknown:
            raise ValueError(f"no attention layer named {unknown[:5]}; valid keys look like {sorted(current)[:3]}")
        mapping = {key: processor.get(key, attn.processor) for key, attn in current.items()}
    else:
        mapping = {key: processor for key in current}
    uses_mhla = any(isinstance(p, MHLAProcessor) for p in mapping.values())
    if uses_mhla:
        family = family_of(model)
        reference = family.reference_grid(model.config)
        warn_fresh_mixing(model)
        for name, attn in self_attention_modules(model, family):
            proc = mapping.get(f"{name}.processor")
            if isinstance(proc, MHLAProcessor):
                proc.attach(attn, reference, family=family)
    if hasattr(model, "set_attn_processor"):
        model.set_attn_processor(dict(mapping))
    else:
        for key, attn in current.items():
            attn.set_processor(mapping[key])
    if uses_mhla:
        install_grid_hooks(model)


def is_mhla_model(model: nn.Module) -> bool:
    """Whether any attention layer of ``model`` runs MHLA: an :class:`MHLAProcessor` with its mixing
    matrix, or one on a self-attention layer of a supported transformer whose matrix is created at its
    first forward (the bare one-liner ``model.set_attn_processor(MHLAProcessor())``).

    Layers that keep a mixing matrix but run another processor (diffusers' own
    ``set_attn_processor(<stock processor>)`` after MHLA, see :func:`idle_mhla_layers`) do not count: a
    model whose layers all run stock processors is a stock model."""
    if any(_runs_mhla(attn) for attn in attention_modules(model).values()):
        return True
    return bool(pending_mhla_layers(model))


def _runs_mhla(attn: nn.Module) -> bool:
    return isinstance(getattr(attn, "processor", None), MHLAProcessor) and getattr(attn, "mhla_mixing", None) is not None


def idle_mhla_layers(model: nn.Module) -> dict[str, str]:
    """``{attention path: processor class name}`` of the layers that keep MHLA parameters (a mixing
    matrix, an output norm) but run another processor, e.g. after diffusers' own
    ``model.set_attn_processor(<stock processor>)``: those layers compute the stock attention, and
    neither :func:`is_mhla_model` nor :func:`mhla_spec` (so no saved checkpoint) counts them. Their
    matrices stay on the model: ``set_attn_processor(MHLAProcessor())`` runs them again,
    :func:`remove_mhla` drops them."""
    return {
        key[: -len(".processor")]: type(attn.processor).__name__
        for key, attn in attention_modules(model).items()
        if any(name.startswith("mhla_") for name in attn._modules) and not isinstance(attn.processor, MHLAProcessor)
    }


def mhla_spec(transformer: nn.Module) -> dict | None:
    """The MHLA settings of a model as written to ``mhla_config.json``, or ``None`` without MHLA.

    Keys: family, model_class, num_layers, layers, block_grid, num_blocks, normalize, eps, backend,
    and ``output_norm: true`` only for models whose MHLA layers have the per-head output RMSNorm
    (absent means none, as in checkpoints written before it existed), ``feature_eps`` only when
    not 0 and ``mixing_clamp: false`` only for unclamped mixing matrices (absent: 0 and true);
    ``selection`` only for layers chosen by ``apply_mhla(layers="auto")`` (while they are still the MHLA
    layers): ``{"method": "auto", "keep_softmax": K | "max_attention_cost": F, "attention_cost": the
    fraction reached, "softmax_layers", "scores": one per layer, "sensitivity": how they were measured}``.
    Self-attention layers that run an :class:`MHLAProcessor` whose mixing matrix is not created yet
    (the bare one-liner before its first forward) count as MHLA layers, with the block grid and
    output norm their first forward would give them (see :func:`materialize_mhla`); layers that
    keep a mixing matrix but run another processor (:func:`idle_mhla_layers`) do not.

    Raises:
        ValueError: when the MHLA layers disagree on settings (not representable in one config), or a
            layer's processor has an explicit block spec its mixing matrix contradicts
            (:meth:`MHLAProcessor.check_layer`).
    """
    family = family_of(transformer)
    modules = self_attention_modules(transformer, family)
    layers, specs = [], set()
    reference = None
    for i, (_, attn) in enumerate(modules):
        mixing = getattr(attn, "mhla_mixing", None)
        proc = getattr(attn, "processor", None)
        if mixing is None:
            if not isinstance(proc, MHLAProcessor):
                continue
            # created at the first forward: the settings that forward will give the layer
            reference = reference or family.reference_grid(transformer.config)
            block_grid = tuple(proc.resolve_block_grid(reference, family))
            output_norm = getattr(attn, "mhla_output_norm", None) is not None or proc.resolve_output_norm(family)
        else:
            if not isinstance(proc, MHLAProcessor):
                continue  # runs another processor: its matrix is idle, the layer computes that processor's attention
            reference = reference or family.reference_grid(transformer.config)
            proc.check_layer(attn, reference, family)  # a processor whose explicit spec the matrix contradicts
            block_grid = mixing.block_grid
            output_norm = getattr(attn, "mhla_output_norm", None) is not None
        layers.append(i)
        eps = family.default_eps if proc.eps is None else proc.eps
        clamp = True if mixing is None else mixing.clamp
        specs.add((tuple(block_grid), proc.normalize, eps, proc.backend, output_norm, proc.feature_eps, clamp))
    if not layers:
        return None
    if len(specs) > 1:
        raise ValueError(f"MHLA layers use different settings {sorted(specs)}; one checkpoint config holds one setting")
    block_grid, normalize, eps, backend, output_norm, feature_eps, clamp = specs.pop()
    extra = {"output_norm": True} if output_norm else {}  # absent = no output norm (format version 1)
    if feature_eps:  # absent = 0 (phi = ReLU), as in checkpoints written before it existed
        extra["feature_eps"] = feature_eps
    if not clamp:  # absent = clamped to [0, 1]
        extra["mixing_clamp"] = False
    selection = transformer.__dict__.get(_SELECTION)
    if selection is not None and selection.get("softmax_layers") == [i for i in range(len(modules)) if i not in layers]:
        extra["selection"] = selection  # absent: chosen by a fixed rule or by hand
    return {
        "family": family.name,
        "model_class": type(transformer).__name__,
        "num_layers": len(modules),
        "layers": layers,
        "block_grid": list(block_grid),
        "num_blocks": block_grid[0] * block_grid[1] * block_grid[2],
        "normalize": normalize,
        "eps": eps,
        "backend": backend,
        **extra,
    }
