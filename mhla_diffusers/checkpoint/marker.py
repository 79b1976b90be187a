"""What a stock load of a converted folder says: the ``mhla_checkpoint`` key written into the transformer's
``config.json`` (diffusers logs it as an unexpected attribute, so its own ``from_pretrained`` of a converted
folder is never silent), and inside our loaders the log filter that takes it out of diffusers' warning
again and drops it from the loaded config.
"""

from __future__ import annotations

import contextlib
import json
import logging
from pathlib import Path
from typing import Iterator

from diffusers.configuration_utils import FrozenDict
from torch import nn

from mhla_diffusers.models.provenance import LOADING_CONVERTED

__all__ = ["CONFIG_MARKER_KEY"]


CONFIG_MARKER_KEY = "mhla_checkpoint"


_CONFIG_MARKER = (
    "converted MHLA checkpoint (mhla_config.json and mhla.safetensors beside this config.json): load it with "
    "mhla_diffusers.load_mhla_transformer or mhla_diffusers.load_mhla_pipeline. diffusers' from_pretrained alone "
    "runs the base model WITHOUT MHLA, on the stock attention"
)


def mark_config(folder: Path, converted: bool) -> None:
    """Add :data:`CONFIG_MARKER_KEY` to ``folder/config.json`` (a converted transformer folder), or take
    it out (a model without MHLA that was loaded from a converted folder carries it in its config)."""
    path = folder / "config.json"
    if not path.is_file():
        return
    data = json.loads(path.read_text())
    if converted:
        data[CONFIG_MARKER_KEY] = _CONFIG_MARKER
    elif data.pop(CONFIG_MARKER_KEY, None) is None:
        return
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")  # diffusers' own layout


class _DropMarkerLog(logging.Filter):
    """Takes the marker out of diffusers' "config attributes ... not expected" warning (the whole line
    when it is the only such attribute): our loaders know the key."""

    _ENTRY = f"{CONFIG_MARKER_KEY!r}: {_CONFIG_MARKER!r}"

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if self._ENTRY not in message:
            return True
        message = message.replace(f", {self._ENTRY}", "").replace(f"{self._ENTRY}, ", "").replace(self._ENTRY, "")
        if "attributes {}" in message:
            return False
        record.msg, record.args = message, ()
        return True


@contextlib.contextmanager
def loading_converted() -> Iterator[None]:
    """Inside our loaders: diffusers does not log the marker, and :func:`warn_if_stock_loaded` stays quiet."""
    logger = logging.getLogger("diffusers.configuration_utils")
    drop = _DropMarkerLog()
    logger.addFilter(drop)
    token = LOADING_CONVERTED.set(True)
    try:
        yield
    finally:
        LOADING_CONVERTED.reset(token)
        logger.removeFilter(drop)


def forget_marker(model: nn.Module) -> None:
    """Drop the marker from a loaded model's config (diffusers keeps unknown keys there), so that its
    config is the base config and a later save writes the marker only where it belongs."""
    config = getattr(model, "_internal_dict", None)
    if config is not None and CONFIG_MARKER_KEY in config:
        model._internal_dict = FrozenDict({k: v for k, v in config.items() if k != CONFIG_MARKER_KEY})
