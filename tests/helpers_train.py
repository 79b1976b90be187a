"""Tiny DiT training configs shared by tests/training and tests/checkpoint (LoRA runs)."""

from pathlib import Path

import yaml

TINY_DIT = dict(
    num_attention_heads=2, attention_head_dim=8, in_channels=12, out_channels=12,
    num_layers=2, sample_size=8, patch_size=2, num_embeds_ada_norm=1000,
)


def tiny_config(out, **sections):
    config = {
        "output_dir": str(out),
        "model": {"init": TINY_DIT, "vae": {"factor": 2, "scaling_factor": 1.8}},
        "data": {"resolution": 16, "crops_per_image": 2, "batch_size": 4, "photos": ["cat", "coffee", "flower"]},
        "train": {"max_steps": 3, "lr": 1e-3, "log_every": 1},
    }
    for name, value in sections.items():
        if isinstance(value, dict) and isinstance(config.get(name), dict):
            config[name] = {**config[name], **value}
        else:
            config[name] = value
    path = Path(out).parent / f"{Path(out).name}.yaml"
    path.write_text(yaml.safe_dump(config))
    return path
