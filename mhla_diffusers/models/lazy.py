"""The bare one-liner, ``transformer.set_attn_processor(MHLAProcessor())``: block grid and mixing matrices come later.

A module-registration hook sees the processor set on a layer, which then waits for its transformer;
its first forward (or :func:`materialize_mhla`) creates the matrix. See ``docs/processor.md`` (Installing).
"""

from __future__ import annotations

import warnings
import weakref

import torch
from torch import nn

from mhla_diffusers.families import (
    attention_family,
    attention_modules,
    family_of,
    find_family,
    self_attention_modules,
    supported_model_classes,
)
from mhla_diffusers.models import spec
from mhla_diffusers.models.grid import GridReader, await_model, close_frame, current_model, install_grid_hooks
from mhla_diffusers.models.layer import MHLALayer, attach, create_layer, layer_requires_grad
from mhla_diffusers.models.offload import follow_group_offloading
from mhla_diffusers.models.provenance import warn_fresh_mixing

__all__ = [
    "forget_first_forward",
    "materialize_mhla",
    "layer_at_first_forward",
    "pending_mhla_layers",
    "remove_load_hook",
    "track_processor",
]

_WARNED = "_mhla_created_at_forward_warned"  # model.__dict__ key: the warning below was given
_SOURCE_CHECKED = "_mhla_source_checked"  # model.__dict__ key: checked for a stock load of a converted folder

_NOT_MATERIALIZED = (
    "{what} of a model whose MHLA mixing matrices do not exist yet (diffusers' own "
    "set_attn_processor(MHLAProcessor()), the bare one-liner, creates them at the first forward, outside any "
    "graph): call mhla_diffusers.materialize_mhla(transformer) after set_attn_processor and before {what} "
    "(or install MHLA with mhla_diffusers.apply_mhla / mhla_diffusers.set_attn_processor)"
)


def layer_at_first_forward(processor, attn) -> MHLALayer:
    """Create the MHLA of ``attn`` (``attn.mhla``), which has none, inside the running transformer's forward.

    Raises:
        RuntimeError: outside a supported transformer, and under ``torch.export`` /
            ``torch.compile(fullgraph=True)`` (naming ``materialize_mhla``).
    """
    if torch.compiler.is_exporting():
        # torch.export (non-strict) runs no always_call forward hook when the forward raises: close
        # the running model's grid frame here, or it would outlive the export
        model = current_model()
        if model is not None:
            close_frame(model)
        raise RuntimeError(_NOT_MATERIALIZED.format(what="torch.export"))
    if torch.compiler.is_compiling():
        # traced first forward: every pending layer's parameters are created eagerly (graph breaks, this
        # call only; the next call recompiles into one graph with the new parameters)
        return _materialize_eagerly(processor, attn)
    model = current_model()
    if model is None:
        raise RuntimeError(
            "this attention layer has no MHLA mixing matrix yet and runs outside a supported transformer: MHLA "
            f"supports {supported_model_classes()} (another class is refused, never run by guess: its attention "
            "may differ, e.g. q/k norms over all heads). In a supported transformer, install MHLA with "
            "mhla_diffusers.apply_mhla(transformer)"
        )
    running = family_of(model)
    if not model.__dict__.get(_SOURCE_CHECKED):  # once per model, before its first matrix exists
        model.__dict__[_SOURCE_CHECKED] = True
        warn_fresh_mixing(model)
    layer = attach(processor, attn, running.reference_grid(model.config), family=running, requires_grad=layer_requires_grad(attn))
    follow_group_offloading(model, [(name, m) for name, m in model.named_modules() if m is attn])
    _warn_created_at_forward(model, compiled=False)
    return layer


@torch.compiler.disable(reason=_NOT_MATERIALIZED.format(what="torch.compile(fullgraph=True)"))
def _materialize_eagerly(processor, attn) -> MHLALayer:
    """The running model's pending MHLA layers get their matrices now (outside the traced graph)."""
    model = current_model()
    if model is not None:
        materialize_mhla(model)
        _warn_created_at_forward(model, compiled=True)
    layer = getattr(attn, "mhla", None)
    return layer if layer is not None else layer_at_first_forward(processor, attn)


def _warn_created_at_forward(model: nn.Module, compiled: bool) -> None:
    """The bare one-liner's matrices were just created by a forward: say so, once per model (not for
    pure inference, grad disabled and eval mode, as in a pipeline's call)."""
    if model.__dict__.get(_WARNED) or not (compiled or torch.is_grad_enabled() or model.training):
        return
    model.__dict__[_WARNED] = True
    if compiled:
        what = (
            "torch.compile traced it before they existed, so they were created eagerly and this compiled code has "
            "graph breaks"
        )
    else:
        what = (
            "an optimizer, EMA (diffusers' EMAModel) or state dict taken before this forward does not hold them, "
            "and they have the requires_grad of each layer's projection weights"
        )
    warnings.warn(
        f"MHLA created the mixing matrices of this {type(model).__name__} at its first forward (diffusers' own "
        f"set_attn_processor(MHLAProcessor()), the bare one-liner, cannot create them earlier): {what}. Call "
        "mhla_diffusers.materialize_mhla(transformer) right after set_attn_processor (or install MHLA with "
        "mhla_diffusers.apply_mhla), before building an optimizer or EMA, loading a state dict or compiling",
        UserWarning,
        stacklevel=2,
    )


def forget_first_forward(model: nn.Module) -> None:
    """Forget that ``model``'s first forward warned and checked its source (``remove_mhla``: they may come again)."""
    model.__dict__.pop(_WARNED, None)
    model.__dict__.pop(_SOURCE_CHECKED, None)


# -- load_state_dict before the first forward ------------------------------------------------------
_PENDING_LOAD = "this layer runs MHLAProcessor but has no mixing matrix yet"


class _PendingMixingLoader:
    """``load_state_dict`` pre-hook creating a pending layer's matrix when its block grid is known without the model."""

    def __call__(self, attn, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs):
        key = f"{prefix}mhla.mixing.weight"
        processor = getattr(attn, "processor", None)
        if key not in state_dict or getattr(attn, "mhla", None) is not None or not isinstance(processor, GridReader):
            return
        family = processor.family or attention_family(attn)
        block_grid = spec.explicit_block_grid(processor, None, family)
        if block_grid is not None:
            settings = spec.resolve_settings(processor, family, None, block_grid=block_grid)
            layer = create_layer(attn, settings, family, requires_grad=layer_requires_grad(attn))
            layer.verified = False  # made without the model: its first forward checks it against its family
            layer.unsettled = family is None  # and takes its family's defaults (eps, RoPE) there
            return
        if not any(_PENDING_LOAD in msg for msg in error_msgs):  # one message, not one per layer
            error_msgs.append(
                f"{key}: {_PENDING_LOAD} (diffusers' own set_attn_processor(MHLAProcessor()), the bare one-liner, "
                "creates it at the model's first forward from the transformer's native token grid, which the layer "
                "alone does not know), so the state dict's MHLA weights have nowhere to go. Call "
                "mhla_diffusers.materialize_mhla(model) before load_state_dict (or install MHLA with "
                "mhla_diffusers.apply_mhla / mhla_diffusers.set_attn_processor, or give the MHLAProcessor an explicit "
                "block_grid)"
            )


def _add_load_hook(attn: nn.Module) -> None:
    if not any(isinstance(getattr(h, "hook", None), _PendingMixingLoader) for h in attn._load_state_dict_pre_hooks.values()):
        attn.register_load_state_dict_pre_hook(_PendingMixingLoader())


def remove_load_hook(attn: nn.Module) -> None:
    """Remove the ``load_state_dict`` pre-hook the one-liner gave ``attn`` (no-op without one)."""
    hooks = attn._load_state_dict_pre_hooks
    for hook_id in [i for i, h in hooks.items() if isinstance(getattr(h, "hook", None), _PendingMixingLoader)]:
        del hooks[hook_id]


# -- the registration hook, while an MHLAProcessor exists ------------------------------------------
def _on_module_registration(module: nn.Module, name: str, submodule: nn.Module):
    """An ``MHLAProcessor`` set as a module's ``processor`` (diffusers' ``set_processor``): the layer can
    load MHLA weights, a setting the processor was given that contradicts the layer's MHLA is refused now
    (``ValueError``, the processor not set), what needs the model (``num_blocks``) at the next forward, and
    the layer waits for its transformer."""
    if name == "processor" and isinstance(submodule, GridReader):
        layer = getattr(module, "mhla", None)
        if layer is not None:
            spec.check_layer(submodule, layer, None, submodule.family or attention_family(module), partial=True)
            layer.verified = False
        _add_load_hook(module)
        await_model(module)
    return None


_registration = None
_live_processors = 0


def track_processor(processor: nn.Module) -> None:
    """Count ``processor`` among the live ones: the registration hook exists while one does."""
    global _registration, _live_processors
    _live_processors += 1
    if _registration is None:
        _registration = nn.modules.module.register_module_module_registration_hook(_on_module_registration)
    weakref.finalize(processor, _processor_gone)


def _processor_gone() -> None:
    global _registration, _live_processors
    _live_processors -= 1
    if _live_processors == 0 and _registration is not None:
        _registration.remove()
        _registration = None


# -- matrices created before the first forward -----------------------------------------------------
def pending_mhla_layers(model: nn.Module) -> list[str]:
    """Names of the self-attention layers that run an ``MHLAProcessor`` but have no mixing matrix yet
    (the bare one-liner before its first forward); ``[]`` for a model that is not a supported transformer."""
    family = find_family(model)
    if family is None:
        return []
    return [
        name
        for name, attn in self_attention_modules(model, family)
        if isinstance(getattr(attn, "processor", None), GridReader) and getattr(attn, "mhla", None) is None
    ]


def materialize_mhla(transformer: nn.Module) -> list[str]:
    """Create now the layers' MHLA (``attn.mhla``: mixing matrix, and output norm, gate, LePE where asked) the first
    forward would create for :func:`pending_mhla_layers`.

    Same block grid, locality init (gate and LePE at their neutral starts), fp32, ``requires_grad`` as the
    projection weights. Call it right after
    diffusers' ``set_attn_processor(MHLAProcessor())``, before an optimizer, EMA, state dict, compile or export.

    Returns:
        Names of the layers that got their matrices (``[]`` when none was pending).

    Raises:
        ValueError: an unsupported transformer with MHLA processors, or settings not fitting the model.
    """
    family = find_family(transformer)
    if family is None:
        if any(isinstance(getattr(a, "processor", None), GridReader) for a in attention_modules(transformer).values()):
            family_of(transformer)  # raises, naming the supported classes
        return []
    for attn in attention_modules(transformer).values():  # the stock processors the cross-attention layers call
        proc = getattr(attn, "processor", None)
        if isinstance(proc, GridReader):
            proc._stock_processor(family)
    pending = set(pending_mhla_layers(transformer))
    if not pending:
        return []
    reference = family.reference_grid(transformer.config)
    warn_fresh_mixing(transformer)
    done = []
    for name, attn in self_attention_modules(transformer, family):
        if name in pending:
            attach(attn.processor, attn, reference, family=family, requires_grad=layer_requires_grad(attn))
            done.append(name)
    follow_group_offloading(transformer, self_attention_modules(transformer, family))
    install_grid_hooks(transformer)
    return done
