"""FSDP2 for the trainer (accelerate's plugin, one unit per transformer block); see ``docs/training.md``, "FSDP"."""

from __future__ import annotations

from accelerate.utils import DistributedType, parse_flag_from_env
from torch import nn

from mhla_diffusers.families import family_of, self_attention_modules

__all__ = ["fsdp_requested", "check_fsdp_setup", "transformer_block_classes", "set_fsdp_wrap"]


def fsdp_requested() -> bool:
    """Whether the launch asks for FSDP (``ACCELERATE_USE_FSDP=true``)."""
    return parse_flag_from_env("ACCELERATE_USE_FSDP", default=False)


def check_fsdp_setup(accelerator) -> None:
    """``ValueError`` for an FSDP launch that would not run as FSDP2 (CPU processes, one process, FSDP1)."""
    if not fsdp_requested() and accelerator.distributed_type != DistributedType.FSDP:
        return
    if accelerator.distributed_type != DistributedType.FSDP:
        raise ValueError(
            f"the accelerate config asks for FSDP, but accelerate set up {accelerator.distributed_type} "
            f"with {accelerator.num_processes} process(es): it shards only across 2 or more GPU processes "
            "(on CPU processes it would run DDP). Use finetune/accelerate/multi_cpu.yaml on CPUs, or FSDP on GPUs"
        )
    version = accelerator.state.fsdp_plugin.fsdp_version
    if version != 2:
        raise ValueError(
            f"the accelerate config asks for FSDP version {version}; the trainer runs FSDP2: set "
            "fsdp_config.fsdp_version: 2 (see finetune/accelerate/fsdp.yaml)"
        )


def transformer_block_classes(model: nn.Module) -> list[str]:
    """Class names of the modules holding ``model``'s self-attention layers, once each, in layer order."""
    modules = dict(model.named_modules())
    names: list[str] = []
    for name, _ in self_attention_modules(model):
        block = type(modules[name.rpartition(".")[0]]).__name__
        if block not in names:
            names.append(block)
    return names


def set_fsdp_wrap(accelerator, model: nn.Module) -> str | None:
    """Choose the FSDP units before ``accelerator.prepare``; a line saying them, or ``None`` (no FSDP, other policy).

    ``ValueError`` for a class to wrap the model lacks, or blocks that cannot be FSDP units.
    """
    if accelerator.distributed_type != DistributedType.FSDP:
        return None
    from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy

    plugin = accelerator.state.fsdp_plugin
    if plugin.auto_wrap_policy is not transformer_auto_wrap_policy:
        return None
    family, blocks = family_of(model), transformer_block_classes(model)
    named = plugin.transformer_cls_names_to_wrap
    if named is None:
        plugin.transformer_cls_names_to_wrap = list(blocks) if family.fsdp_blocks else []
        if not family.fsdp_blocks:
            return f"FSDP: the whole {type(model).__name__} is one unit (its forward uses a block's layers outside the block)"
        return f"FSDP: one unit per transformer block ({', '.join(blocks)}) and the root"
    present = {type(m).__name__ for m in model.modules()}
    missing = [c for c in named if c not in present]
    if missing:
        raise ValueError(
            f"fsdp_transformer_layer_cls_to_wrap names {', '.join(missing)}, which {type(model).__name__} does not have: "
            f"its transformer blocks are {', '.join(blocks)} (or leave the key out: the trainer chooses the units)"
        )
    if not family.fsdp_blocks and set(named) & set(blocks):
        raise ValueError(
            f"fsdp_transformer_layer_cls_to_wrap: {', '.join(blocks)} cannot be an FSDP unit: the {family.name} "
            f"model's forward uses a block's layers outside the block. Leave the key out (the whole model is one unit)"
        )
    return f"FSDP: one unit per {', '.join(named)} and the root"
