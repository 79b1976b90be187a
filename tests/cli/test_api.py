"""The package's public surface: everything exported exists, and every public object imported into
the package namespace is listed in __all__ (so `from mhla_diffusers import *` and the docs agree)."""

import types

import mhla_diffusers


def test_all_lists_exactly_the_public_objects():
    exported = set(mhla_diffusers.__all__)
    assert len(exported) == len(mhla_diffusers.__all__), "duplicate names in __all__"
    for name in exported:
        assert hasattr(mhla_diffusers, name), name
    public = {
        name
        for name, obj in vars(mhla_diffusers).items()
        if not name.startswith("_") and not isinstance(obj, types.ModuleType)
    }
    assert public == exported, (public - exported, exported - public)
