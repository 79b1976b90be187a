"""The model families MHLA supports, one module each, registered when this package is imported.

:mod:`.base` holds the :class:`Family` entry, the hooks a family may fill (:class:`TrainingSpec`,
:class:`PipelineQuirks`, :class:`Experts`) and the registry (:func:`register_family`, :func:`get_family`,
:func:`family_of`, :func:`find_family`, ...). :mod:`.dit`, :mod:`.sana` and :mod:`.wan` each hold one
family: its entry, training recipe specifics, generation specifics, context-parallel plan and
checkpoint quirks. The generic modules (processor, grid hooks, checkpoints, generation, training,
context parallelism) read these entries and never name a family.

Adding a family: write ``families/<name>.py`` (its entry, passed to :func:`register_family`, and its
hooks; it may import ``base``, diffusers, ``mhla_diffusers.ops`` and other modules that do not import this
package) and add one import line below.
Its tests: one entry in ``tests/helpers_families.py`` puts it under the contract suite
(``tests/models/test_family_contract.py``).
"""

from mhla_diffusers.families.base import *  # noqa: F403  (the registry API and the hook classes)
from mhla_diffusers.families.base import __all__ as _base_all

# The registry: one line per family (importing the module registers its entry).
from mhla_diffusers.families.dit import DIT
from mhla_diffusers.families.sana import SANA
from mhla_diffusers.families.wan import WAN, WanRotary, wan_native_video

__all__ = [*_base_all, "DIT", "SANA", "WAN", "WanRotary", "wan_native_video"]
