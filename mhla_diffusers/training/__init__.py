"""Fine-tuning diffusion transformers with or without MHLA on accelerate: DiT, SANA and Wan 2.1.

accelerate / peft / yaml are needed only here. The modules, in the order a run uses them:

- :mod:`.config` — :data:`DEFAULT_CONFIG`, :func:`load_config` (defaults + a YAML file +
  ``key.path=value`` overrides), :func:`validate_config` (a table of typed rules).
- :mod:`.recipes` — what differs per family (:class:`DiTRecipe`, :class:`SanaRecipe`,
  :class:`WanRecipe`) and :func:`build_models`: the transformer, the autoencoder, the objective, the
  frozen teacher, MHLA applied if asked, the trainable set, in :class:`TrainingParts`.
- :mod:`.data` — the datasets (photos, class folders, captioned folders, videos), :func:`build_dataset`;
  :mod:`.cache` — latents (and text embeddings) encoded once, to disk.
- :mod:`.optim` — :func:`set_trainable`, :func:`prepare_parameter_dtypes`, :func:`build_optimizer`
  (mixing matrices in their own group), :func:`gradient_groups` / :func:`clip_grad_norms_`
  (gradient norms clipped and logged per parameter group).
- :mod:`.losses` — :func:`training_loss`: the objective's data loss (:mod:`.flow`: DDPM epsilon for
  DiT, flow matching for SANA and Wan) plus the distillation terms (:mod:`.distill`).
- :mod:`.evaluation` — :func:`evaluate_heldout` / :func:`evaluate_loss` on fixed noise and timesteps.
- :mod:`.logs` — ``loss.csv`` and ``loss.png``; :mod:`.export` — the final pipeline, written atomically;
  :mod:`.resume` — checkpoints and resuming.
- :mod:`.fsdp` — FSDP2 under accelerate: the launch checks and the units (one per transformer block).
- :mod:`.loop` — :func:`train`; :mod:`.retrofit` — :func:`retrofit`: distillation then fine-tuning of a
  converted checkpoint (the recipe the demo and the study run).
"""

from mhla_diffusers.data import build_dataset
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
]
