"""Every trainer config key is documented on the fine-tuning page (docs/training.md, "Every config key")."""

from __future__ import annotations

from pathlib import Path

from mhla_diffusers.training.config import _FREE_SECTIONS, _MHLA_KEYS, DEFAULT_CONFIG

PAGE = Path(__file__).resolve().parents[2] / "docs" / "training.md"


def _keys(section: dict, path: tuple[str, ...] = ()) -> list[str]:
    keys = []
    for key, value in section.items():
        here = path + (key,)
        if isinstance(value, dict) and here not in _FREE_SECTIONS:
            keys += _keys(value, here)
        else:
            keys.append(".".join(here))
    return keys


def test_every_config_key_is_on_the_training_page():
    text = PAGE.read_text()
    keys = _keys(DEFAULT_CONFIG) + [f"mhla.{key}" for key in sorted(_MHLA_KEYS)]
    assert len(keys) > 80
    missing = [key for key in keys if f"`{key}`" not in text]
    assert not missing, f"config keys missing from {PAGE.name} (add a row to 'Every config key'): {missing}"
