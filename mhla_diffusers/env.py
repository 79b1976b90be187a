"""The environment flags of mhla_diffusers: the one place that reads them (standard library only).

A flag is on when its variable is ``1``, ``true``, ``yes`` or ``on`` (any case); see ``docs/operator.md``.
"""

from __future__ import annotations

import os

__all__ = ["flag"]

_TRUE = ("1", "true", "yes", "on")
_AT_IMPORT = dict(os.environ)  # the environment when the package was imported


def flag(name: str, *, at_import: bool = False) -> bool:
    """Whether the environment variable ``name`` is on.

    ``at_import``: read the environment as it was when ``mhla_diffusers`` was first imported.
    """
    environ = _AT_IMPORT if at_import else os.environ
    return environ.get(name, "0").lower() in _TRUE
