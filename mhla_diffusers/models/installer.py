"""MHLA on given self-attention layers of a diffusers transformer: install, remove, inspect.

The mechanism under :func:`~mhla_diffusers.apply_mhla` (``models/install.py``, which turns ``layers=``
into indices with :mod:`mhla_diffusers.selection`); the sensitivity measurement installs MHLA one
layer at a time with :func:`install_mhla`. ``set_attn_processor`` for any model.
"""

from __future__ import annotations

from typing import Mapping, Sequence

from torch import nn

from mhla_diffusers.models import spec as settings_spec
from mhla_diffusers.models.families import attention_modules, family_of, self_attention_modules, stock_processor
from mhla_diffusers.models.grid import install_grid_hooks, remove_grid_hooks
from mhla_diffusers.models.lazy import forget_first_forward, pending_mhla_layers, remove_load_hook
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
    for name, value in (("lepe", lepe), ("input_norm", input_norm)):
        if not isinstance(value, bool):
            raise ValueError(f"{name} must be True or False; got {value!r}")
    processor = _resolved_processor(family, reference, num_blocks=num_blocks, block_grid=block_grid, normalize=normalize,
                                    eps=eps, backend=backend, output_norm=output_norm, feature_eps=feature_eps,
                                    feature_power=feature_power, rope=rope, gate=gate, lepe=lepe, input_norm=input_norm,
                                    denominator=denominator)
    _refuse_installed(transformer, [modules[i] for i in chosen])
    warn_fresh_mixing(transformer)
    names = []
    for i in chosen:
        name, attn = modules[i]
        mixing = processor.attach(attn, reference, init=init, family=family, lepe_init=lepe_init)
        mixing.clamp = bool(mixing_clamp)
        attn.set_processor(processor)
        names.append(name)
    install_grid_hooks(transformer)
    return names


def _resolved_processor(family, reference, *, eps, **settings) -> MHLAProcessor:
    """The processor :func:`install_mhla` installs, block grid, output norm, gate and LePE resolved on ``reference``
    (``rope="none"`` on a family without RoPE: the default, nothing to rotate)."""
    processor = MHLAProcessor(eps=family.default_eps if eps is None else eps, family=family, **settings)
    settings_spec.check_family_settings(processor, family)
    resolved = processor.resolve_block_grid(reference, family)
    processor.block_grid, processor.block_grid_preset = resolved, None
    processor.output_norm = processor.resolve_output_norm(family)
    processor.gate = settings_spec.resolve_gate(processor) or False
    processor.lepe = settings_spec.resolve_lepe(processor)
    processor.input_norm = settings_spec.resolve_input_norm(processor)
    if family.rotary is None:
        processor.rope = None
    for axis, (n, b) in enumerate(zip(reference, resolved)):
        if b > n:
            raise ValueError(
                f"block grid {resolved} does not fit the model's native token grid {reference} on axis {'THW'[axis]}"
            )
    return processor


def _refuse_installed(transformer: nn.Module, chosen: list[tuple[str, nn.Module]]) -> None:
    """Raise ``ValueError`` naming ``remove_mhla`` if a chosen layer already has a mixing matrix."""
    already = [name for name, attn in chosen if getattr(attn, "mhla_mixing", None) is not None]
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
    """Undo :func:`apply_mhla` / MHLA processors: stock processors back, mixing matrices (and output norms, gates,
    LePE convolutions) removed.

    Returns the names of the attention modules that had MHLA.
    """
    family = family_of(transformer)
    removed = []
    for key, attn in attention_modules(transformer).items():
        had = getattr(attn, "mhla_mixing", None) is not None
        for name in [n for n in attn._modules if n.startswith("mhla_")]:  # mixing matrix, output norm, gate, LePE
            delattr(attn, name)
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


def _layer_settings(proc: MHLAProcessor, attn: nn.Module, family, reference) -> tuple:
    """``(block grid, normalize, eps, backend, optional)`` of one MHLA layer, ``optional`` the values of
    :data:`~mhla_diffusers.models.spec.SETTINGS_OFF`'s keys in its order (``""`` for ``None``: comparable);
    a pending one-liner layer gives the settings its first forward will create."""
    mixing = getattr(attn, "mhla_mixing", None)
    if mixing is None:  # created at the first forward
        block_grid = tuple(proc.resolve_block_grid(reference, family))
        output_norm = getattr(attn, "mhla_output_norm", None) is not None or proc.resolve_output_norm(family)
        gate, lepe = settings_spec.resolve_gate(proc), settings_spec.resolve_lepe(proc)
        input_norm = settings_spec.resolve_input_norm(proc)
    else:
        proc.check_layer(attn, reference, family)  # a processor whose explicit spec the matrix contradicts
        block_grid = mixing.block_grid
        output_norm = getattr(attn, "mhla_output_norm", None) is not None
        gate = getattr(getattr(attn, "mhla_gate", None), "form", None)
        lepe = getattr(attn, "mhla_lepe", None) is not None
        input_norm = getattr(attn, "mhla_input_norm", None) is not None
    eps = family.default_eps if proc.eps is None else proc.eps
    rope = proc.rope if family.rotary is not None and proc.rope in ("before", "none") else None
    optional = dict(output_norm=bool(output_norm), feature_eps=proc.feature_eps, feature_power=proc.feature_power,
                    mixing_clamp=True if mixing is None else mixing.clamp, rope=rope or "", gate=gate or "", lepe=lepe,
                    input_norm=input_norm, denominator=proc.denominator)
    return tuple(block_grid), proc.normalize, eps, proc.backend, tuple(optional[key] for key in settings_spec.SETTINGS_OFF)


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
    layers, specs = [], set()
    reference = None
    for i, (_, attn) in enumerate(modules):
        proc = getattr(attn, "processor", None)
        if not isinstance(proc, MHLAProcessor):
            continue  # no MHLA, or another processor: a matrix there is idle, the layer computes that processor's attention
        reference = reference or family.reference_grid(transformer.config)
        layers.append(i)
        specs.add(_layer_settings(proc, attn, family, reference))
    if not layers:
        return None
    if len(specs) > 1:
        raise ValueError(f"MHLA layers use different settings {sorted(specs)}; one checkpoint config holds one setting")
    block_grid, normalize, eps, backend, optional = specs.pop()
    extra = {}  # only the settings that are on
    for key, value in zip(settings_spec.SETTINGS_OFF, optional):
        if key in ("rope", "gate"):
            value = value or None  # "" stood for None in the comparable tuple
        if value != settings_spec.SETTINGS_OFF[key]:
            extra[key] = value
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
