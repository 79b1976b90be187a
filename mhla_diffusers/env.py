"""The environment flags of mhla_diffusers: the one place that reads them (standard library only).

A flag is on when its variable is ``1``, ``true``, ``yes`` or ``on`` (any case). The package root
imports this module, so :func:`flag` with ``at_import=True`` answers for the environment as it was
when ``mhla_diffusers`` was first imported (some libraries fix a setting at their own import).
Which variables exist is up to their users (each backend documents its own).
"""

from __future__ import annotations

import os

__all__ = ["flag"]

_TRUE = ("1", "true", "yes", "on")
_AT_IMPORT = dict(os.environ)  # the environment when the package was imported


def flag(name: str, *, at_import: bool = False) -> bool:
    """Whether the environment variable ``name`` is set to ``1`` / ``true`` / ``yes`` / ``on`` (any case).

    Args:
        name: the variable's name.
        at_import: read the environment as it was when ``mhla_diffusers`` was first imported,
            instead of now.
    """
    environ = _AT_IMPORT if at_import else os.environ
    return environ.get(name, "0").lower() in _TRUE
