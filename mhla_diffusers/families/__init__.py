"""The model families MHLA supports, one module each, registered when this package is imported.

:mod:`.base` holds the :class:`Family` entry, its hooks and the registry; :mod:`.dit`, :mod:`.sana`,
:mod:`.wan`, :mod:`.sana_video` and :mod:`.wan_vace` each hold one family. The generic modules read these entries and never name a family.
Adding a family: one file in ``families/``, one import line below, one ``TINY`` entry in
``tests/helpers_families.py`` (see ``docs/families/index.md``).
"""

from mhla_diffusers.families.base import *  # noqa: F403  (the registry API and the hook classes)
from mhla_diffusers.families.base import __all__ as _base_all

# The registry: one line per family (importing the module registers its entry).
from mhla_diffusers.families.dit import DIT
from mhla_diffusers.families.sana import SANA
from mhla_diffusers.families.sana_video import SANA_VIDEO
from mhla_diffusers.families.wan import WAN, WanRotary, wan_native_video
from mhla_diffusers.families.wan_vace import WAN_VACE

__all__ = [*_base_all, "DIT", "SANA", "WAN", "SANA_VIDEO", "WAN_VACE", "WanRotary", "wan_native_video"]
