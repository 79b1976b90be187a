"""Fine-tuning MHLA models: config, per-family recipes, data, losses, evaluation, export, resume,
the loop (accelerate / peft / yaml are needed only here)."""
