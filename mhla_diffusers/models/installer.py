"""MHLA on given self-attention layers of a diffusers transformer: install, remove, inspect.

The mechanism under :func:`~mhla_diffusers.apply_mhla` (``mhla_diffusers/apply.py``, which turns ``layers=``
into indices with :mod:`mhla_diffusers.selection`); the sensitivity measurement installs MHLA one
layer at a time with :func:`install_mhla`. ``set_attn_processor`` for any model. What a checkpoint records
(:func:`mhla_spec`) is read from the layers' own MHLA (``attn.mhla``).
"""

from __future__ import annotations

import math
from typing import Mapping, Sequence

from torch import nn

from mhla_diffusers.families import attention_modules, family_of, self_attention_modules, stock_processor
from mhla_diffusers.models import spec as settings_spec
from mhla_diffusers.models.grid import install_grid_hooks, remove_grid_hooks
from mhla_diffusers.models.layer import create_layer
from mhla_diffusers.models.lazy import forget_first_forward, pending_mhla_layers, remove_load_hook
from mhla_diffusers.models.offload import follow_group_offloading
from mhla_diffusers.models.processor import MHLAProcessor
from mhla_diffusers.models.provenance import warn_fresh_mixing

__all__ = [
    "install_mhla",
    "record_selection",
    "remove_mhla",
    "set_attn_processor",
    "is_mhla_model",
    "idle_mhla_layers",
    "mhla_spec",
]


def install_mhla(
    transformer: nn.Module,
    layers: Sequence[int],
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
    gate: bool | str | None = False,
    lepe: bool = False,
    lepe_init: str = "zeros",
    input_norm: bool = False,
    denominator: str = "paper",
) -> list[str]:
    """MHLA on the self-attention layers of index ``layers``: :func:`~mhla_diffusers.apply_mhla` once the layers are known.

    Returns:
        Names of the converted attention modules.

    Raises:
        ValueError: unsupported model, bad settings, a block grid not fitting the native grid, a layer with MHLA.
    """
    family = family_of(transformer)
    modules = self_attention_modules(transformer, family)
    chosen = list(layers)
    reference = family.reference_grid(transformer.config)
    settings_spec.check_mixing_init(init)
    settings_spec.check_lepe_init(lepe_init)
    for name, value in (("lepe", lepe), ("input_norm", input_norm), ("normalize", normalize), ("mixing_clamp", mixing_clamp)):
        if not isinstance(value, bool):
            raise ValueError(f"{name} must be True or False; got {value!r}")
    request = MHLAProcessor(num_blocks=num_blocks, block_grid=block_grid, normalize=normalize, eps=eps, family=family,
                            output_norm=output_norm, feature_eps=feature_eps, feature_power=feature_power, rope=rope,
                            gate=gate, lepe=lepe, input_norm=input_norm, denominator=denominator, mixing_clamp=mixing_clamp)
    settings = _fitting_settings(request, family, reference)
    _refuse_installed(transformer, [modules[i] for i in chosen])
    warn_fresh_mixing(transformer)
    runner = MHLAProcessor(backend=backend, family=family)  # the layers hold their settings; the processor runs them
    names = []
    for i in chosen:
        name, attn = modules[i]
        create_layer(attn, settings, family, init=init, lepe_init=lepe_init)
        attn.set_processor(runner)
        names.append(name)
    follow_group_offloading(transformer, [modules[i] for i in chosen])
    install_grid_hooks(transformer)
    return names


def _fitting_settings(request: MHLAProcessor, family, reference) -> settings_spec.LayerSettings:
    """The layer settings ``request`` gives on ``family``'s native grid ``reference``; ``ValueError`` for a block grid
    larger than that grid on some axis."""
    settings = settings_spec.resolve_settings(request, family, reference)
    for axis, (n, b) in enumerate(zip(reference, settings.block_grid)):
        if b > n:
            raise ValueError(
                f"block grid {settings.block_grid} does not fit the model's native token grid {reference} on axis {'THW'[axis]}"
            )
    return settings


def _refuse_installed(transformer: nn.Module, chosen: list[tuple[str, nn.Module]]) -> None:
    """Raise ``ValueError`` naming ``remove_mhla`` if a chosen layer already has a mixing matrix."""
    already = [name for name, attn in chosen if getattr(attn, "mhla", None) is not None]
    if not already:
        return
    idle = idle_mhla_layers(transformer)
    if set(already) <= set(idle):
        raise ValueError(
            f"{already} keep the mixing matrices of an earlier MHLA install but run {sorted(set(idle.values()))} "
            "(set by set_attn_processor): call mhla_diffusers.remove_mhla(transformer) first to install MHLA "
            "afresh, or set_attn_processor(MHLAProcessor()) to run those matrices again"
        )
    raise ValueError(f"MHLA is already installed on {already}; call mhla_diffusers.remove_mhla(transformer) first")


_SELECTION = "_mhla_selection"  # transformer.__dict__ key: how apply_mhla(layers="auto") chose the layers


def record_selection(transformer: nn.Module, selection: dict) -> None:
    """Remember how the MHLA layers of ``transformer`` were chosen (``layers="auto"``), for :func:`mhla_spec`.

    Loading a converted folder puts its recorded selection back, so a re-saved model keeps it;
    :func:`remove_mhla` forgets it, and :func:`mhla_spec` drops it once the MHLA layers differ from it.
    """
    transformer.__dict__[_SELECTION] = dict(selection)


def remove_mhla(transformer: nn.Module) -> list[str]:
    """Undo :func:`apply_mhla` / MHLA processors: stock processors back, each layer's MHLA (``attn.mhla``: mixing
    matrix, output norm, gate, LePE) removed.

    Returns the names of the attention modules that had MHLA.
    """
    family = family_of(transformer)
    removed = []
    for key, attn in attention_modules(transformer).items():
        had = getattr(attn, "mhla", None) is not None
        if had:
            delattr(attn, "mhla")
        if isinstance(attn.processor, MHLAProcessor):
            attn.set_processor(stock_processor(family, key[: -len(".processor")]))
            had = True
        remove_load_hook(attn)
        if had:
            removed.append(key[: -len(".processor")])
    transformer.__dict__.pop(_SELECTION, None)
    forget_first_forward(transformer)  # the one-liner's once-per-model warnings may come again
    remove_grid_hooks(transformer)
    return removed


def _layer_record(proc: MHLAProcessor, attn: nn.Module, family, reference) -> tuple:
    """``(LayerSettings, backend)`` of one MHLA layer: its own record, checked against its processor's explicit
    settings, or, for a pending one-liner layer, what its first forward will create."""
    layer = getattr(attn, "mhla", None)
    if layer is None:  # created at the first forward
        return settings_spec.resolve_settings(proc, family, reference), proc.backend
    if layer.unsettled:
        layer.settle(settings_spec.resolve_settings(proc, family, reference, block_grid=layer.mixing.block_grid))
    settings_spec.check_layer(proc, layer, reference, family)  # a processor the layer contradicts: refused, never saved
    return layer.settings, proc.backend


def set_attn_processor(model: nn.Module, processor) -> None:
    """``model.set_attn_processor`` for every diffusers model, including those lacking it (DiT).

    ``processor``: one for every attention layer, or a (possibly partial) dict ``{"<path>.processor": proc}``.
    :class:`MHLAProcessor` entries get their mixing matrices and grid hooks now; on cross-attention they run stock.

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
        modules = [(attn, mapping.get(f"{name}.processor")) for name, attn in self_attention_modules(model, family)]
        for attn, proc in modules:  # every contradiction refused before any layer changes
            if isinstance(proc, MHLAProcessor) and getattr(attn, "mhla", None) is not None:
                settings_spec.check_layer(proc, attn.mhla, reference, family)
        for attn, proc in modules:
            if isinstance(proc, MHLAProcessor):
                proc.attach(attn, reference, family=family)
        follow_group_offloading(model, self_attention_modules(model, family))
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
    return isinstance(getattr(attn, "processor", None), MHLAProcessor) and getattr(attn, "mhla", None) is not None


def idle_mhla_layers(model: nn.Module) -> dict[str, str]:
    """``{attention path: processor class name}`` of the layers that keep their MHLA (``attn.mhla``: a mixing
    matrix, ...) but run another processor, e.g. after diffusers' own
    ``model.set_attn_processor(<stock processor>)``: those layers compute the stock attention, and
    neither :func:`is_mhla_model` nor :func:`mhla_spec` (so no saved checkpoint) counts them. Their
    matrices stay on the model: ``set_attn_processor(MHLAProcessor())`` runs them again,
    :func:`remove_mhla` drops them."""
    return {
        key[: -len(".processor")]: type(attn.processor).__name__
        for key, attn in attention_modules(model).items()
        if getattr(attn, "mhla", None) is not None and not isinstance(attn.processor, MHLAProcessor)
    }


def mhla_spec(transformer: nn.Module) -> dict | None:
    """The MHLA settings of a model as written to ``mhla_config.json``, or ``None`` without MHLA.

    Keys: family, model_class, num_layers, layers, block_grid, num_blocks, normalize, eps, backend; and
    only when not the default: ``output_norm``, ``feature_eps``, ``feature_power``, ``mixing_clamp``, ``rope``,
    ``gate``, ``lepe``, ``input_norm``, ``denominator``, ``selection``. Pending one-liner layers count as MHLA; idle
    ones do not. Keys in full:
    ``docs/processor.md`` (``mhla_spec``).

    Raises:
        ValueError: the MHLA layers disagree on settings, or a processor's block spec contradicts its matrix.
    """
    family = family_of(transformer)
    modules = self_attention_modules(transformer, family)
    layers, records = [], set()
    reference = None
    for i, (_, attn) in enumerate(modules):
        proc = getattr(attn, "processor", None)
        if not isinstance(proc, MHLAProcessor):
            continue  # no MHLA, or another processor: a matrix there is idle, the layer computes that processor's attention
        reference = reference or family.reference_grid(transformer.config)
        layers.append(i)
        records.add(_layer_record(proc, attn, family, reference))
    if not layers:
        return None
    if len(records) > 1:
        raise ValueError(f"MHLA layers use different settings {sorted(records, key=repr)}; one checkpoint config holds one setting")
    settings, backend = records.pop()
    return {
        "family": family.name,
        "model_class": type(transformer).__name__,
        "num_layers": len(modules),
        "layers": layers,
        "block_grid": list(settings.block_grid),
        "num_blocks": math.prod(settings.block_grid),
        "normalize": settings.normalize,
        "eps": settings.eps,
        "backend": backend,
        **_settings_on(settings),
        **_selection_of(transformer, layers, len(modules)),
    }


def _settings_on(settings: settings_spec.LayerSettings) -> dict:
    """The optional settings (:data:`~mhla_diffusers.models.spec.SETTINGS_OFF`) that are on; ``rope="after"``, the
    default where the family has RoPE, is written as absent."""
    out = {}
    for key, off in settings_spec.SETTINGS_OFF.items():
        value = getattr(settings, key)
        if key == "rope" and value == "after":
            value = None
        if value != off:
            out[key] = value
    return out


def _selection_of(transformer: nn.Module, layers: list[int], num_layers: int) -> dict:
    """``{"selection": record}`` when :func:`record_selection`'s record still describes ``layers``, else ``{}``."""
    selection = transformer.__dict__.get(_SELECTION)
    if selection is not None and selection.get("softmax_layers") == [i for i in range(num_layers) if i not in layers]:
        return {"selection": selection}
    return {}  # chosen by a fixed rule or by hand
