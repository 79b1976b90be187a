"""Fine-tuning DiT, SANA, Wan and SANA-Video with or without MHLA, on accelerate (needs accelerate, peft, yaml).

:func:`train` runs a config (:func:`load_config`); :func:`retrofit` distils then fine-tunes a
converted checkpoint. Module map and design: ``docs/training.md``.
"""

from mhla_diffusers.data.build import build_dataset
from mhla_diffusers.training.config import DEFAULT_CONFIG, TRAINABLE_SETS, apply_overrides, load_config, validate_config
from mhla_diffusers.training.evaluation import evaluate_heldout, evaluate_loss
from mhla_diffusers.training.export import export_model, export_pipeline
from mhla_diffusers.training.logs import plot_loss_curves, read_grad_norms, read_loss_csv, read_loss_terms, write_loss_csv
from mhla_diffusers.training.loop import train
from mhla_diffusers.training.losses import diffusion_loss, training_loss
from mhla_diffusers.training.optim import (
    build_optimizer,
    clip_grad_norms_,
    gradient_groups,
    prepare_parameter_dtypes,
    set_trainable,
)
from mhla_diffusers.training.processes import end_processes
from mhla_diffusers.training.recipes import (
    DiTRecipe,
    SanaRecipe,
    TrainingParts,
    WanRecipe,
    build_models,
    check_resolution,
    disable_internal_label_dropout,
    get_recipe,
    resolve_family,
    vae_scale_factor,
)
from mhla_diffusers.training.retrofit import retrofit

__all__ = [
    "retrofit",
    "DEFAULT_CONFIG",
    "TRAINABLE_SETS",
    "load_config",
    "apply_overrides",
    "validate_config",
    "resolve_family",
    "TrainingParts",
    "DiTRecipe",
    "SanaRecipe",
    "WanRecipe",
    "get_recipe",
    "build_models",
    "build_dataset",
    "check_resolution",
    "vae_scale_factor",
    "set_trainable",
    "prepare_parameter_dtypes",
    "build_optimizer",
    "gradient_groups",
    "clip_grad_norms_",
    "training_loss",
    "diffusion_loss",
    "evaluate_heldout",
    "evaluate_loss",
    "disable_internal_label_dropout",
    "write_loss_csv",
    "read_loss_csv",
    "read_loss_terms",
    "read_grad_norms",
    "plot_loss_curves",
    "export_pipeline",
    "export_model",
    "train",
    "end_processes",
]
