"""Install and remove MHLA on a diffusers transformer; ``set_attn_processor`` for any model."""

from __future__ import annotations

from typing import Mapping, Sequence

from torch import nn

from mhla_diffusers.models.families import attention_modules, family_of, self_attention_modules, stock_processor
from mhla_diffusers.models.grid import install_grid_hooks, remove_grid_hooks
from mhla_diffusers.models.hybrid import select_layers
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
    "remove_mhla",
    "set_attn_processor",
    "attention_modules",
    "is_mhla_model",
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
            MHLA on 20 of 30) or layer indices.
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

    Returns:
        Names of the converted attention modules.

    Raises:
        ValueError: unsupported model, bad ``layers``, a block grid that does not fit the model's
            native token grid, or a selected layer that already has MHLA (``remove_mhla`` first).
    """
    family = family_of(transformer)
    modules = self_attention_modules(transformer, family)
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
    return names


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
    for key in (_WARNED, _SOURCE_CHECKED):  # the one-liner's once-per-model warnings may come again
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
    """Whether any attention layer of ``model`` has MHLA installed: a mixing matrix, or an
    :class:`MHLAProcessor` on a self-attention layer of a supported transformer whose matrix is
    created at its first forward (the bare one-liner ``model.set_attn_processor(MHLAProcessor())``)."""
    if any(getattr(attn, "mhla_mixing", None) is not None for attn in attention_modules(model).values()):
        return True
    return bool(pending_mhla_layers(model))


def mhla_spec(transformer: nn.Module) -> dict | None:
    """The MHLA settings of a model as written to ``mhla_config.json``, or ``None`` without MHLA.

    Keys: family, model_class, num_layers, layers, block_grid, num_blocks, normalize, eps, backend,
    and ``output_norm: true`` only for models whose MHLA layers have the per-head output RMSNorm
    (absent means none, as in checkpoints written before it existed), ``feature_eps`` only when
    not 0 and ``mixing_clamp: false`` only for unclamped mixing matrices (absent: 0 and true).
    Self-attention layers that run an :class:`MHLAProcessor` whose mixing matrix is not created yet
    (the bare one-liner before its first forward) count as MHLA layers, with the block grid and
    output norm their first forward would give them (see :func:`materialize_mhla`).

    Raises:
        ValueError: when the MHLA layers disagree on settings (not representable in one config), or a
            layer's processor has an explicit block spec its mixing matrix contradicts
            (:meth:`MHLAProcessor.check_layer`).
    """
    family = family_of(transformer)
    modules = self_attention_modules(transformer, family)
    layers, specs = [], set()
    reference = None
    for i, (name, attn) in enumerate(modules):
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
                raise ValueError(f"{name} has a mixing matrix but its processor is {type(proc).__name__}, not MHLAProcessor")
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
