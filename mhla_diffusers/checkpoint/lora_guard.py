"""LoRA adapters around a converted checkpoint: a save refuses a model with peft layers (naming the calls that
fix it) or writes it merged (``merge_lora=True``), and warns about MHLA matrices it leaves out; a load applies
the adapter a fine-tuning run saved beside the transformer (``transformer_lora/``).
"""

from __future__ import annotations

import contextlib
import warnings
from pathlib import Path
from typing import Iterator

from torch import nn

from mhla_diffusers.checkpoint.adapter import describe_lora, has_lora, load_lora, lora_is_fused, lora_merged
from mhla_diffusers.checkpoint.safetensors_file import MHLACheckpointError
from mhla_diffusers.models.installer import idle_mhla_layers

__all__: list[str] = []


def _lora_fixes(model: nn.Module, ref: str, pipe=None, component: str | None = None) -> tuple[str, str | None]:
    """``(keep, drop)``: the calls that leave ``model`` without peft layers, keeping the LoRA in its
    weights or dropping it (``None`` where no call does it); ``ref`` names the model in them."""
    fused = lora_is_fused(model)
    if pipe is not None and hasattr(pipe, "unload_lora_weights") and component in getattr(pipe, "_lora_loadable_modules", ()):
        fuse, unfuse, unload = "pipe.fuse_lora()", "pipe.unfuse_lora()", "pipe.unload_lora_weights()"
    elif hasattr(model, "fuse_lora") and hasattr(model, "unload_lora"):  # diffusers' PeftAdapterMixin (SANA, Wan)
        fuse, unfuse, unload = f"{ref}.fuse_lora()", f"{ref}.unfuse_lora()", f"{ref}.unload_lora()"
    else:  # DiT (peft.inject_adapter_in_model), text encoders: the functions of mhla_diffusers.checkpoint.lora
        merge, unload = (f"mhla_diffusers.checkpoint.lora.{f}({ref})" for f in ("merge_lora_", "unload_lora_"))
        return (f"{unload} (the fused weights stay)", None) if fused else (merge, unload)
    if fused:
        return f"{unload} (the fused weights stay)", f"{unfuse} then {unload}"
    return f"{fuse} then {unload}", unload


def check_saveable(models: dict[str, nn.Module], pipe=None, merge_lora: bool = False) -> None:
    """Refuse a model with peft adapters (unless ``merge_lora``); warn about idle MHLA matrices a save leaves out.

    Args:
        models: ``{component name: model}``.

    Raises:
        MHLACheckpointError: a model has LoRA adapters and ``merge_lora`` is False.
    """
    for name, model in models.items():
        if merge_lora or not has_lora(model):  # merge_lora: merged by merged_adapters
            continue
        ref = name if pipe is None else f"pipe.{name}"
        keep, drop = _lora_fixes(model, ref, pipe, name)
        raise MHLACheckpointError(
            f"{ref} carries {describe_lora(model)}: saved as it is, it would write peft-wrapped keys "
            "(to_q.base_layer.weight, to_q.lora_A.<adapter>.weight) that no loader restores; nothing was written. "
            f"To save the LoRA in the weights: {keep}, or pass merge_lora=True (the model itself stays as it is)"
            + (f"; to save without it: {drop}" if drop else "")
        )
    for name, model in models.items():
        idle = idle_mhla_layers(model)
        if idle:
            warnings.warn(
                f"{name}: the layers {sorted(idle)} keep MHLA mixing matrices but run {sorted(set(idle.values()))} "
                "(set_attn_processor replaced MHLAProcessor), so they compute the stock attention: the checkpoint "
                "holds the model as it computes, without those matrices. To save them, give those layers "
                "MHLAProcessor back (set_attn_processor(MHLAProcessor())); to drop them, mhla_diffusers.remove_mhla",
                UserWarning,
                stacklevel=3,
            )


@contextlib.contextmanager
def merged_adapters(models: dict[str, nn.Module], merge_lora: bool) -> Iterator[None]:
    """With ``merge_lora``, every model with peft adapters is seen merged inside the block
    (:func:`~mhla_diffusers.checkpoint.adapter.lora_merged`); unchanged afterwards.

    Raises:
        MHLACheckpointError: on entering the block (before anything is written), when adapters are
            disabled or a merged weight is not finite.
    """
    with contextlib.ExitStack() as stack:
        for name, model in models.items():
            if merge_lora and has_lora(model):
                try:
                    stack.enter_context(lora_merged(model))
                except ValueError as err:
                    raise MHLACheckpointError(f"{name}: cannot save with merge_lora=True: {err}; nothing was written") from err
        yield


def load_saved_lora(model: nn.Module, default_dir: Path, lora) -> None:
    """Apply a LoRA adapter saved beside a checkpoint (``transformer_lora/``, see ``mhla_diffusers.checkpoint.lora``).

    ``lora=True``: the adapter in ``default_dir`` if there is one; ``False``: none; a path: that
    adapter, which must exist.
    """
    if lora is False or lora is None:
        return
    folder = default_dir if lora is True else Path(lora)
    if lora is True and not folder.is_dir():
        return
    load_lora(model, folder)
