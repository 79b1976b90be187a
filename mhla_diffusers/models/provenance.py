"""Provenance of a model: loaded from a converted MHLA checkpoint, and did its mixing matrices come with it?

A stock ``from_pretrained`` of a converted folder runs without MHLA; :func:`warn_if_stock_loaded` says so
where the model is used as if it had them. Only reads folders; our loaders set :data:`LOADING_CONVERTED`.
"""

from __future__ import annotations

import contextvars
import warnings
from pathlib import Path

from huggingface_hub import try_to_load_from_cache
from torch import nn

from mhla_diffusers.families import attention_modules

__all__ = ["MHLA_CONFIG_NAME", "LOADING_CONVERTED", "converted_source", "is_hub_id", "warn_if_stock_loaded",
           "warn_fresh_mixing"]

MHLA_CONFIG_NAME = "mhla_config.json"

# True inside the checkpoint format's own loaders: they install the trained matrices themselves.
LOADING_CONVERTED = contextvars.ContextVar("mhla_loading_converted", default=False)


def converted_source(model) -> Path | None:
    """The converted MHLA checkpoint folder (the one holding ``mhla_config.json``) that a diffusers model
    or pipeline was loaded from, or ``None``.

    Read from ``model.config["_name_or_path"]``, which diffusers' ``from_pretrained`` records: a local
    folder (pipeline or transformer), or a Hub id whose files are already in the local cache (nothing
    is downloaded).
    """
    config = getattr(model, "config", None)
    name = config.get("_name_or_path") if hasattr(config, "get") else None
    if not name:
        return None
    for sub in ("", "transformer"):
        local = Path(str(name)) / sub / MHLA_CONFIG_NAME
        try:
            if local.is_file():
                return local.parent
        except OSError:
            return None
    if not is_hub_id(str(name)):
        return None
    try:
        for filename in (MHLA_CONFIG_NAME, f"transformer/{MHLA_CONFIG_NAME}"):
            cached = try_to_load_from_cache(str(name), filename)
            if isinstance(cached, str):
                return Path(cached).parent
    except Exception:  # not a repository id after all, an unreadable cache: nothing to say
        return None
    return None


def is_hub_id(text: str) -> bool:
    """Whether ``text`` looks like a Hugging Face Hub repository id (``owner/name``), not a local path."""
    return not text.startswith((".", "/", "~")) and text.count("/") == 1


def warn_if_stock_loaded(model, consequence: str) -> bool:
    """Warn when ``model`` (a transformer, or a pipeline's ``transformer``) was loaded from a converted
    MHLA checkpoint but has no MHLA layer: diffusers' own ``from_pretrained`` (or ``remove_mhla``)
    left the trained mixing matrices out. ``consequence`` says what the caller is about to do with
    it. Quiet inside our own loaders. Returns whether it warned."""
    if LOADING_CONVERTED.get():
        return False
    transformer = getattr(model, "transformer", model)
    if not isinstance(transformer, nn.Module):
        return False
    if any(getattr(attn, "mhla", None) is not None for attn in attention_modules(transformer).values()):
        return False
    folder = converted_source(transformer) or converted_source(model)
    if folder is None:
        return False
    warnings.warn(
        f"{type(transformer).__name__} was loaded from {folder}, a converted MHLA checkpoint ({MHLA_CONFIG_NAME}), "
        f"but has no MHLA layer: diffusers' own from_pretrained (or remove_mhla) leaves the trained mixing matrices "
        f"out, so {consequence}. Load the checkpoint with mhla_diffusers.load_mhla_transformer or "
        "mhla_diffusers.load_mhla_pipeline to run it as converted",
        UserWarning,
        stacklevel=3,
    )
    return True


def warn_fresh_mixing(model: nn.Module) -> None:
    """MHLA is about to get fresh matrices on a model that diffusers' own ``from_pretrained`` loaded
    from a converted checkpoint: say so (see :func:`warn_if_stock_loaded`)."""
    warn_if_stock_loaded(model, "MHLA installed now gets fresh locality-init mixing matrices, not the checkpoint's trained ones")
