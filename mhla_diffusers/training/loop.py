"""Fine-tuning diffusion transformers with or without MHLA on accelerate: DiT, SANA and Wan 2.1.

One flat loop (:func:`train`; ``finetune/train.py`` only parses arguments and calls it) over
family-agnostic pieces, each usable alone:

- :func:`load_config` — defaults + a YAML file + ``key.path=value`` overrides, validated.
- :func:`build_models` — the transformer, the autoencoder, the training objective, the frozen
  teacher (distillation), text encoder / pipeline where the family has one; MHLA applied if asked
  and not present yet; the trainable set (full, LoRA, attention-only, mixing-only).
- :func:`build_dataset` — photos, class folders (DiT), captioned folders (SANA), videos (Wan).
- :func:`build_optimizer` — AdamW, the mixing matrices in their own group (own lr, no decay).
- :func:`gradient_groups`, :func:`clip_grad_norms_` — gradient norms clipped and logged per
  parameter group (mixing matrices, LoRA, the rest), so one group's spike cannot void a step.
- :func:`training_loss` — the data loss of the family's objective (:class:`~mhla_diffusers.training.flow.Objective`:
  DDPM epsilon for DiT, flow matching for SANA and Wan) plus the distillation terms
  (:mod:`mhla_diffusers.training.distill`: output matching and attention transfer), weighted by the config.
- :func:`evaluate_heldout` / :func:`evaluate_loss` — held-out losses on fixed noise and timesteps.
- :func:`prepare_parameter_dtypes` — frozen weights in the mixed-precision dtype, trainable ones in fp32.
- :func:`write_loss_csv`, :func:`read_loss_csv`, :func:`plot_loss_curves` — the loss log and plot.
- :func:`export_pipeline` (DiT) and :func:`export_model` (any family) — the final pipeline in the
  converted-checkpoint format, written atomically, LoRA merged or saved beside it.

What differs per family lives in one small recipe class each (:class:`DiTRecipe`, :class:`SanaRecipe`,
:class:`WanRecipe`).
After every optimizer step :func:`mhla_diffusers.clamp_mixing_` keeps the mixing matrices in
``[0, 1]`` (MHLA paper, Sec. 3.3).
"""

from __future__ import annotations

import abc
import copy
import csv
import io
import json
import math
import os
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

import torch
import torch.nn.functional as F
import yaml

from mhla_diffusers.training.flow import LOSS_WEIGHTING, OBJECTIVES, TIMESTEP_SAMPLING, Objective, flow_match_scheduler

__all__ = [
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

TRAINABLE_SETS = ("full", "lora", "attention", "mixing")

# Every key a config may have. Sections whose value is a free dict (passed to a constructor) are
# listed in _FREE_SECTIONS; "mhla" may be null (no MHLA) or a dict of apply_mhla arguments.
DEFAULT_CONFIG: dict[str, Any] = {
    "output_dir": None,
    "model": {
        # dit | sana | wan. null: the class of model.pretrained's transformer (dit for model.init).
        "family": None,
        # A pipeline folder (plain or MHLA checkpoint, loaded with load_mhla_pipeline) ...
        "pretrained": None,
        # ... or (DiT only) a DiTTransformer2DModel config dict to train from scratch.
        "init": None,
        # From scratch only: the SpaceToDepthAutoencoder and DDPMScheduler configs. With
        # `pretrained`, the pipeline's own vae and scheduler config are used.
        "vae": {"factor": 2, "in_channels": 3, "scaling_factor": 1.8},
        "noise_scheduler": {
            "num_train_timesteps": 1000,
            "beta_schedule": "scaled_linear",
            "beta_start": 0.00085,
            "beta_end": 0.012,
            "clip_sample": False,
            "prediction_type": "epsilon",
        },
        # Text-conditioned families (SANA, Wan): how captions are encoded (the pipeline's encode_prompt).
        "text": {
            "max_sequence_length": None,  # null: the pipeline's default (SANA 300, Wan 512)
            # "default": the pipeline's own (SANA's complex human instruction, as at inference); null: none
            "complex_human_instruction": "default",
        },
    },
    # null: no MHLA (the base model, or fine-tune a checkpoint as it is). A dict:
    # arguments of mhla_diffusers.apply_mhla, applied when the loaded model has no MHLA yet.
    "mhla": None,
    "objective": {
        "kind": None,  # epsilon (DiT) | flow (SANA, Wan); null: the family's
        "shift": None,  # flow: sigma shift; null: the pipeline scheduler's flow_shift (else 1.0)
        "timestep_sampling": "logit_normal",  # flow: logit_normal | mode | uniform
        "logit_mean": 0.0,
        "logit_std": 1.0,
        "mode_scale": 1.29,
        "loss_weighting": "none",  # flow: none | sigma_sqrt | cosmap
    },
    "distill": {
        "teacher": None,  # null: no distillation; "original": the loaded model before MHLA; or a folder
        "data_weight": 1.0,  # weight of the objective's data loss (0: distillation alone)
        "output_weight": 0.0,  # MSE(student output, teacher output)
        "attention_weight": 0.0,  # attention transfer: mean over layers of MSE(attention outputs)
        "condition": "dataset",  # dataset | random (random class labels, DiT) | null (null label / empty caption)
        "layers": "mhla",  # attention transfer on: mhla (the MHLA layers) | all (every self-attention layer)
    },
    "lora": {  # used with train.trainable: lora
        "rank": 16,
        "alpha": None,  # null: rank (scale 1)
        "dropout": 0.0,
        "target_modules": ["to_q", "to_k", "to_v", "to_out.0"],
        "export": "merge",  # merge (into the weights) | separate (transformer_lora/ beside the base)
    },
    "ema": {
        "enabled": False,
        "decay": 0.9999,
        "update_after_step": 0,
        "use_warmup": False,
        "export": False,  # export the EMA weights as the final model
    },
    "data": {
        # photos | folder (root/<class>/<images>) | captions (images + metadata.jsonl / .txt) | video (videos + captions)
        "kind": "photos",
        "root": None,  # kind=folder / captions
        "resolution": 64,  # crop side, pixels (kind=video: also [height, width])
        "short_side": None,  # resize short side to this before cropping (None: dataset default)
        "crops_per_image": 64,  # crops of each image (clips of each video) per epoch
        "num_frames": 17,  # kind=video: frames per clip (Wan: 4k+1)
        "frame_stride": 1,  # kind=video: every n-th frame
        "photos": None,  # kind=photos: subset of PHOTO_NAMES (None: all)
        "hflip": True,
        "seed": 0,  # crop positions / flips / shuffling
        "batch_size": 16,  # per process
        "num_workers": 0,
        "caption_column": "text",  # kind=captions: the metadata.jsonl key of the caption
        "missing_caption": "error",  # kind=captions: error | empty
        "caption_template": "{}",  # text families on class-labelled data: caption = template.format(class name)
        "cache": False,  # encode latents (and text embeddings) once, to disk (fixes each index's crop)
        "cache_dir": None,  # null: output_dir/latent_cache
    },
    "train": {
        "max_steps": 1000,  # optimizer steps
        "trainable": "full",  # full | lora | attention (self-attention modules) | mixing (MHLA parameters only)
        "train_mixing": True,  # the MHLA parameters (mixing matrices, Wan output norms) train, whatever the set
        "lr": 1e-4,
        "mixing_lr": None,  # lr of the MHLA mixing matrices (None: lr)
        "weight_decay": 0.0,  # not applied to the mixing matrices
        "adam_beta1": 0.9,
        "adam_beta2": 0.999,
        "adam_eps": 1e-8,
        "lr_scheduler": "constant_with_warmup",  # any name of diffusers.optimization.get_scheduler
        "warmup_steps": 0,
        "grad_clip": 1.0,  # max gradient norm of each parameter group (model, lora, mhla_mixing), clipped one by one; 0 or null: off
        "mixed_precision": "no",  # no | fp16 | bf16 (autocast; trainable parameters stay fp32)
        "gradient_accumulation_steps": 1,
        "gradient_checkpointing": False,
        "class_dropout": 0.1,  # label -> null class (classifier-free guidance; DiT)
        "caption_dropout": 0.1,  # caption -> "" (classifier-free guidance; text families)
        "checkpointing_steps": 0,  # accelerate save_state every N steps (0: never)
        "checkpoints_total_limit": 2,
        "resume": False,  # resume from the latest complete state in output_dir/checkpoints
        "seed": 0,  # model init, noise, timesteps, label dropout
        "log_every": 10,  # tqdm postfix and loss CSV flush, in steps
        "report_to": None,  # null | tensorboard (needs the tensorboard package)
        "find_unused_parameters": False,  # DDP
    },
    "eval": {
        "samples": 0,  # > 0: held-out losses on this many fixed crops, before and after training
        "seed": 12345,  # crops, noise; timesteps evenly spaced
        "batch_size": 16,
    },
    "export": {
        "sampler": "dpm",  # DiT: dpm | ddim | ddpm : the scheduler of the exported pipeline (SANA keeps its own)
        "dir": None,  # the final pipeline folder (null: output_dir/final; else a path as given)
    },
}
_FREE_SECTIONS = {("model", "init"), ("model", "vae"), ("model", "noise_scheduler"), ("mhla",)}
_FLOAT_KEYS = {
    "train": ("lr", "mixing_lr", "weight_decay", "adam_beta1", "adam_beta2", "adam_eps", "grad_clip", "class_dropout", "caption_dropout"),
    "distill": ("data_weight", "output_weight", "attention_weight"),
    "objective": ("shift", "logit_mean", "logit_std", "mode_scale"),
    "lora": ("alpha", "dropout"),
    "ema": ("decay",),
}
_NULLABLE_FLOATS = {"mixing_lr", "grad_clip", "shift", "alpha"}
_MHLA_KEYS = {"layers", "num_blocks", "block_grid", "normalize", "eps", "backend", "init", "output_norm"}
LOSS_CSV = "loss.csv"
LOSS_PNG = "loss.png"
TRAIN_STATE = "train_state.json"
EMA_WEIGHTS = "ema.safetensors"
SUMMARY = "train_summary.json"
LOSS_TERMS = ("data", "output", "attention")
GRADIENT_GROUPS = ("model", "lora", "mhla_mixing")  # see gradient_groups
GRAD_NORM_PREFIX = "grad_norm_"


# -- configuration --------------------------------------------------------------------------------
def _merge(base: dict, update: Mapping, path: tuple[str, ...] = ()) -> dict:
    out = copy.deepcopy(base)
    for key, value in update.items():
        here = path + (str(key),)
        if key not in base:
            where = ".".join(path) or "the top level"
            raise ValueError(f"unknown config key {'.'.join(here)!r}; valid keys at {where}: {sorted(base)}")
        if here in _FREE_SECTIONS or not isinstance(base[key], dict):
            out[key] = copy.deepcopy(value)
        elif value is None:
            raise ValueError(f"config section {'.'.join(here)!r} cannot be null")
        elif not isinstance(value, Mapping):
            raise ValueError(f"config section {'.'.join(here)!r} must be a mapping; got {value!r}")
        else:
            out[key] = _merge(base[key], value, here)
    return out


def apply_overrides(config: dict, overrides: Iterable[str]) -> dict:
    """Apply ``"dotted.key=value"`` overrides (value parsed as YAML: ``10``, ``1e-4``, ``null``, ``[1, 2]``).

    Setting a key inside a null section creates it (``mhla.layers=hybrid`` turns MHLA on).

    Raises:
        ValueError: malformed override or unknown key.
    """
    config = copy.deepcopy(config)
    for item in overrides:
        if "=" not in item:
            raise ValueError(f"override {item!r} must look like section.key=value (e.g. train.max_steps=10)")
        key, raw = item.split("=", 1)
        parts = [p for p in key.strip().split(".")]
        if not all(parts):
            raise ValueError(f"override {item!r}: empty key component")
        node = config
        for i, part in enumerate(parts[:-1]):
            child = node.get(part)
            if child is None:  # a null section (mhla: null) or a new sub-dict of a free section
                child = node[part] = {}
            elif not isinstance(child, dict):
                raise ValueError(f"override {item!r}: {'.'.join(parts[: i + 1])} is not a section")
            node = child
        node[parts[-1]] = yaml.safe_load(raw) if raw.strip() else None
        config = _merge(DEFAULT_CONFIG, config)  # rejects unknown keys
    return config


def load_config(path: str | os.PathLike | None = None, overrides: Iterable[str] = ()) -> dict:
    """Defaults (:data:`DEFAULT_CONFIG`) <- the YAML file at ``path`` <- ``overrides``; validated.

    Returns:
        The complete config dict (every key present).

    Raises:
        FileNotFoundError: ``path`` does not exist.
        ValueError: unknown keys, a missing ``output_dir``, neither or both of ``model.pretrained``
            and ``model.init``, bad values (the message names the key and what to do).
    """
    config = copy.deepcopy(DEFAULT_CONFIG)
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"config file {path} does not exist")
        loaded = yaml.safe_load(path.read_text()) or {}
        if not isinstance(loaded, Mapping):
            raise ValueError(f"{path} must hold a YAML mapping (sections model, mhla, objective, distill, lora, ema, data, train, eval, export; output_dir)")
        config = _merge(config, loaded)
    config = apply_overrides(config, overrides)
    validate_config(config)
    return config


def _choice(config: dict, section: str, key: str, choices: Sequence, allow_none: bool = False) -> None:
    v = config[section][key]
    if isinstance(v, bool):
        # YAML 1.1 reads no / off / yes / on as booleans (`mixed_precision: no` arrives as False):
        # the one choice that YAML reads as this boolean is what was written.
        spelled = [c for c in choices if isinstance(c, str) and yaml.safe_load(c) is v]
        if len(spelled) == 1:
            config[section][key] = v = spelled[0]
    if (v is None and allow_none) or (not isinstance(v, bool) and v in choices):
        return
    raise ValueError(f"{section}.{key} must be one of {list(choices)}{' or null' if allow_none else ''}; got {v!r}")


def validate_config(config: dict) -> None:
    """Check a merged config (numeric strings become floats); raise ``ValueError`` naming the offending key."""
    from mhla_diffusers.training.distill import CONDITIONS, TRANSFER_LAYERS
    from mhla_diffusers.models.families import FAMILIES

    if not config.get("output_dir"):
        raise ValueError("output_dir is not set: add `output_dir: <folder>` to the YAML or pass --set output_dir=<folder>")
    m = config["model"]
    if (m["pretrained"] is None) == (m["init"] is None):
        raise ValueError(
            "set exactly one of model.pretrained (a pipeline folder) and model.init "
            "(a DiTTransformer2DModel config dict to train from scratch)"
        )
    if m["init"] is not None and not isinstance(m["init"], Mapping):
        raise ValueError(f"model.init must be a mapping of DiTTransformer2DModel arguments; got {m['init']!r}")
    if m["family"] is not None and m["family"] not in RECIPES:
        known = sorted(FAMILIES)
        raise ValueError(f"model.family must be one of {sorted(RECIPES)} (MHLA knows {known}) or null; got {m['family']!r}")
    if m["init"] is not None and m["family"] not in (None, "dit"):
        raise ValueError(f"model.init (training from scratch) is supported for DiT only; family {m['family']!r} needs model.pretrained")
    chi = m["text"]["complex_human_instruction"]
    if not (chi is None or chi == "default" or (isinstance(chi, list) and all(isinstance(s, str) for s in chi))):
        raise ValueError(f"model.text.complex_human_instruction must be 'default', null or a list of strings; got {chi!r}")
    mh = config["mhla"]
    if mh is not None:
        if not isinstance(mh, Mapping):
            raise ValueError(f"mhla must be null or a mapping with keys {sorted(_MHLA_KEYS)}; got {mh!r}")
        unknown = set(mh) - _MHLA_KEYS
        if unknown:
            raise ValueError(f"unknown mhla keys {sorted(unknown)}; valid: {sorted(_MHLA_KEYS)}")
    d, t = config["data"], config["train"]
    _choice(config, "data", "kind", ("photos", "folder", "captions", "video"))
    if d["kind"] in ("folder", "captions", "video") and not d["root"]:
        raise ValueError(f"data.kind={d['kind']} needs data.root (the image folder)")
    _choice(config, "data", "missing_caption", ("error", "empty"))
    if not isinstance(d["caption_template"], str) or "{}" not in d["caption_template"]:
        raise ValueError(f"data.caption_template must be a string containing {{}}; got {d['caption_template']!r}")
    if d["kind"] == "video":
        r = d["resolution"]
        if not (isinstance(r, int) or (isinstance(r, list) and len(r) == 2 and all(isinstance(x, int) for x in r))):
            raise ValueError(f"data.resolution must be an integer or [height, width] for videos; got {r!r}")
    elif not isinstance(d["resolution"], int):
        raise ValueError(f"data.resolution must be an integer (square crops of images); got {d['resolution']!r}")
    positive = [("data", "num_frames"), ("data", "frame_stride"), ("data", "batch_size"), ("train", "max_steps"), ("train", "gradient_accumulation_steps"), ("train", "log_every"), ("lora", "rank")]
    for section, key in positive:
        v = config[section][key]
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise ValueError(f"{section}.{key} must be a positive integer; got {v!r}")
    v = m["text"]["max_sequence_length"]
    if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 1):
        raise ValueError(f"model.text.max_sequence_length must be a positive integer or null; got {v!r}")
    for section, key in [("train", "warmup_steps"), ("train", "checkpointing_steps"), ("ema", "update_after_step")]:
        v = config[section][key]
        if not isinstance(v, int) or isinstance(v, bool) or v < 0:
            raise ValueError(f"{section}.{key} must be an integer >= 0; got {v!r}")
    # PyYAML (YAML 1.1) reads "1e-4" (no dot) as a string: accept numeric strings for float keys.
    for section, keys in _FLOAT_KEYS.items():
        for key in keys:
            v = config[section][key]
            if v is None and key in _NULLABLE_FLOATS:
                continue
            try:
                config[section][key] = float(v)
            except (TypeError, ValueError):
                raise ValueError(f"{section}.{key} must be a number; got {v!r}") from None
    if t["lr"] <= 0:
        raise ValueError(f"train.lr must be > 0; got {t['lr']!r}")
    if t["mixing_lr"] is not None and t["mixing_lr"] < 0:
        raise ValueError(f"train.mixing_lr must be null or >= 0; got {t['mixing_lr']!r}")
    for key in ("class_dropout", "caption_dropout"):
        if not 0.0 <= t[key] < 1.0:
            raise ValueError(f"train.{key} must be in [0, 1); got {t[key]!r}")
    _choice(config, "train", "mixed_precision", ("no", "fp16", "bf16"))
    _choice(config, "train", "trainable", TRAINABLE_SETS)
    _choice(config, "train", "report_to", ("tensorboard",), allow_none=True)
    if t["report_to"] == "tensorboard":
        import importlib.util

        if importlib.util.find_spec("tensorboard") is None:
            raise ValueError("train.report_to=tensorboard needs the tensorboard package: pip install tensorboard (or set report_to: null)")
    if config["export"]["sampler"] not in ("dpm", "ddim", "ddpm"):
        raise ValueError(f"export.sampler must be dpm, ddim or ddpm; got {config['export']['sampler']!r}")
    o = config["objective"]
    _choice(config, "objective", "kind", OBJECTIVES, allow_none=True)
    _choice(config, "objective", "timestep_sampling", TIMESTEP_SAMPLING)
    _choice(config, "objective", "loss_weighting", LOSS_WEIGHTING)
    if o["shift"] is not None and o["shift"] <= 0:
        raise ValueError(f"objective.shift must be > 0 or null; got {o['shift']!r}")
    ds = config["distill"]
    _choice(config, "distill", "condition", CONDITIONS)
    _choice(config, "distill", "layers", TRANSFER_LAYERS)
    for key in ("data_weight", "output_weight", "attention_weight"):
        if ds[key] < 0:
            raise ValueError(f"distill.{key} must be >= 0; got {ds[key]!r}")
    if ds["teacher"] is None:
        if ds["output_weight"] or ds["attention_weight"]:
            raise ValueError("distill.output_weight / attention_weight need a teacher: set distill.teacher (original or a folder)")
        if ds["data_weight"] <= 0:
            raise ValueError("distill.data_weight must be > 0 without a teacher (nothing else to train on)")
    elif not isinstance(ds["teacher"], str):
        raise ValueError(f"distill.teacher must be null, 'original' or a folder path; got {ds['teacher']!r}")
    elif ds["data_weight"] + ds["output_weight"] + ds["attention_weight"] <= 0:
        raise ValueError("distill: all loss weights are 0 (data_weight, output_weight, attention_weight)")
    if ds["condition"] == "random" and ds["data_weight"] > 0:
        raise ValueError("distill.condition=random draws random class labels, which the data loss cannot use: set distill.data_weight=0")
    lo = config["lora"]
    _choice(config, "lora", "export", ("merge", "separate"))
    if not isinstance(lo["target_modules"], list) or not lo["target_modules"] or not all(isinstance(s, str) for s in lo["target_modules"]):
        raise ValueError(f"lora.target_modules must be a non-empty list of module-name suffixes; got {lo['target_modules']!r}")
    if not 0.0 <= lo["dropout"] < 1.0:
        raise ValueError(f"lora.dropout must be in [0, 1); got {lo['dropout']!r}")
    if not 0.0 < config["ema"]["decay"] < 1.0:
        raise ValueError(f"ema.decay must be in (0, 1); got {config['ema']['decay']!r}")


def resolve_family(config: dict) -> str:
    """The model family of a config: ``model.family``, else the class of ``model.pretrained``'s
    transformer, else ``"dit"`` (training from scratch).

    Raises:
        ValueError: the pretrained transformer's class belongs to no family with a training recipe,
            or contradicts ``model.family``.
    """
    from mhla_diffusers.checkpoint.format import transformer_folder
    from mhla_diffusers.models.families import FAMILIES

    m = config["model"]
    found = None
    if m["pretrained"] is not None:
        try:
            folder = transformer_folder(m["pretrained"])
            name = json.loads((folder / "config.json").read_text()).get("_class_name")
        except (FileNotFoundError, json.JSONDecodeError):
            name = None  # the loader reports a missing / broken folder with its own message
        if name == "Transformer2DModel":
            name = "DiTTransformer2DModel"
        found = next((f.name for f in FAMILIES.values() if name in f.model_classes), None)
        if name is not None and found is None:
            raise ValueError(f"{m['pretrained']}: transformer class {name!r} belongs to no supported family")
        if found is not None and found not in RECIPES:
            raise ValueError(f"{m['pretrained']} is a {found} model; this trainer has recipes for {sorted(RECIPES)}")
    family = m["family"] or found or "dit"
    if found is not None and m["family"] is not None and found != m["family"]:
        raise ValueError(f"model.family is {m['family']!r} but {m['pretrained']} holds a {found} transformer")
    return family


# -- what differs per family ---------------------------------------------------------------------
@dataclass
class TrainingParts:
    """Everything :func:`train` builds besides the optimizer: models, objective, teacher, options.

    Attributes:
        family: ``"dit"`` / ``"sana"`` / ``"wan"``.
        transformer: the model being trained (fp32, train mode, MHLA installed if asked).
        vae: the frozen autoencoder.
        noise_scheduler: DiT: the ``DDPMScheduler`` (its config also defines the exported sampler);
            flow families: the ``FlowMatchEulerDiscreteScheduler`` sigma table.
        objective: the :class:`~mhla_diffusers.training.flow.Objective` trained.
        pipeline: text families: the loaded pipeline (``encode_prompt``, export), else ``None``.
        id2label: DiT: the pretrained pipeline's labels (the dataset's replace them in :func:`train`).
        mhla_applied: names of the attention modules converted by this run (``[]`` if none).
        teacher: the frozen distillation teacher, or ``None``.
        text: ``model.text`` options (max_sequence_length, complex_human_instruction).
        null_condition: text families: the empty caption's encoding (caption dropout on cached data).
    """

    family: str
    transformer: torch.nn.Module
    vae: torch.nn.Module
    noise_scheduler: Any
    objective: Objective
    pipeline: Any = None
    id2label: dict | None = None
    mhla_applied: list = field(default_factory=list)
    teacher: torch.nn.Module | None = None
    text: dict = field(default_factory=dict)
    null_condition: dict | None = None

    def __getitem__(self, key: str):
        """``parts["transformer"]`` as well as ``parts.transformer`` (the older dict interface)."""
        return getattr(self, key)

    @property
    def recipe(self) -> "_Recipe":
        """The family's recipe."""
        return get_recipe(self.family)


def _encode_latents(vae, pixels: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """``vae.encode(pixels)`` -> fp32 latents times ``scaling_factor`` (KL: a posterior sample; DC-AE: ``.latent``)."""
    out = vae.encode(pixels.to(vae.dtype))
    if hasattr(out, "latent_dist"):
        z = out.latent_dist.sample(generator=generator)
    elif hasattr(out, "latent"):
        z = out.latent
    else:
        z = out[0]
    return z.float() * vae.config.scaling_factor


class _Recipe(abc.ABC):
    """The per-family part of training (one small subclass per family)."""

    family = ""
    objective = ""
    text_conditioned = False

    @abc.abstractmethod
    def load(self, config: dict) -> TrainingParts:
        """Load the pipeline / transformer / VAE / encoders named by ``config`` (MHLA installed as configured)."""

    def dropout(self, config: dict) -> float:
        """Probability of dropping a sample's condition (classifier-free guidance)."""
        return float(config["train"]["caption_dropout" if self.text_conditioned else "class_dropout"])

    def prepare(self, parts: TrainingParts, dataset, config: dict) -> list:
        """Check the data against the model; returns ``[(module, attribute, value)]`` to restore before export."""
        return []

    def latents(self, parts: TrainingParts, batch: Mapping, generator: torch.Generator | None = None) -> torch.Tensor:
        """The clean latents of a batch: cached ``latents``, or the frozen vae on ``pixel_values``."""
        if "latents" in batch:
            return batch["latents"].float()
        with torch.no_grad():
            return _encode_latents(parts.vae, batch["pixel_values"], generator)

    @abc.abstractmethod
    def condition(self, parts, batch, drop, mode="dataset", random_labels=None) -> dict:
        """The transformer's conditioning kwargs for ``batch`` (labels or text embeddings), ``drop`` [B] bool marking dropped conditions."""

    @abc.abstractmethod
    def predict(self, model, noisy, timesteps, cond) -> torch.Tensor:
        """The model's prediction for noisy latents ``noisy`` at ``timesteps`` (epsilon or flow velocity, by objective)."""

    @abc.abstractmethod
    def cache_encode(self, parts: TrainingParts, batch: Mapping, device) -> dict:
        """What a latent cache stores for ``batch``: latents and, for text families, the text embeddings."""

    def encoders(self, parts: TrainingParts) -> list:
        """The frozen encoders whose outputs a latent cache stores (fingerprinted in its key)."""
        return [parts.vae]

    @abc.abstractmethod
    def write(self, model, parts: TrainingParts, out_dir: Path, *, sampler: str, id2label) -> None:
        """Write the trained model as a ready diffusers pipeline (converted-checkpoint format) into ``out_dir``."""


class DiTRecipe(_Recipe):
    """Class-conditional DiT (``DiTTransformer2DModel`` + ``DiTPipeline``): DDPM epsilon prediction,
    label dropout to the null class ``num_embeds_ada_norm`` (1000), exported with a DPM / DDIM / DDPM sampler."""

    family = "dit"
    objective = "epsilon"

    def load(self, config: dict) -> TrainingParts:
        """Load ``model.pretrained`` (a DiTPipeline folder) or build ``model.init`` from scratch."""
        from diffusers import DDPMScheduler, DiTTransformer2DModel

        from mhla_diffusers.autoencoder import SpaceToDepthAutoencoder
        from mhla_diffusers.checkpoint.format import load_mhla_pipeline

        m = config["model"]
        id2label = None
        if m["pretrained"] is not None:
            pipe = load_mhla_pipeline(m["pretrained"], torch_dtype=torch.float32)
            transformer, vae = pipe.transformer, pipe.vae
            noise_scheduler = DDPMScheduler.from_config(pipe.scheduler.config)
            raw = pipe.config.get("id2label") if hasattr(pipe, "config") else None
            if raw:
                id2label = {int(k): str(v) for k, v in dict(raw).items()}
        else:
            try:
                transformer = DiTTransformer2DModel(**dict(m["init"]))
            except TypeError as e:
                raise ValueError(f"model.init is not a valid DiTTransformer2DModel config: {e}") from e
            try:
                vae = SpaceToDepthAutoencoder(**dict(m["vae"]))
            except TypeError as e:
                raise ValueError(f"model.vae is not a valid SpaceToDepthAutoencoder config: {e}") from e
            try:
                noise_scheduler = DDPMScheduler(**dict(m["noise_scheduler"]))
            except TypeError as e:
                raise ValueError(f"model.noise_scheduler is not a valid DDPMScheduler config: {e}") from e
        if type(transformer).__name__ != "DiTTransformer2DModel":
            raise ValueError(f"family dit expects a DiTTransformer2DModel; {m['pretrained']} holds a {type(transformer).__name__}")
        if getattr(noise_scheduler.config, "prediction_type", "epsilon") != "epsilon":
            raise ValueError(f"only epsilon prediction is supported; the scheduler says {noise_scheduler.config.prediction_type!r}")
        if transformer.config.get("num_embeds_ada_norm") is None:
            raise ValueError("the transformer must be class-conditional (num_embeds_ada_norm set; DiTPipeline needs 1000)")
        return TrainingParts(
            family=self.family, transformer=transformer, vae=vae, noise_scheduler=noise_scheduler,
            objective=Objective("epsilon", noise_scheduler), id2label=id2label,
        )

    def prepare(self, parts, dataset, config):
        """Resolution vs ``sample_size``, class count vs the null label; diffusers' own label dropout off."""
        check_resolution(parts.transformer, parts.vae, int(config["data"]["resolution"]))
        null_class = int(parts.transformer.config.num_embeds_ada_norm)
        labels = getattr(dataset, "id2label", None) or {}
        if len(labels) > null_class:
            raise ValueError(f"{len(labels)} classes but the model has {null_class} (num_embeds_ada_norm)")
        restore = [(m, "dropout_prob", p) for m, p in disable_internal_label_dropout(parts.transformer)]
        if parts.teacher is not None:
            disable_internal_label_dropout(parts.teacher)
        return restore

    def condition(self, parts, batch, drop, mode="dataset", random_labels=None):
        """``{"class_labels"}``: the batch's (``mode="dataset"``), ``random_labels`` (``"random"``) or
        the null class (``"null"``); dropped samples get the null class."""
        null_class = int(parts.transformer.config.num_embeds_ada_norm)
        labels = batch["class_labels"]
        if mode == "random":
            labels = random_labels
        elif mode == "null":
            labels = torch.full_like(labels, null_class)
        return {"class_labels": torch.where(drop.to(labels.device), torch.full_like(labels, null_class), labels)}

    def predict(self, model, noisy, timesteps, cond):
        """The epsilon half of the output (learned-sigma models predict ``2 C`` channels)."""
        pred = model(noisy, timestep=timesteps, class_labels=cond["class_labels"]).sample
        return pred[:, : noisy.shape[1]]

    def cache_encode(self, parts, batch, device):
        """``{"latents", "class_labels"}`` of a batch."""
        return {"latents": _encode_latents(parts.vae, batch["pixel_values"].to(device)), "class_labels": batch["class_labels"]}

    def write(self, model, parts, out_dir, *, sampler, id2label):
        """A complete ``DiTPipeline`` (see :func:`export_pipeline`)."""
        export_pipeline(model, parts.vae, parts.noise_scheduler, out_dir, sampler=sampler, id2label=id2label, overwrite=True)


def _call_default(pipe, name: str):
    """The default of ``name`` in the pipeline's ``__call__`` (what inference uses), or ``None``."""
    import inspect

    param = inspect.signature(type(pipe).__call__).parameters.get(name)
    return None if param is None or param.default is inspect.Parameter.empty else param.default


class _TextRecipe(_Recipe):
    """Shared by the text-conditioned flow-matching families (SANA, Wan): the pipeline's own
    ``encode_prompt``, caption dropout to the empty caption, export as the same pipeline."""

    objective = "flow"
    text_conditioned = True
    transformer_class = ""
    # encode_text's outputs -> the transformer's keyword arguments
    condition_keys: dict[str, str] = {}

    def load(self, config: dict) -> TrainingParts:
        """Load ``model.pretrained`` (a pipeline folder, plain or converted) and the flow objective;
        the flow shift defaults to the pipeline scheduler's ``flow_shift``."""
        from mhla_diffusers.checkpoint.format import load_mhla_pipeline

        m = config["model"]
        pipe = load_mhla_pipeline(m["pretrained"], torch_dtype=torch.float32)
        if type(pipe.transformer).__name__ != self.transformer_class or not hasattr(pipe, "encode_prompt"):
            raise ValueError(f"family {self.family} expects a pipeline with a {self.transformer_class}; "
                             f"{m['pretrained']} holds {type(pipe).__name__} / {type(pipe.transformer).__name__}")
        for module in (pipe.vae, pipe.text_encoder):
            module.requires_grad_(False).eval()
        sched = pipe.scheduler.config
        shift = config["objective"]["shift"] or sched.get("flow_shift") or sched.get("shift") or 1.0
        table = flow_match_scheduler(float(shift), int(sched.get("num_train_timesteps", 1000)))
        o = config["objective"]
        objective = Objective(
            "flow", table, timestep_sampling=o["timestep_sampling"], logit_mean=o["logit_mean"], logit_std=o["logit_std"],
            mode_scale=o["mode_scale"], loss_weighting=o["loss_weighting"],
        )
        text = dict(m["text"])
        if text["max_sequence_length"] is None:
            text["max_sequence_length"] = _call_default(pipe, "max_sequence_length") or 300
        return TrainingParts(
            family=self.family, transformer=pipe.transformer, vae=pipe.vae, noise_scheduler=table,
            objective=objective, pipeline=pipe, text=text,
        )

    def prepare(self, parts, dataset, config):
        """Encode the empty caption once (caption dropout on cached embeddings)."""
        parts.null_condition = self.encode_text(parts, [""], parts.pipeline.text_encoder.device)
        return []

    @abc.abstractmethod
    def encode_text(self, parts, captions: Sequence[str], device) -> dict:
        """Encode ``captions`` with the pipeline's own ``encode_prompt``: the transformer's text kwargs."""

    @staticmethod
    def captions(batch: Mapping, id2label: Mapping | None, template: str = "{}") -> list[str]:
        """A batch's captions: its ``caption`` strings, or its class names through ``template``."""
        if "caption" in batch:
            return [str(c) for c in batch["caption"]]
        if "class_labels" in batch and id2label:
            return [template.format(id2label[int(i)]) for i in batch["class_labels"]]
        raise ValueError("a text-conditioned model needs captions: use data.kind=captions / video, or class-labelled data (photos / folder)")

    def condition(self, parts, batch, drop, mode="dataset", random_labels=None):
        """The transformer's text inputs; dropped samples (and ``mode="null"``) get the empty caption.
        ``mode="random"`` is not defined for text (use ``null``)."""
        if mode == "random":
            raise ValueError("distill.condition=random needs class labels; use null (empty captions) for text models")
        device = batch["latents"].device if "latents" in batch else batch["pixel_values"].device
        n = len(drop)
        drop = drop.to(device) if mode != "null" else torch.ones(n, dtype=torch.bool, device=device)
        if "prompt_embeds" in batch:
            enc = {k: batch[k] for k in self.condition_keys}
            if bool(drop.any()):
                for k, v in enc.items():
                    null = parts.null_condition[k].to(device, v.dtype).expand_as(v)
                    enc[k] = torch.where(drop.view(-1, *([1] * (v.ndim - 1))), null, v)
        else:
            captions = self.captions(batch, parts.id2label, parts.text.get("template", "{}"))
            captions = ["" if d else c for c, d in zip(captions, drop.tolist())]
            enc = self.encode_text(parts, captions, device)
        out = {self.condition_keys[k]: v for k, v in enc.items()}
        out["encoder_hidden_states"] = out["encoder_hidden_states"].float()
        return out

    def cache_encode(self, parts, batch, device):
        """``{"latents", <text embeddings>}`` of a batch."""
        captions = self.captions(batch, parts.id2label, parts.text.get("template", "{}"))
        latents = self.latents(parts, {"pixel_values": batch["pixel_values"].to(device)})
        return {"latents": latents, **self.encode_text(parts, captions, device)}

    def encoders(self, parts):
        """The vae, the text encoder and the text options (all change what the cache holds)."""
        return [parts.vae, parts.pipeline.text_encoder, {"text": {k: v for k, v in parts.text.items()}}]

    def write(self, model, parts, out_dir, *, sampler, id2label):
        """The loaded pipeline with the trained transformer (its own scheduler; ``sampler`` is DiT's)."""
        from mhla_diffusers.checkpoint.format import save_mhla_pipeline

        components = dict(parts.pipeline.components)
        components["transformer"] = model
        save_mhla_pipeline(type(parts.pipeline)(**components), out_dir, overwrite=True)


class SanaRecipe(_TextRecipe):
    """Text-to-image SANA (``SanaTransformer2DModel`` + ``SanaPipeline``): flow matching (target
    ``noise - x0``), captions encoded by the pipeline's ``encode_prompt`` (Gemma-2, with the
    complex human instruction as at inference unless ``model.text`` says otherwise), caption dropout
    to the empty caption; exported as the same pipeline (its text encoder, vae and sampler)."""

    family = "sana"
    transformer_class = "SanaTransformer2DModel"
    condition_keys = {"prompt_embeds": "encoder_hidden_states", "prompt_attention_mask": "encoder_attention_mask"}

    def load(self, config: dict) -> TrainingParts:
        """As :meth:`_TextRecipe.load`; ``complex_human_instruction: default`` becomes the pipeline's own."""
        parts = super().load(config)
        if parts.text["complex_human_instruction"] == "default":
            parts.text["complex_human_instruction"] = _call_default(parts.pipeline, "complex_human_instruction")
        return parts

    def encode_text(self, parts, captions: Sequence[str], device) -> dict:
        """``{"prompt_embeds" [B, L, D], "prompt_attention_mask" [B, L]}`` of ``captions`` (no grad)."""
        with torch.no_grad():
            embeds, mask, _, _ = parts.pipeline.encode_prompt(
                list(captions), do_classifier_free_guidance=False, device=device, clean_caption=False,
                max_sequence_length=int(parts.text["max_sequence_length"]),
                complex_human_instruction=parts.text["complex_human_instruction"],
            )
        return {"prompt_embeds": embeds, "prompt_attention_mask": mask}

    def predict(self, model, noisy, timesteps, cond):
        """The velocity prediction ``v = noise - x0``."""
        return model(
            noisy, encoder_hidden_states=cond["encoder_hidden_states"], encoder_attention_mask=cond["encoder_attention_mask"],
            timestep=timesteps,
        ).sample


class WanRecipe(_TextRecipe):
    """Text-to-video Wan 2.1 (``WanTransformer3DModel`` + ``WanPipeline``): flow matching (the
    authors' recipe: shift 3 from the pipeline's scheduler, logit-normal timesteps), UMT5 captions
    through ``encode_prompt`` (zero-padded to ``max_sequence_length``, 512 by default), latents of
    ``AutoencoderKLWan`` normalised with its ``latents_mean`` / ``latents_std`` (the inverse of what
    ``WanPipeline`` does before decoding). Images (photos, folders) train as one-frame videos."""

    family = "wan"
    transformer_class = "WanTransformer3DModel"
    condition_keys = {"prompt_embeds": "encoder_hidden_states"}

    def latents(self, parts, batch, generator=None):
        """Normalised video latents ``[B, z, F', H/8, W/8]`` (``pixel_values`` ``[B, 3, F, H, W]`` or images ``[B, 3, H, W]``)."""
        if "latents" in batch:
            return batch["latents"].float()
        pixels = batch["pixel_values"]
        if pixels.ndim == 4:
            pixels = pixels.unsqueeze(2)
        vae = parts.vae
        with torch.no_grad():
            z = vae.encode(pixels.to(vae.dtype)).latent_dist.sample(generator=generator).float()
        shape = (1, vae.config.z_dim) + (1,) * (z.ndim - 2)
        mean = torch.tensor(vae.config.latents_mean, device=z.device, dtype=z.dtype).view(shape)
        std = torch.tensor(vae.config.latents_std, device=z.device, dtype=z.dtype).view(shape)
        return (z - mean) / std

    def encode_text(self, parts, captions: Sequence[str], device) -> dict:
        """``{"prompt_embeds" [B, L, D]}`` (zero rows after each caption's tokens), no grad."""
        with torch.no_grad():
            embeds, _ = parts.pipeline.encode_prompt(
                list(captions), do_classifier_free_guidance=False, device=device,
                max_sequence_length=int(parts.text["max_sequence_length"]),
            )
        return {"prompt_embeds": embeds}

    def predict(self, model, noisy, timesteps, cond):
        """The velocity prediction ``v = noise - x0``."""
        return model(hidden_states=noisy, timestep=timesteps, encoder_hidden_states=cond["encoder_hidden_states"]).sample


RECIPES: dict[str, _Recipe] = {"dit": DiTRecipe(), "sana": SanaRecipe(), "wan": WanRecipe()}


def get_recipe(family: str) -> _Recipe:
    """The training recipe of a model family.

    Raises:
        ValueError: no recipe for ``family``.
    """
    if family not in RECIPES:
        raise ValueError(f"no training recipe for family {family!r}; available: {sorted(RECIPES)}")
    return RECIPES[family]


# -- models, data, optimizer -----------------------------------------------------------------------
def build_models(config: dict) -> TrainingParts:
    """Build what training needs from ``config`` (``model``, ``mhla``, ``objective``, ``distill``,
    ``lora``, ``train.trainable``).

    Order: load the family's models; copy the teacher (``distill.teacher: original``) before anything
    changes the weights; apply MHLA (unless the checkpoint has it); cast to fp32; choose the trainable
    set (:func:`set_trainable`: full, LoRA, attention-only or mixing-only).

    Returns:
        :class:`TrainingParts` (the transformer in fp32 and train mode; vae / text encoder / teacher
        frozen in eval mode).

    Raises:
        ValueError: a bad ``model.init`` / ``model.vae`` / ``model.noise_scheduler`` dict, a model
            that does not fit its family, an ``objective.kind`` the family does not train, a teacher
            of another family.
        FileNotFoundError, MHLACheckpointError: from :func:`mhla_diffusers.load_mhla_pipeline`.
    """
    from mhla_diffusers.models.install import apply_mhla, is_mhla_model
    from mhla_diffusers.training.distill import load_teacher, make_teacher

    family = resolve_family(config)
    recipe = get_recipe(family)
    kind = config["objective"]["kind"]
    if kind is not None and kind != recipe.objective:
        raise ValueError(f"objective.kind={kind!r}: the {family} recipe trains {recipe.objective!r} (set objective.kind to it or null)")
    parts = recipe.load(config)
    transformer = parts.transformer
    teacher = config["distill"]["teacher"]
    if teacher == "original":
        parts.teacher = make_teacher(transformer)
    elif teacher:
        parts.teacher = load_teacher(teacher)
        if type(parts.teacher) is not type(transformer):
            raise ValueError(f"distill.teacher {teacher} holds a {type(parts.teacher).__name__}; the student is a {type(transformer).__name__}")
    if config["mhla"] is not None and not is_mhla_model(transformer):
        parts.mhla_applied = apply_mhla(transformer, **dict(config["mhla"]))
    if any(p.dtype != torch.float32 for p in transformer.parameters()):
        transformer.to(torch.float32)  # trainable parameters in fp32 (autocast does the rest)
    t = config["train"]
    set_trainable(transformer, t["trainable"], lora=config["lora"], train_mixing=bool(t["train_mixing"]))
    transformer.train()
    parts.vae.requires_grad_(False).eval()
    parts.text["template"] = config["data"]["caption_template"]
    return parts


def set_trainable(
    transformer: torch.nn.Module, trainable: str = "full", *, lora: Mapping | None = None, train_mixing: bool = True
) -> int:
    """Choose which parameters train, in place; returns how many parameter elements do.

    - ``"full"``: every parameter.
    - ``"lora"``: LoRA adapters from :func:`mhla_diffusers.checkpoint.lora.add_lora` (``lora``: the config's
      ``lora`` section: rank, alpha, dropout, target_modules); everything else frozen.
    - ``"attention"``: the parameters of the self-attention modules (q, k, v, out projections, norms).
    - ``"mixing"``: nothing but the MHLA parameters (mixing matrices, Wan's output norms).

    With ``train_mixing`` the MHLA parameters (mixing matrices, Wan's output norms:
    :func:`mhla_diffusers.checkpoint.lora.mhla_parameters`) train in every set (``add_lora`` would freeze them
    otherwise); without it they are frozen in every set.

    Raises:
        ValueError: unknown ``trainable``, ``"mixing"`` on a model without MHLA, nothing left to train.
    """
    from mhla_diffusers.models.families import self_attention_modules
    from mhla_diffusers.checkpoint.lora import add_lora, mhla_parameters

    if trainable not in TRAINABLE_SETS:
        raise ValueError(f"trainable must be one of {TRAINABLE_SETS}; got {trainable!r}")
    mixing = mhla_parameters(transformer)
    if trainable == "full":
        transformer.requires_grad_(True)
    elif trainable == "lora":
        lo = dict(lora or {})
        add_lora(
            transformer, rank=int(lo.get("rank", 16)), alpha=lo.get("alpha"), dropout=float(lo.get("dropout", 0.0)),
            target_modules=lo.get("target_modules") or ("to_q", "to_k", "to_v", "to_out.0"), train_mixing=train_mixing,
        )
    elif trainable == "attention":
        transformer.requires_grad_(False)
        for _, attn in self_attention_modules(transformer):
            attn.requires_grad_(True)
    else:
        if not mixing:
            raise ValueError("train.trainable=mixing needs a model with MHLA (set the mhla section)")
        transformer.requires_grad_(False)
    for p in mixing:
        p.requires_grad_(bool(train_mixing))
    count = sum(p.numel() for p in transformer.parameters() if p.requires_grad)
    if count == 0:
        raise ValueError(f"train.trainable={trainable} with train_mixing={train_mixing} leaves nothing to train")
    return count


def prepare_parameter_dtypes(model: torch.nn.Module, weight_dtype: torch.dtype) -> dict[str, int]:
    """Frozen parameters to ``weight_dtype`` (memory), trainable ones (mixing matrices included) to fp32.

    The fp16 recipe (CASES C16): a ``GradScaler`` refuses to unscale fp16 gradients ("Attempting to
    unscale FP16 gradients"), so every parameter that receives a gradient must be fp32; frozen
    weights may be fp16 / bf16 and run under autocast. Trainable parameters are never round-tripped
    through the low-precision dtype (no precision is lost). Same end state as casting the model and
    then :func:`diffusers.training_utils.cast_training_params`.

    Frozen parameters of the modules the model class keeps in fp32 (diffusers'
    ``_keep_in_fp32_modules``, e.g. Wan's time embedder and norms) stay fp32, as
    ``from_pretrained(torch_dtype=...)`` keeps them.

    Returns:
        ``{"frozen": elements in weight_dtype, "trainable": elements in fp32, "kept_fp32": frozen elements kept in fp32}``.
    """
    keep = tuple(getattr(model, "_keep_in_fp32_modules", None) or ())
    frozen = trainable = kept = 0
    for name, p in model.named_parameters():
        parts = name.split(".")
        if p.requires_grad or any(k in parts for k in keep):
            if p.dtype != torch.float32:
                p.data = p.data.to(torch.float32)
            if p.requires_grad:
                trainable += p.numel()
            else:
                kept += p.numel()
        else:
            if p.dtype != weight_dtype:
                p.data = p.data.to(weight_dtype)
            frozen += p.numel()
    return {"frozen": frozen, "trainable": trainable, "kept_fp32": kept}


def vae_scale_factor(vae) -> int:
    """Pixels per latent pixel: ``config.factor`` (SpaceToDepthAutoencoder) or ``2 ** (levels - 1)`` (AutoencoderKL)."""
    if "factor" in vae.config:
        return int(vae.config.factor)
    return 2 ** (len(vae.config.block_out_channels) - 1)


def check_resolution(transformer, vae, resolution: int) -> None:
    """Raise ``ValueError`` unless ``resolution / vae_scale_factor == transformer.config.sample_size``.

    DiT's positional embedding and ``DiTPipeline`` are fixed to ``sample_size`` latent pixels.
    """
    f = vae_scale_factor(vae)
    size = transformer.config.sample_size
    if resolution % f or resolution // f != size:
        raise ValueError(
            f"data.resolution={resolution} px gives {resolution / f:g} latent pixels (vae factor {f}), but the "
            f"transformer's sample_size is {size}: set data.resolution to {size * f}"
        )


def build_dataset(data: Mapping[str, Any]):
    """The dataset of ``config["data"]``: :class:`PhotoCrops` (``kind: photos``),
    :class:`ImageFolderCrops` (``folder``), :class:`CaptionedImageCrops` (``captions``) or
    :class:`VideoClips` (``video``).

    Raises:
        ValueError / FileNotFoundError: from the dataset constructors (bad sizes, empty folder, ...).
    """
    from mhla_diffusers.training.data import CaptionedImageCrops, ImageFolderCrops, PhotoCrops, VideoClips

    if data["kind"] == "video":
        return VideoClips(
            data["root"], resolution=data["resolution"], num_frames=data.get("num_frames", 17), frame_stride=data.get("frame_stride", 1),
            clips_per_video=data["crops_per_image"], seed=data["seed"], hflip=data["hflip"],
            caption_column=data.get("caption_column", "text"), missing_caption=data.get("missing_caption", "error"),
        )
    common = dict(resolution=data["resolution"], short_side=data["short_side"], seed=data["seed"], hflip=data["hflip"])
    if data["kind"] == "photos":
        return PhotoCrops(crops_per_photo=data["crops_per_image"], photos=data["photos"], **common)
    if data["kind"] == "captions":
        return CaptionedImageCrops(
            data["root"], crops_per_image=data["crops_per_image"], caption_column=data.get("caption_column", "text"),
            missing_caption=data.get("missing_caption", "error"), **common,
        )
    return ImageFolderCrops(data["root"], crops_per_image=data["crops_per_image"], **common)


def build_optimizer(
    model: torch.nn.Module,
    lr: float,
    *,
    mixing_lr: float | None = None,
    weight_decay: float = 0.0,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-8,
) -> torch.optim.AdamW:
    """AdamW over the trainable parameters of ``model``; MHLA mixing matrices in a second group.

    Group 0: every other trainable parameter (``lr``, ``weight_decay``). Group 1 (if the model has
    trainable mixing matrices): the mixing matrices (``mixing_lr`` or ``lr``, no weight decay).

    Raises:
        ValueError: no trainable parameters.
    """
    from mhla_diffusers.ops.mixing import mixing_parameters

    mixing = [p for p in mixing_parameters(model) if p.requires_grad]
    ids = {id(p) for p in mixing}
    rest = [p for p in model.parameters() if p.requires_grad and id(p) not in ids]
    if not rest and not mixing:
        raise ValueError("the model has no trainable parameters")
    groups = []
    if rest:
        groups.append({"params": rest, "lr": lr, "weight_decay": weight_decay, "name": "model"})
    if mixing:
        groups.append({"params": mixing, "lr": lr if mixing_lr is None else mixing_lr, "weight_decay": 0.0, "name": "mhla_mixing"})
    return torch.optim.AdamW(groups, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)


def gradient_groups(model: torch.nn.Module) -> dict[str, list[torch.nn.Parameter]]:
    """The trainable parameters of ``model`` in the groups whose gradient norms are clipped and logged
    one by one (:func:`clip_grad_norms_`), so that a spike in one group cannot scale the others' step
    to nothing.

    ``"model"``: every trainable parameter not in the next two (Wan's MHLA output norms included);
    ``"lora"``: the LoRA adapter weights (:func:`mhla_diffusers.checkpoint.lora.lora_parameters`);
    ``"mhla_mixing"``: the MHLA mixing matrices. Empty groups are left out; the order is that one.
    """
    from mhla_diffusers.checkpoint.lora import lora_parameters
    from mhla_diffusers.ops.mixing import mixing_parameters

    mixing = [p for p in mixing_parameters(model) if p.requires_grad]
    lora_ids = {id(p) for p in lora_parameters(model)}
    taken = {id(p) for p in mixing} | lora_ids
    groups = {
        "model": [p for p in model.parameters() if p.requires_grad and id(p) not in taken],
        "lora": [p for p in model.parameters() if p.requires_grad and id(p) in lora_ids],
        "mhla_mixing": mixing,
    }
    return {name: params for name, params in groups.items() if params}


@torch.no_grad()
def clip_grad_norms_(groups: Mapping[str, Sequence[torch.nn.Parameter]], max_norm: float | None) -> dict[str, float]:
    """Clip the gradients of each group of ``groups`` to a 2-norm of at most ``max_norm``, in place.

    Each group is scaled on its own by ``min(1, max_norm / (norm + 1e-6))`` (what
    ``torch.nn.utils.clip_grad_norm_`` does to all parameters at once), so one group's gradient
    spike leaves the others' as they are. ``max_norm`` 0 or ``None``: nothing is clipped, the norms
    are still measured. A group with a non-finite norm is not scaled (the caller skips the step).

    Args:
        groups: ``{name: parameters}`` (e.g. :func:`gradient_groups`); parameters without a
            gradient are ignored.
        max_norm: the largest gradient norm of a group, or 0 / ``None``.

    Returns:
        ``{name: norm before clipping}`` (Python floats; ``0.0`` for a group without gradients).
    """
    norms = {}
    for name, params in groups.items():
        grads = [p.grad for p in params if p.grad is not None]
        if not grads:
            norms[name] = 0.0
            continue
        norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g.detach().float()) for g in grads]))
        norms[name] = float(norm)
        if max_norm and math.isfinite(norms[name]):
            scale = (float(max_norm) / (norm + 1e-6)).clamp(max=1.0)
            for g in grads:
                g.mul_(scale.to(g.dtype))
    return norms


def disable_internal_label_dropout(transformer: torch.nn.Module) -> list[tuple[torch.nn.Module, float]]:
    """Turn off diffusers' own label dropout inside DiT (each block draws its own, from the global RNG).

    :func:`training_loss` drops labels itself, once per sample, from a seeded generator. Returns
    ``[(module, old_prob)]`` so the caller can restore them (the probability is not in the config
    or the state dict, so saving is unaffected either way).
    """
    from diffusers.models.embeddings import LabelEmbedding

    changed = []
    for module in transformer.modules():
        if isinstance(module, LabelEmbedding) and module.dropout_prob > 0:
            changed.append((module, module.dropout_prob))
            module.dropout_prob = 0.0
    return changed


# -- the loss --------------------------------------------------------------------------------------
def _step_draws(parts: TrainingParts, latents: torch.Tensor, generator, *, rank: int, world_size: int, dropout: float,
                condition: str, num_classes: int | None):
    """The random draws of one micro-batch, made for the GLOBAL micro-batch (``world_size`` x the local
    one) from one generator and sliced: sample ``j`` of rank ``r`` takes global position ``j * world + r``,
    the position ``DistributedSampler`` gives it. The same global batch thus gets the same noise,
    timesteps and dropout whatever the number of processes (and, for one process, the draws of the
    original single-process trainer)."""
    b, device = latents.shape[0], latents.device
    g = b * world_size
    noise = torch.randn((g,) + tuple(latents.shape[1:]), generator=generator, device=device, dtype=latents.dtype)
    draw = parts.objective.draw(g, generator, device)
    drop = torch.rand(g, generator=generator, device=device) < dropout
    random_labels = None
    if condition == "random":
        random_labels = torch.randint(0, int(num_classes), (g,), generator=generator, device=device)
    sel = torch.arange(b, device=device) * world_size + rank
    return noise[sel], draw[sel], drop[sel], None if random_labels is None else random_labels[sel]


def training_loss(
    parts: TrainingParts,
    model: torch.nn.Module,
    batch: Mapping[str, Any],
    *,
    generator: torch.Generator | None = None,
    rank: int = 0,
    world_size: int = 1,
    dropout: float = 0.0,
    condition: str = "dataset",
    data_weight: float = 1.0,
    output_weight: float = 0.0,
    attention_weight: float = 0.0,
    recorders: tuple | None = None,
    num_classes: int | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The loss of one micro-batch: ``data_weight * data + output_weight * output + attention_weight * attention``.

    - data: the family's objective (:class:`~mhla_diffusers.training.flow.Objective`: epsilon MSE for DiT,
      flow matching ``||v_theta(x_t) - (noise - x0)||^2`` with its loss weighting for SANA);
    - output: ``MSE(student, teacher)`` on the same ``x_t``, timestep and condition;
    - attention: attention transfer, the mean over layers of the MSE between the recorded
      self-attention outputs of student and teacher (``recorders``).

    Args:
        parts: from :func:`build_models` (``parts.teacher`` is used when a distillation weight is > 0).
        model: the student (``parts.transformer``, possibly wrapped by accelerate / DDP).
        batch: on the training device: ``pixel_values`` or cached ``latents``, and ``class_labels``,
            ``caption`` or cached text embeddings.
        generator: the step's generator (noise, timesteps, dropout, random labels); see
            :func:`_step_draws` for how ranks share one global draw.
        rank, world_size: this process among the data-parallel processes.
        dropout: probability of replacing a sample's condition by the null label / empty caption.
        condition: ``"dataset"``, ``"random"`` (random class ids in ``[0, num_classes)``) or ``"null"``.
        recorders: ``(student_recorder, teacher_recorder)``
            (:class:`~mhla_diffusers.training.distill.AttentionRecorder`), needed when ``attention_weight > 0``.

    Returns:
        ``(loss, terms)``: the scalar fp32 loss and its unweighted terms ``{"data", "output", "attention"}``
        (those with a weight > 0).
    """
    from mhla_diffusers.training.distill import attention_transfer_loss, output_matching_loss

    recipe = parts.recipe
    latents = recipe.latents(parts, batch, generator)
    noise, draw, drop, random_labels = _step_draws(
        parts, latents, generator, rank=rank, world_size=world_size, dropout=dropout, condition=condition, num_classes=num_classes,
    )
    noisy, timesteps, target, weights = parts.objective.inputs(latents, noise, draw)
    cond = recipe.condition(parts, batch, drop, condition, random_labels)
    student_rec, teacher_rec = recorders if recorders is not None else (None, None)
    if attention_weight > 0 and student_rec is None:
        raise ValueError("attention_weight > 0 needs recorders=(student, teacher) AttentionRecorders")
    if attention_weight > 0:
        with student_rec:
            pred = recipe.predict(model, noisy, timesteps, cond)
    else:
        pred = recipe.predict(model, noisy, timesteps, cond)
    terms: dict[str, torch.Tensor] = {}
    if data_weight > 0:
        terms["data"] = parts.objective.loss(pred, target, weights)
    if output_weight > 0 or attention_weight > 0:
        if parts.teacher is None:
            raise ValueError("distillation weights > 0 need parts.teacher (distill.teacher)")
        with torch.no_grad():
            if attention_weight > 0:
                with teacher_rec:
                    teacher_pred = recipe.predict(parts.teacher, noisy, timesteps, cond)
            else:
                teacher_pred = recipe.predict(parts.teacher, noisy, timesteps, cond)
        if output_weight > 0:
            terms["output"] = output_matching_loss(pred, teacher_pred)
        if attention_weight > 0:
            terms["attention"] = attention_transfer_loss(student_rec.outputs, teacher_rec.outputs, list(student_rec.modules))
    weights_by_term = {"data": data_weight, "output": output_weight, "attention": attention_weight}
    loss = sum(weights_by_term[k] * v for k, v in terms.items())
    return loss, terms


def diffusion_loss(
    transformer: torch.nn.Module,
    vae: torch.nn.Module,
    noise_scheduler,
    batch: Mapping[str, torch.Tensor],
    *,
    generator: torch.Generator | None = None,
    class_dropout: float = 0.1,
    null_class: int = 1000,
) -> torch.Tensor:
    """DDPM epsilon-prediction loss of one batch: ``mean ||eps - eps_theta(x_t, t, y)||^2``.

    ``x_0 = vae.encode(pixels).latent_dist.sample() * scaling_factor``; ``t ~ U{0..T-1}``;
    ``x_t = noise_scheduler.add_noise(x_0, eps, t)``; with probability ``class_dropout`` a label is
    replaced by ``null_class`` (classifier-free guidance, as DiT trains). For a transformer with
    learned sigma (``out_channels == 2 * in_channels``) only the epsilon half is trained.

    Args:
        transformer: ``DiTTransformer2DModel`` (possibly wrapped by accelerate / DDP).
        vae: any diffusers-style autoencoder (frozen; encoded without grad).
        noise_scheduler: a ``DDPMScheduler`` (``add_noise``, ``config.num_train_timesteps``).
        batch: ``pixel_values`` float ``[B, 3, H, W]`` in ``[-1, 1]``, ``class_labels`` long ``[B]``;
            on the training device.
        generator: draws ``t``, ``eps`` and the dropout (on the batch's device); ``None``: global RNG.
        class_dropout: probability of dropping a label.
        null_class: the unconditional label (``num_embeds_ada_norm``; 1000 for DiT).

    Returns:
        Scalar fp32 loss.
    """
    pixels = batch["pixel_values"]
    labels = batch["class_labels"]
    device = pixels.device
    with torch.no_grad():
        latents = vae.encode(pixels.to(vae.dtype)).latent_dist.sample() * vae.config.scaling_factor
    latents = latents.float()
    b = latents.shape[0]
    noise = torch.randn(latents.shape, generator=generator, device=device, dtype=latents.dtype)
    t = torch.randint(0, noise_scheduler.config.num_train_timesteps, (b,), generator=generator, device=device)
    drop = torch.rand(b, generator=generator, device=device) < class_dropout
    labels = torch.where(drop, torch.full_like(labels, null_class), labels)
    noisy = noise_scheduler.add_noise(latents, noise, t)
    pred = transformer(noisy, timestep=t, class_labels=labels).sample
    channels = latents.shape[1]
    if pred.shape[1] == 2 * channels:
        pred = pred[:, :channels]
    return F.mse_loss(pred.float(), noise, reduction="mean")


@torch.no_grad()
def evaluate_heldout(
    parts: TrainingParts,
    model: torch.nn.Module,
    dataset,
    *,
    num_samples: int = 160,
    batch_size: int = 16,
    seed: int = 12345,
    teacher: torch.nn.Module | None = None,
) -> dict[str, float | None]:
    """Held-out losses on a fixed set: the same numbers for every model given the same arguments.

    Item ``i`` of ``dataset`` (its current epoch; ``i`` wraps around ``len(dataset)``) with its own
    condition (no dropout) gets the deterministic draw :meth:`Objective.evenly_spaced` (epsilon:
    ``t = round(i (T - 1) / (n - 1))``; flow: ``u = (i + 0.5) / n``) and noise drawn from
    ``torch.Generator().manual_seed(seed)`` on the CPU, batch by batch. Models run in eval mode
    (restored after).

    Returns:
        ``{"loss": the objective's MSE per element (unweighted), "distill_output": MSE per element
        between the model's and the teacher's outputs (None without teacher)}``.

    Raises:
        ValueError: ``num_samples < 1`` or an empty dataset.
    """
    from torch.utils.data import default_collate

    if num_samples < 1 or len(dataset) == 0:
        raise ValueError(f"need num_samples >= 1 and a non-empty dataset; got {num_samples}, {len(dataset)} items")
    recipe = parts.recipe
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    g = torch.Generator().manual_seed(int(seed))
    total = total_t = 0.0
    count = 0
    try:
        for start in range(0, num_samples, batch_size):
            idx = list(range(start, min(start + batch_size, num_samples)))
            batch = default_collate([dataset[i % len(dataset)] for i in idx])
            batch = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
            latents = recipe.latents(parts, batch)
            noise = torch.randn(latents.shape, generator=g).to(device)
            draw = parts.objective.evenly_spaced(torch.tensor(idx, device=device), num_samples)
            noisy, timesteps, target, _ = parts.objective.inputs(latents, noise, draw)
            cond = recipe.condition(parts, batch, torch.zeros(len(idx), dtype=torch.bool, device=device))
            pred = recipe.predict(model, noisy, timesteps, cond).float()
            total += F.mse_loss(pred, target.float(), reduction="sum").item()
            if teacher is not None:
                teacher_pred = recipe.predict(teacher, noisy, timesteps, cond).float()
                total_t += F.mse_loss(pred, teacher_pred, reduction="sum").item()
            count += target.numel()
    finally:
        model.train(was_training)
    return {"loss": total / count, "distill_output": total_t / count if teacher is not None else None}


def evaluate_loss(
    transformer: torch.nn.Module,
    vae: torch.nn.Module,
    noise_scheduler,
    dataset,
    *,
    num_samples: int = 160,
    batch_size: int = 16,
    seed: int = 12345,
) -> float:
    """Held-out epsilon MSE of a DiT on a fixed set (see :func:`evaluate_heldout`, which it calls).

    Returns:
        Mean squared error per element, a Python float.

    Raises:
        ValueError: ``num_samples < 1`` or an empty dataset.
    """
    parts = TrainingParts("dit", transformer, vae, noise_scheduler, Objective("epsilon", noise_scheduler))
    return evaluate_heldout(parts, transformer, dataset, num_samples=num_samples, batch_size=batch_size, seed=seed)["loss"]


# -- logs and plots --------------------------------------------------------------------------------
def _atomic_write_bytes(path: str | os.PathLike, data: bytes) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def _atomic_write_json(path: str | os.PathLike, obj: Any) -> None:
    _atomic_write_bytes(path, (json.dumps(obj, indent=2, sort_keys=True) + "\n").encode())


def write_loss_csv(path: str | os.PathLike, rows: Sequence[tuple]) -> None:
    """Write ``step,loss,lr[,<term>...][,grad_norm_<group>...]`` rows (atomic). ``step`` counts optimizer steps from 1.

    A row is ``(step, loss, lr)``, ``(step, loss, lr, {term: value})`` or
    ``(step, loss, lr, {term: value}, {group: gradient norm})``: the loss terms (``data``,
    ``output``, ``attention``) and the gradient norms of the parameter groups before clipping
    (``grad_norm_model``, ``grad_norm_lora``, ``grad_norm_mhla_mixing``: see
    :func:`gradient_groups`) become extra columns (empty where a row lacks one).
    """
    def extra(r, i):
        return r[i] if len(r) > i and r[i] else {}

    names = sorted({k for r in rows for k in extra(r, 3)}, key=lambda k: (LOSS_TERMS + (k,)).index(k))
    groups = sorted({k for r in rows for k in extra(r, 4)}, key=lambda k: (GRADIENT_GROUPS + (k,)).index(k))
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    w.writerow(["step", "loss", "lr", *names, *(GRAD_NORM_PREFIX + g for g in groups)])
    for r in rows:
        terms, norms = extra(r, 3), extra(r, 4)
        w.writerow([int(r[0]), f"{float(r[1]):.6g}", f"{float(r[2]):.6g}", *(f"{float(terms[k]):.6g}" if k in terms else "" for k in names),
                    *(f"{float(norms[g]):.6g}" if g in norms else "" for g in groups)])
    _atomic_write_bytes(path, buf.getvalue().encode())


def _read_rows(path: str | os.PathLike) -> list[tuple[int, float, float, dict[str, float], dict[str, float]]]:
    """``(step, loss, lr, {term: value}, {group: gradient norm})`` rows of a loss CSV."""
    with open(path, newline="") as f:
        reader = csv.DictReader(f)
        if reader.fieldnames is None or not {"step", "loss", "lr"} <= set(reader.fieldnames):
            raise ValueError(f"{path} is not a loss CSV (expected columns step, loss, lr)")
        extra = [c for c in reader.fieldnames if c not in ("step", "loss", "lr")]
        terms = [c for c in extra if not c.startswith(GRAD_NORM_PREFIX)]
        norms = [c for c in extra if c.startswith(GRAD_NORM_PREFIX)]

        def values(r, columns, strip=0):
            return {k[strip:]: float(r[k]) for k in columns if r.get(k) not in (None, "")}

        return [
            (int(r["step"]), float(r["loss"]), float(r["lr"]), values(r, terms), values(r, norms, len(GRAD_NORM_PREFIX)))
            for r in reader
        ]


def read_loss_csv(path: str | os.PathLike) -> list[tuple[int, float, float]]:
    """Rows ``(step, loss, lr)`` of a loss CSV written by :func:`write_loss_csv`.

    Raises:
        FileNotFoundError: no such file. ValueError: not a loss CSV.
    """
    return [r[:3] for r in _read_rows(path)]


def read_grad_norms(path: str | os.PathLike) -> dict[str, tuple[list[int], list[float]]]:
    """The gradient norms of a loss CSV, per parameter group before clipping: ``{group: (steps, norms)}``
    (``model``, ``lora``, ``mhla_mixing``; see :func:`gradient_groups`). A non-finite norm marks a
    skipped step."""
    out: dict[str, tuple[list[int], list[float]]] = {}
    for step, _, _, _, norms in _read_rows(path):
        for k, v in norms.items():
            out.setdefault(k, ([], []))
            out[k][0].append(step)
            out[k][1].append(v)
    return out


def read_loss_terms(path: str | os.PathLike) -> dict[str, tuple[list[int], list[float]]]:
    """The loss terms of a loss CSV: ``{term: (steps, values)}`` (``data``, ``output``, ``attention``)."""
    out: dict[str, tuple[list[int], list[float]]] = {}
    for step, _, _, terms, _ in _read_rows(path):
        for k, v in terms.items():
            out.setdefault(k, ([], []))
            out[k][0].append(step)
            out[k][1].append(v)
    return out


def _smooth(values: Sequence[float], window: int) -> list[float]:
    out, acc, q = [], 0.0, []
    for v in values:
        q.append(v)
        acc += v
        if len(q) > window:
            acc -= q.pop(0)
        out.append(acc / len(q))
    return out


def plot_loss_curves(
    curves: Mapping[str, tuple[Sequence[int], Sequence[float]]],
    path: str | os.PathLike,
    *,
    title: str = "training loss",
    smooth: int | None = None,
    log_y: bool = True,
    ylabel: str = "loss",
) -> None:
    """Plot loss-vs-step curves (one per name) to a PNG (matplotlib Agg backend; atomic write).

    Args:
        curves: ``{label: (steps, losses)}``.
        path: the ``.png`` to write.
        smooth: moving-average window in steps (default: about 1/20 of the longest curve, >= 1);
            the raw curve is drawn faintly behind the smoothed one.
        log_y: logarithmic loss axis.
        ylabel: the y-axis label.

    Raises:
        ValueError: no curves, or a curve whose step and loss lists differ in length.
        ImportError: matplotlib is not installed.
    """
    import matplotlib

    matplotlib.use("Agg", force=False)
    from matplotlib.figure import Figure

    if not curves:
        raise ValueError("no loss curves to plot")
    longest = max(len(s) for s, _ in curves.values())
    window = smooth or max(1, longest // 20)
    fig = Figure(figsize=(7, 4.2), dpi=110)
    ax = fig.add_subplot(1, 1, 1)
    for i, (label, (steps, losses)) in enumerate(curves.items()):
        if len(steps) != len(losses):
            raise ValueError(f"curve {label!r}: {len(steps)} steps but {len(losses)} losses")
        if not steps:
            continue
        color = f"C{i % 10}"
        if window > 1:
            ax.plot(steps, losses, color=color, alpha=0.2, linewidth=0.8)
        ax.plot(steps, _smooth(losses, window), color=color, linewidth=1.6, label=label)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel(ylabel + (" (log)" if log_y else ""))
    if log_y:
        ax.set_yscale("log")
    ax.set_title(title + (f" (moving average over {window} steps)" if window > 1 else ""), fontsize=10)
    ax.grid(True, alpha=0.3, which="both")
    ax.legend(fontsize=8)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    _atomic_write_bytes(path, buf.getvalue())


# -- export ----------------------------------------------------------------------------------------
def export_pipeline(
    transformer: torch.nn.Module,
    vae: torch.nn.Module,
    noise_scheduler,
    out_dir: str | os.PathLike,
    *,
    sampler: str = "dpm",
    id2label: Mapping[int, str] | None = None,
    overwrite: bool = True,
) -> Path:
    """Write a complete ``DiTPipeline`` folder (atomic, via :func:`mhla_diffusers.save_mhla_pipeline`).

    The sampling scheduler is built from the training ``noise_scheduler``'s config:
    ``DPMSolverMultistepScheduler`` (``sampler="dpm"``), ``DDIMScheduler`` (``"ddim"``) or the
    ``DDPMScheduler`` itself. ``id2label`` is stored in ``model_index.json``, from where
    ``DiTPipeline.from_pretrained`` restores ``pipe.labels``. A transformer with MHLA is written as
    a converted checkpoint (base weights + ``mhla_config.json`` + ``mhla.safetensors``).

    Raises:
        ValueError: unknown ``sampler``. FileExistsError: ``out_dir`` not empty and not ``overwrite``.
    """
    from diffusers import DDIMScheduler, DDPMScheduler, DiTPipeline, DPMSolverMultistepScheduler

    from mhla_diffusers.checkpoint.format import save_mhla_pipeline

    classes = {"dpm": DPMSolverMultistepScheduler, "ddim": DDIMScheduler, "ddpm": DDPMScheduler}
    if sampler not in classes:
        raise ValueError(f"sampler must be one of {sorted(classes)}; got {sampler!r}")
    scheduler = classes[sampler].from_config(noise_scheduler.config)
    labels = {int(k): str(v) for k, v in id2label.items()} if id2label else None
    pipe = DiTPipeline(transformer=transformer, vae=vae, scheduler=scheduler, id2label=labels)
    if labels:
        pipe.register_to_config(id2label={str(k): v for k, v in sorted(labels.items())})
    return save_mhla_pipeline(pipe, out_dir, overwrite=overwrite)


def export_model(
    parts: TrainingParts,
    model: torch.nn.Module,
    out_dir: str | os.PathLike,
    *,
    sampler: str = "dpm",
    id2label: Mapping[int, str] | None = None,
    lora_export: str = "merge",
) -> Path:
    """Write the trained model as the family's complete pipeline in the converted-checkpoint format,
    atomically (a staging folder renamed into place; an existing ``out_dir`` is replaced).

    A model with LoRA adapters is changed IN PLACE: ``lora_export="merge"`` merges them into the
    weights (:func:`mhla_diffusers.checkpoint.lora.merge_lora_`; the folder then loads with
    :func:`mhla_diffusers.load_mhla_pipeline` and computes what the adapted model computed);
    ``"separate"`` writes the adapter to ``<out_dir>/transformer_lora/`` and the base weights
    unmerged (load both with :func:`mhla_diffusers.checkpoint.lora.load_mhla_pipeline_with_lora`).

    Raises:
        ValueError: unknown ``lora_export``.
    """
    import tempfile

    from mhla_diffusers.checkpoint.format import atomic_directory
    from mhla_diffusers.checkpoint.lora import LORA_DIR_NAME, has_lora, merge_lora_, save_lora, unload_lora_

    if lora_export not in ("merge", "separate"):
        raise ValueError(f"lora_export must be 'merge' or 'separate'; got {lora_export!r}")
    out = Path(out_dir)
    with atomic_directory(out, overwrite=True) as staging, tempfile.TemporaryDirectory(dir=out.parent, prefix=f".{out.name}.lora-") as tmp:
        separate = has_lora(model) and lora_export == "separate"
        if separate:
            save_lora(model, Path(tmp) / LORA_DIR_NAME)
            unload_lora_(model)
        elif has_lora(model):
            merge_lora_(model)
        parts.recipe.write(model, parts, staging, sampler=sampler, id2label=id2label)
        if separate:
            shutil.move(str(Path(tmp) / LORA_DIR_NAME), str(staging / LORA_DIR_NAME))
    return out


# -- the training loop -----------------------------------------------------------------------------
def _step_seed(seed: int, step: int, micro: int, rank: int = 0) -> int:
    return (seed * 1_000_003 + step * 7_919 + micro * 104_729 + rank * 15_485_863 + 1) % (1 << 63)


def _checkpoints(ckpt_root: Path) -> tuple[list[tuple[int, Path]], list[Path]]:
    """``([(step, folder)] of complete checkpoints by step, [incomplete folders])``. A checkpoint is
    complete once its ``train_state.json`` is written (last, after the accelerate state and EMA)."""
    complete, incomplete = [], []
    if ckpt_root.is_dir():
        for folder in ckpt_root.iterdir():
            if not (folder.is_dir() and folder.name.startswith("checkpoint_")):
                continue
            try:
                complete.append((int(json.loads((folder / TRAIN_STATE).read_text())["step"]), folder))
            except (OSError, ValueError, KeyError, json.JSONDecodeError):
                incomplete.append(folder)
    return sorted(complete), incomplete


def _complete_checkpoints(ckpt_root: Path) -> list[tuple[int, Path]]:
    """``[(step, folder)]`` of checkpoints whose ``train_state.json`` was written (i.e. complete), by step."""
    return _checkpoints(ckpt_root)[0]


def _check_resume(out: Path, final_dir: Path, resume: bool, complete: list[tuple[int, Path]], max_steps: int) -> dict | None:
    """Check ``train.resume`` against what ``out`` holds, before anything is written.

    Returns the stored summary (``train_summary.json``) when the run already finished at
    ``max_steps`` with its final model in ``final_dir``: resuming it again has nothing to do.
    ``None`` otherwise (train, or, with a checkpoint at ``max_steps`` but no final model, e.g. a run
    killed while exporting, only export).

    Raises:
        ValueError: ``resume`` without a complete checkpoint; checkpoints without ``resume``; the
            latest checkpoint past ``max_steps``; a run that already went past ``max_steps``
            (its summary): resuming would overwrite its final model, ``loss.csv`` and summary with
            those of an earlier step.
    """
    ckpt_root = out / "checkpoints"
    if resume and not complete:
        raise ValueError(f"train.resume is set but {ckpt_root} holds no complete checkpoint; run without --resume")
    if not resume and complete:
        raise ValueError(f"{ckpt_root} already holds checkpoints: pass --resume to continue, or use a new output_dir")
    if not resume:
        return None
    latest, folder = complete[-1]
    if latest > max_steps:
        raise ValueError(
            f"the latest checkpoint ({folder}) is at step {latest}, past train.max_steps = {max_steps}: nothing to "
            f"resume (it would export the step-{latest} weights as the final model); raise train.max_steps above "
            f"{latest} to continue the run. Nothing was written."
        )
    try:
        summary = json.loads((out / SUMMARY).read_text())
        done = summary["steps"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if not isinstance(done, int):
        return None
    if done > max_steps:
        raise ValueError(
            f"{out / SUMMARY}: this run already went to step {done}, past train.max_steps = {max_steps}; resuming "
            f"would replace its final model ({summary.get('final_dir')}), loss.csv and summary with those of step "
            f"{max_steps}. Raise train.max_steps to {done} or more to continue the run, or train into a new output_dir. "
            "Nothing was written."
        )
    exported = summary.get("final_dir")
    if done == max_steps and exported and Path(exported).resolve() == final_dir.resolve() and final_dir.is_dir():
        return summary
    return None


def _save_ema(ema, folder: Path) -> None:
    from safetensors.torch import save_file

    tensors = {f"shadow.{i:05d}": p.detach().to("cpu").contiguous() for i, p in enumerate(ema.shadow_params)}
    save_file(tensors, str(folder / EMA_WEIGHTS), metadata={"optimization_step": str(ema.optimization_step)})


def _load_ema(ema, folder: Path) -> None:
    from safetensors import safe_open

    path = folder / EMA_WEIGHTS
    if not path.is_file():
        raise ValueError(f"{path} is missing: the checkpoint was written without EMA; set ema.enabled=false or start a new run")
    with safe_open(str(path), framework="pt") as f:
        keys = sorted(f.keys())
        if len(keys) != len(ema.shadow_params):
            raise ValueError(f"{path} holds {len(keys)} EMA tensors; the model has {len(ema.shadow_params)} trainable parameters")
        for key, p in zip(keys, ema.shadow_params):
            p.data.copy_(f.get_tensor(key))
        ema.optimization_step = int(f.metadata()["optimization_step"])


# Settings that shape the trained parameters, hence a checkpoint's tensors and optimizer groups:
# a resume that changes one is refused by name (keys and every key below them).
_SHAPE_KEYS = ("model.family", "model.init", "train.trainable", "train.train_mixing")
_SHAPE_KEYS_MHLA = ("mhla.layers", "mhla.num_blocks", "mhla.block_grid", "mhla.output_norm")
_SHAPE_KEYS_LORA = ("lora.rank", "lora.target_modules")  # when the run trains LoRA
_UNSET = "<unset>"


def _dotted(config: Mapping, prefix: str = "") -> dict[str, Any]:
    """``{"section.key": value}`` of a nested config (a null or empty section is one key)."""
    out = {}
    for k, v in config.items():
        key = f"{prefix}{k}"
        if isinstance(v, Mapping) and v:
            out.update(_dotted(v, key + "."))
        else:
            out[key] = v
    return out


def _config_changes(recorded: Mapping, config: Mapping) -> dict[str, tuple[Any, Any]]:
    """``{dotted key: (recorded value, new value)}`` for every key that differs (``train.resume`` aside);
    a key one side lacks reads ``"<unset>"``. Sequences compare by their items (JSON turns tuples into lists)."""
    old, new = _dotted(recorded), _dotted(config)
    changes = {}
    for key in sorted(set(old) | set(new)):
        a, b = old.get(key, _UNSET), new.get(key, _UNSET)
        if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
            a, b = list(a), list(b)
        if a != b and key != "train.resume":
            changes[key] = (old.get(key, _UNSET), new.get(key, _UNSET))
    return changes


def _recorded_config(out: Path, folder: Path) -> tuple[dict | None, Path | None]:
    """The config a checkpoint was trained with: the one its ``train_state.json`` records, else the
    run's ``config.yaml`` (checkpoints written before configs were recorded in them); ``(None, None)``
    when neither is there."""
    try:
        recorded = json.loads((folder / TRAIN_STATE).read_text()).get("config")
        if isinstance(recorded, Mapping):
            return dict(recorded), folder / TRAIN_STATE
    except (OSError, ValueError, AttributeError):
        pass
    try:
        recorded = yaml.safe_load((out / "config.yaml").read_text())
        if isinstance(recorded, Mapping):
            return dict(recorded), out / "config.yaml"
    except (OSError, yaml.YAMLError):
        pass
    return None, None


def _shape_changes(changes: Mapping[str, tuple[Any, Any]], config: Mapping, recorded: Mapping) -> list[str]:
    """The keys of ``changes`` that shape the trained parameters (see ``_SHAPE_KEYS``)."""
    lora = "lora" in (config["train"]["trainable"], (recorded.get("train") or {}).get("trainable"))
    shaping = _SHAPE_KEYS_MHLA + (_SHAPE_KEYS_LORA if lora else ())
    # "mhla" itself changes when MHLA is turned on or off (a null section against a mapping)
    return [key for key in changes
            if key in shaping or key == "mhla" or any(key == k or key.startswith(k + ".") for k in _SHAPE_KEYS)]


def _check_resume_config(out: Path, folder: Path, config: Mapping) -> dict[str, tuple[Any, Any]]:
    """Compare ``config`` with the config recorded for the checkpoint ``folder`` (before anything is
    built or written). Returns the changed settings (``{}`` when nothing is recorded).

    Raises:
        ValueError: a changed setting that shapes the trained parameters (``mhla`` on / off,
            ``mhla.layers``, ``num_blocks``, ``block_grid``, ``output_norm``, ``train.trainable``,
            ``train.train_mixing``, ``model.family``, ``model.init``, ``lora.rank`` /
            ``target_modules`` of a LoRA run): the message names each, old and new value.
    """
    recorded, source = _recorded_config(out, folder)
    if recorded is None:
        return {}
    changes = _config_changes(recorded, config)
    shaping = _shape_changes(changes, config, recorded)
    if "mhla" in changes:  # MHLA turned on or off: name the section once, with both values
        changes["mhla"] = (recorded.get("mhla"), config["mhla"])
        shaping = ["mhla"] + [k for k in shaping if not k.startswith("mhla")]
    if shaping:
        listed = "; ".join(f"{k} changed since the checkpoint ({changes[k][0]!r} -> {changes[k][1]!r})" for k in shaping)
        raise ValueError(
            f"cannot resume from {folder}: {listed}. {'This setting shapes' if len(shaping) == 1 else 'These settings shape'} "
            f"the trained parameters, so the checkpoint's weights and optimizer state do not fit (the run's settings are "
            f"recorded in {source}). Set {'it' if len(shaping) == 1 else 'them'} back to resume, or train into a new "
            "output_dir. Nothing was written."
        )
    return changes


def _apply_optimizer_settings(optimizer, lr_scheduler, fresh: Sequence[Mapping[str, Any]]) -> list[str]:
    """After ``load_state``: put this config's optimizer settings into the loaded optimizer and lr schedule.

    ``load_state`` brings back the checkpoint's param-group settings (learning rate, weight decay,
    betas, eps) with the moment estimates; the run's config may have changed them. ``fresh`` is each
    param group's settings as this config built them (before loading). Every setting that differs is
    set to the config's; a changed learning rate becomes the schedule's base rate (``initial_lr``) and
    the current rate is recomputed from the schedule at the resumed step (so a changed warm-up or
    schedule applies too). Nothing changes when the config is the run's own.

    Returns:
        What was changed, e.g. ``["model: lr 0.001 -> 0.0005"]``.

    Raises:
        ValueError: a changed learning rate under a schedule that is not a ``LambdaLR`` (its base
            rate cannot be replaced).
    """
    sched = getattr(lr_scheduler, "scheduler", lr_scheduler)
    lambdas = getattr(sched, "lr_lambdas", None) if isinstance(sched, torch.optim.lr_scheduler.LambdaLR) else None
    notes = []
    for i, (group, want) in enumerate(zip(optimizer.param_groups, fresh)):
        name = want.get("name", f"group {i}")
        for key, value in want.items():
            have = group.get(key)
            same = list(have) == list(value) if isinstance(value, (list, tuple)) and isinstance(have, (list, tuple)) else have == value
            if key not in ("lr", "initial_lr") and not same:
                notes.append(f"{name}: {key} {have!r} -> {value!r}")
                group[key] = value
        base = want["initial_lr"]
        if sched.base_lrs[i] != base:
            if lambdas is None:
                raise ValueError(f"the learning rate of {name} changed since the checkpoint ({sched.base_lrs[i]:g} -> {base:g}), "
                                 f"but the {type(sched).__name__} schedule cannot take a new base rate: set it back to resume")
            notes.append(f"{name}: lr {sched.base_lrs[i]:g} -> {base:g}")
            sched.base_lrs[i] = group["initial_lr"] = base
        if lambdas is not None:
            lr = base * lambdas[i](sched.last_epoch)
            if group["lr"] != lr:
                group["lr"] = lr
    return notes


def _flat_config(config: Mapping, prefix: str = "") -> dict[str, Any]:
    """Scalars of a nested config as ``{"a/b": value}`` (lists and None as strings) for trackers."""
    out = {}
    for k, v in config.items():
        key = f"{prefix}{k}"
        if isinstance(v, Mapping):
            out.update(_flat_config(v, key + "/"))
        else:
            out[key] = v if isinstance(v, (int, float, str, bool)) else str(v)
    return out


def _cached_dataset(parts: TrainingParts, dataset, cache_dir: Path, accelerator, batch_size: int):
    """Encode ``dataset`` once into ``cache_dir/<key>`` (all processes share the work) and return the cache."""
    from mhla_diffusers.training.cache import CachedDataset, build_cache, cache_key, module_fingerprint

    encoders = [e if isinstance(e, Mapping) else module_fingerprint(e) for e in parts.recipe.encoders(parts)]
    key = cache_key(parts.family, dataset.fingerprint(), encoders)
    folder = build_cache(
        dataset, lambda batch: parts.recipe.cache_encode(parts, batch, accelerator.device), cache_dir / key,
        batch_size=batch_size, rank=accelerator.process_index, world_size=accelerator.num_processes,
        barrier=accelerator.wait_for_everyone, progress=accelerator.is_local_main_process,
    )
    return CachedDataset(folder)


def _clip_gradients(accelerator, model, groups: Mapping[str, Sequence[torch.nn.Parameter]], max_norm: float | None,
                    per_group: bool) -> dict[str, float]:
    """Unscale (fp16) and clip the gradients of one optimizer step; returns the norms before clipping.

    ``per_group``: each of ``groups`` on its own (:func:`clip_grad_norms_`). Otherwise (FSDP, DeepSpeed,
    XLA: accelerate clips sharded / engine-managed gradients itself) the global norm, as ``"all"``.
    """
    if per_group:
        accelerator.unscale_gradients()
        return clip_grad_norms_(groups, max_norm)
    if not max_norm:
        return {}
    total = accelerator.clip_grad_norm_(model.parameters(), max_norm)
    return {} if total is None else {"all": float(total)}


def train(config: dict) -> dict[str, Any]:
    """Train / fine-tune as ``config`` says (see :data:`DEFAULT_CONFIG`); run it under accelerate.

    Writes into ``output_dir``: ``config.yaml`` (the resolved config), ``loss.csv`` (step, loss, lr
    and the loss terms), ``loss.png``, ``checkpoints/checkpoint_<i>/`` (accelerate states plus EMA,
    every ``train.checkpointing_steps``), ``final/`` (the final pipeline in the converted-checkpoint
    format, written atomically; or ``export.dir``), ``train_summary.json`` and, with
    ``report_to: tensorboard``, ``logs/``. With ``train.resume`` it continues from the latest
    complete checkpoint (same data order, noise and final weights as an uninterrupted run on the
    same hardware, bitwise on the CPU); a checkpoint at ``max_steps`` (a run killed while exporting)
    is only evaluated and exported; a run that already finished at ``max_steps`` (its
    ``train_summary.json`` and final model are there) is left as it is and its summary returned.
    A resume compares the config with the one the checkpoint records: settings that shape the
    trained parameters must not change (``ValueError`` naming them); every other change applies
    from the resumed step (the optimizer takes the config's lr, mixing_lr, weight decay and Adam
    settings, not the checkpoint's) and is printed.

    Gradients are clipped per parameter group (:func:`gradient_groups`, :func:`clip_grad_norms_`)
    and the norms logged (``loss.csv``, tracker); a step with a non-finite gradient norm is skipped
    (not applied) and said.

    The random draws of each step (noise, timesteps, condition dropout) are made for the global
    batch and sliced per process, so ``N`` processes with per-process batch ``B`` follow the run of
    one process with batch ``N B`` (up to floating-point reduction order).

    Returns:
        The summary dict (also written to ``train_summary.json``; empty on processes other than the
        main one): ``final_dir``, ``steps``, ``final_loss`` (mean of the last ``log_every`` steps),
        ``wall_time_s``, ``step_time_s``, ``step_cpu_time_s``, ``num_parameters``,
        ``num_trainable_parameters``, ``family``, ``objective``, ``trainable``, ``mhla``,
        ``mhla_layers``, ``mixing_range``, ``batch_size`` (global), ``skipped_steps`` (steps not
        applied: a non-finite gradient norm), ``eval_loss_start`` /
        ``eval_loss`` (held-out data loss before / after, see :func:`evaluate_heldout`; ``None``
        unless ``eval.samples > 0``), ``eval_distill_start`` / ``eval_distill`` (held-out MSE to the
        teacher's output; ``None`` without teacher).

    Raises:
        ValueError: invalid config (see :func:`load_config`), a dataset smaller than one batch,
            ``resume`` without a complete checkpoint (or checkpoints without ``resume``), ``resume``
            with the latest checkpoint or the finished run (``train_summary.json``) past
            ``max_steps``, ``resume`` with a changed setting that shapes the trained parameters
            (these are raised before anything is written), a checkpoint that does not load into the
            model this config builds, a non-finite loss.
    """
    from accelerate import Accelerator
    from accelerate.utils import DistributedDataParallelKwargs, DistributedType, ProjectConfiguration, set_seed
    from diffusers.optimization import get_scheduler
    from torch.utils.data import DataLoader, DistributedSampler
    from tqdm.auto import tqdm

    from mhla_diffusers import mixing as mixing_module
    from mhla_diffusers.models.install import is_mhla_model
    from mhla_diffusers.training.distill import AttentionRecorder, transfer_modules
    from mhla_diffusers.ops.mixing import mixing_parameters

    validate_config(config)
    t_cfg, d_cfg, ds_cfg = config["train"], config["data"], config["distill"]
    out = Path(config["output_dir"])
    world = int(os.environ.get("WORLD_SIZE", "1") or 1)
    # Several train() calls in one process (the demo, tests) may differ in mixed precision or
    # accumulation: forget the previous call's accelerate settings (the process group is kept).
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state()
    GradientState._reset_state()
    accelerator = Accelerator(
        # Several processes without CUDA: data-parallel over gloo on the CPU (accelerate's MULTI_CPU);
        # without cpu=True accelerate would start each process as an independent single-process run.
        cpu=world > 1 and not torch.cuda.is_available(),
        mixed_precision=t_cfg["mixed_precision"],
        gradient_accumulation_steps=t_cfg["gradient_accumulation_steps"],
        log_with=t_cfg["report_to"],
        project_config=ProjectConfiguration(
            project_dir=str(out),
            logging_dir=str(out / "logs"),
            automatic_checkpoint_naming=True,
            total_limit=t_cfg["checkpoints_total_limit"],
        ),
        kwargs_handlers=[DistributedDataParallelKwargs(find_unused_parameters=bool(t_cfg["find_unused_parameters"]))],
    )
    if accelerator.num_processes != world:
        raise RuntimeError(
            f"{world} processes were launched but accelerate set up {accelerator.num_processes}: they would train "
            "independently over the same output_dir. Check the accelerate config (finetune/accelerate/*.yaml)"
        )
    # Resume (or refuse to start over a run that has checkpoints, or to go back behind a later step):
    # checked before anything is written or loaded.
    max_steps = int(t_cfg["max_steps"])
    final_dir = Path(config["export"]["dir"]) if config["export"]["dir"] else out / "final"
    ckpt_root = out / "checkpoints"
    complete, incomplete = _checkpoints(ckpt_root)
    finished = _check_resume(out, final_dir, bool(t_cfg["resume"]), complete, max_steps)
    if finished is not None:
        accelerator.print(
            f"{out} holds a finished run: step {finished['steps']} = train.max_steps, final model in {final_dir}; "
            "nothing to resume (raise train.max_steps to train further)"
        )
        accelerator.end_training()
        return finished if accelerator.is_main_process else {}
    # A resume with settings that shape the trained parameters changed is refused here, by name.
    changes = _check_resume_config(out, complete[-1][1], config) if t_cfg["resume"] else {}
    if accelerator.is_main_process:
        out.mkdir(parents=True, exist_ok=True)
    set_seed(int(t_cfg["seed"]))  # model init (from scratch) and anything else seeded globally

    # Models, dtypes, data.
    parts = build_models(config)
    recipe, transformer = parts.recipe, parts.transformer
    if config["mhla"] is not None and not parts.mhla_applied:
        accelerator.print("the pretrained checkpoint already has MHLA: the mhla section is not applied again")
    weight_dtype = {"no": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}[t_cfg["mixed_precision"]]
    if weight_dtype == torch.float16 and accelerator.device.type == "cpu":
        # accelerate runs fp16 "mixed precision" on the CPU without autocast and without a GradScaler:
        # fp16 weights would meet fp32 activations. Keep fp32 there (bf16 autocast does work on the CPU).
        accelerator.print("mixed_precision=fp16 has no autocast on the CPU: weights stay fp32 (use bf16 on the CPU)")
        weight_dtype = torch.float32
    if t_cfg["gradient_checkpointing"]:
        transformer.enable_gradient_checkpointing()
    # Frozen weights are about to be cast down: the main process keeps their fp32 values (CPU) so that
    # the export (LoRA merged into them) is written at full precision, not from the bf16 / fp16 copies.
    frozen_fp32 = {}
    if weight_dtype != torch.float32 and accelerator.is_main_process:
        frozen_fp32 = {n: p.detach().to("cpu", copy=True) for n, p in transformer.named_parameters() if not p.requires_grad}
    prepare_parameter_dtypes(transformer, weight_dtype)  # frozen -> weight_dtype, trainable -> fp32 (C16)
    frozen = [parts.teacher, getattr(parts.pipeline, "text_encoder", None)]
    for module in [m for m in frozen if m is not None]:  # teacher, text encoder: in the weight dtype
        module.to(accelerator.device)
        if weight_dtype != torch.float32:
            prepare_parameter_dtypes(module, weight_dtype)
    parts.vae.to(accelerator.device)  # the autoencoder stays fp32 (as diffusers' SANA / SD3 recipes keep it)
    dataset = build_dataset(d_cfg)
    labels = getattr(dataset, "id2label", None)
    id2label = labels if labels else parts.id2label  # the training data defines the classes
    parts.id2label = id2label
    restore = recipe.prepare(parts, dataset, config)
    batch_size = int(d_cfg["batch_size"])
    cache_dir = Path(d_cfg["cache_dir"]) if d_cfg["cache_dir"] else out / "latent_cache"
    if d_cfg["cache"]:
        dataset = _cached_dataset(parts, dataset, cache_dir, accelerator, batch_size)
    sampler = DistributedSampler(
        dataset, num_replicas=accelerator.num_processes, rank=accelerator.process_index,
        shuffle=True, seed=int(d_cfg["seed"]), drop_last=True,
    )
    accum = int(t_cfg["gradient_accumulation_steps"])
    # An epoch = a whole number of optimizer steps (drop the remainder): keeps resume arithmetic exact.
    steps_per_epoch = len(sampler) // (batch_size * accum)
    if steps_per_epoch < 1:
        raise ValueError(
            f"the dataset has {len(dataset)} crops, fewer than one optimizer step of {batch_size} x {accum} "
            f"(batch_size x gradient_accumulation_steps) per process: raise data.crops_per_image or lower data.batch_size"
        )
    optimizer = build_optimizer(
        transformer, float(t_cfg["lr"]), mixing_lr=t_cfg["mixing_lr"],
        weight_decay=float(t_cfg["weight_decay"]), betas=(float(t_cfg["adam_beta1"]), float(t_cfg["adam_beta2"])),
        eps=float(t_cfg["adam_eps"]),
    )
    trainable_params = [p for p in transformer.parameters() if p.requires_grad]
    clip_groups = gradient_groups(transformer)  # clipped and logged one by one (clip_grad_norms_)
    # accelerate steps a prepared lr scheduler once per process per optimizer step.
    lr_scheduler = get_scheduler(
        t_cfg["lr_scheduler"], optimizer=optimizer,
        num_warmup_steps=int(t_cfg["warmup_steps"]) * accelerator.num_processes,
        num_training_steps=max_steps * accelerator.num_processes,
    )
    model, optimizer, lr_scheduler = accelerator.prepare(transformer, optimizer, lr_scheduler)
    # FSDP (untested here: it needs GPUs): parameters are sharded across processes, so the main
    # process alone can neither evaluate nor export the wrapped model; see the export below.
    fsdp = accelerator.distributed_type == DistributedType.FSDP
    ema = None
    e_cfg = config["ema"]
    if fsdp and e_cfg["enabled"]:
        raise ValueError("ema.enabled with FSDP is not supported (the EMA would track parameter shards): use DDP or set ema.enabled=false")
    if e_cfg["enabled"]:
        from diffusers.training_utils import EMAModel

        ema = EMAModel(trainable_params, decay=float(e_cfg["decay"]), update_after_step=int(e_cfg["update_after_step"]),
                       use_ema_warmup=bool(e_cfg["use_warmup"]))
        ema.to(accelerator.device)

    # Resume (checked above, see _check_resume).
    step, rows = 0, []
    accelerator.wait_for_everyone()
    if incomplete and accelerator.is_main_process:  # a run killed while saving: the folder is unusable
        for folder in incomplete:
            shutil.rmtree(folder, ignore_errors=True)
    accelerator.wait_for_everyone()
    if t_cfg["resume"]:
        step, folder = complete[-1]
        fresh = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
        try:
            accelerator.load_state(str(folder))
        except (RuntimeError, ValueError, KeyError) as err:
            changed = "; ".join(f"{k}: {a!r} -> {b!r}" for k, (a, b) in changes.items())
            raise ValueError(
                f"checkpoint {folder} does not fit the model built from this config ({type(err).__name__}: "
                f"{' '.join(str(err).split())[:300]}). The settings that shape the trained parameters (model, mhla, "
                f"train.trainable, train.train_mixing, lora) must be the run's own; "
                + (f"changed since the checkpoint: {changed}" if changed else "the checkpoint records no config to compare with")
                + ". Set them back to resume, or train into a new output_dir."
            ) from err
        applied = _apply_optimizer_settings(optimizer, lr_scheduler, fresh)
        if ema is not None:
            _load_ema(ema, folder)
        accelerator.project_configuration.iteration = int(folder.name.split("_")[-1]) + 1
        if (out / LOSS_CSV).is_file():
            rows = [r for r in _read_rows(out / LOSS_CSV) if r[0] <= step]
        if step == max_steps:  # e.g. a run killed while exporting: only the evaluation and export are left
            accelerator.print(f"resumed from {folder} at step {step} = train.max_steps: nothing left to train, exporting")
        else:
            accelerator.print(f"resumed from {folder} at step {step}")
        if changes:
            accelerator.print("settings changed since the checkpoint, in effect from here: "
                              + "; ".join(f"{k}: {a!r} -> {b!r}" for k, (a, b) in changes.items()))
        if applied:
            accelerator.print("the optimizer takes this config's settings, not the checkpoint's: " + "; ".join(applied))
    if accelerator.is_main_process:  # the settings this run trains with (after a resume: the applied ones)
        _atomic_write_bytes(out / "config.yaml", yaml.safe_dump(config, sort_keys=False).encode())
    if t_cfg["report_to"]:
        accelerator.init_trackers("mhla_finetune", config=_flat_config(config))

    # Held-out losses before training (for a converted checkpoint: the cost of the conversion).
    ev_cfg = config["eval"]
    eval_set = None
    if int(ev_cfg["samples"]) > 0:
        eval_set = build_dataset({**d_cfg, "seed": int(ev_cfg["seed"])})
        if d_cfg["cache"]:
            eval_set = _cached_dataset(parts, eval_set, cache_dir, accelerator, int(ev_cfg["batch_size"]))
    eval_kwargs = dict(num_samples=int(ev_cfg["samples"]), batch_size=int(ev_cfg["batch_size"]), seed=int(ev_cfg["seed"]), teacher=parts.teacher)
    eval_start: dict = {}
    if eval_set is not None and accelerator.is_main_process and step == 0 and not fsdp:
        with accelerator.autocast():
            eval_start = evaluate_heldout(parts, accelerator.unwrap_model(model), eval_set, **eval_kwargs)
        accelerator.print(f"held-out loss before training: {eval_start['loss']:.5f}")

    # Distillation hooks.
    weights = dict(data_weight=float(ds_cfg["data_weight"]) if parts.teacher is not None else 1.0,
                   output_weight=float(ds_cfg["output_weight"]), attention_weight=float(ds_cfg["attention_weight"]))
    recorders = None
    if weights["attention_weight"] > 0:
        student_modules = transfer_modules(transformer, ds_cfg["layers"])
        recorders = (AttentionRecorder(student_modules),
                     AttentionRecorder({n: parts.teacher.get_submodule(n) for n in student_modules}))
    num_classes = len(id2label) if id2label else None
    if ds_cfg["condition"] == "random" and not num_classes:
        num_classes = int(transformer.config.get("num_embeds_ada_norm") or 0) or None
        if num_classes is None:
            raise ValueError("distill.condition=random needs a class-conditional model")

    # The loop.
    num_params = sum(p.numel() for p in transformer.parameters())
    num_trainable = sum(p.numel() for p in trainable_params)
    progress = tqdm(total=max_steps, initial=step, desc="train", disable=not accelerator.is_local_main_process, dynamic_ncols=True)
    log_every = int(t_cfg["log_every"])
    grad_clip = t_cfg["grad_clip"]
    # Gradient norms are clipped per group (clip_grad_norms_), except where accelerate clips sharded or
    # engine-managed gradients itself: there the global norm is clipped (and logged as "all").
    per_group_clip = accelerator.distributed_type not in (DistributedType.FSDP, DistributedType.DEEPSPEED, DistributedType.XLA)
    if not per_group_clip:
        accelerator.print(f"{accelerator.distributed_type}: train.grad_clip clips the global gradient norm, not each parameter group's")
    dropout = recipe.dropout(config)
    seed = int(t_cfg["seed"])
    t_start, cpu_start = time.perf_counter(), time.process_time()
    steps_this_run = 0
    model.train()
    while step < max_steps:
        epoch, offset = divmod(step, steps_per_epoch)  # resume mid-epoch: skip the steps already taken
        if hasattr(dataset, "set_epoch"):
            dataset.set_epoch(epoch)
        sampler.set_epoch(epoch)
        per_step = batch_size * accum
        indices = list(sampler)[offset * per_step : steps_per_epoch * per_step]
        loader = DataLoader(dataset, batch_size=batch_size, sampler=indices, num_workers=int(d_cfg["num_workers"]), drop_last=True)
        micro, step_losses, step_terms = 0, [], []
        for batch in loader:
            batch = {k: v.to(accelerator.device, non_blocking=True) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
            g = torch.Generator(device=accelerator.device).manual_seed(_step_seed(seed, step, micro))
            with accelerator.accumulate(model):
                with accelerator.autocast():
                    loss, terms = training_loss(
                        parts, model, batch, generator=g, rank=accelerator.process_index, world_size=accelerator.num_processes,
                        dropout=dropout, condition=ds_cfg["condition"], recorders=recorders, num_classes=num_classes, **weights,
                    )
                if not torch.isfinite(loss):
                    raise ValueError(f"non-finite loss {loss.item()} at step {step + 1}; lower train.lr or use mixed_precision=no")
                accelerator.backward(loss)
                norms, skip = {}, False
                if accelerator.sync_gradients:
                    norms = _clip_gradients(accelerator, model, clip_groups, grad_clip, per_group_clip)
                    # A non-finite gradient is not applied (with fp16, the GradScaler skips the update itself).
                    skip = accelerator.scaler is None and not all(math.isfinite(v) for v in norms.values())
                if not skip:
                    optimizer.step()
                lr_scheduler.step()
                optimizer.zero_grad(set_to_none=True)
            step_losses.append(loss.detach().float())
            step_terms.append({k: v.detach().float() for k, v in terms.items()})
            micro += 1
            if not accelerator.sync_gradients:
                continue
            # One optimizer step done (or skipped: the weights keep their values, the EMA does not move).
            skipped = skip or accelerator.optimizer_step_was_skipped
            mixing_module.clamp_mixing_(transformer)  # MHLA paper Sec. 3.3: mixing coefficients kept in [0, 1]
            if ema is not None and not skipped:
                ema.step(trainable_params)
            step += 1
            steps_this_run += 1
            if skipped and accelerator.is_main_process:
                bad = ", ".join(k for k, v in norms.items() if not math.isfinite(v)) or "a parameter group"
                tqdm.write(f"step {step} skipped: non-finite gradient norm in {bad}"
                           + (" (the fp16 GradScaler lowers its scale)" if accelerator.scaler is not None else " (the weights keep their values)"))
            names = sorted(step_terms[0])
            local = torch.stack([torch.stack(step_losses).mean()] + [torch.stack([t[k] for t in step_terms]).mean() for k in names])
            reduced = accelerator.reduce(local, reduction="mean").tolist()
            mean_loss, term_values = reduced[0], dict(zip(names, reduced[1:]))
            lr_now = lr_scheduler.get_last_lr()[0]
            rows.append((step, mean_loss, lr_now, term_values, norms))
            if t_cfg["report_to"]:
                accelerator.log({"loss": mean_loss, "lr": lr_now, **{f"loss_{k}": v for k, v in term_values.items()},
                                 **{f"grad_norm/{k}": v for k, v in norms.items()}}, step=step)
            micro, step_losses, step_terms = 0, [], []
            progress.update(1)
            if step % log_every == 0 or step == max_steps:
                recent = [r[1] for r in rows[-log_every:]]
                progress.set_postfix(loss=f"{sum(recent) / len(recent):.4f}", lr=f"{rows[-1][2]:.2e}")
                if accelerator.is_main_process:
                    write_loss_csv(out / LOSS_CSV, rows)
            ckpt_every = int(t_cfg["checkpointing_steps"])
            if ckpt_every and step % ckpt_every == 0:
                accelerator.wait_for_everyone()
                if accelerator.is_main_process:
                    write_loss_csv(out / LOSS_CSV, rows)
                folder = Path(accelerator.save_state())
                if accelerator.is_main_process:
                    if ema is not None:
                        _save_ema(ema, folder)
                    # Written last: marks the checkpoint complete (resume ignores folders without it).
                    # with the config it was trained with: a resume compares its own against it
                    _atomic_write_json(folder / TRAIN_STATE, {"step": step, "epoch": epoch, "config": config})
                accelerator.wait_for_everyone()
            if step >= max_steps:
                break
    progress.close()
    wall, cpu = time.perf_counter() - t_start, time.process_time() - cpu_start

    # Evaluate and export.
    accelerator.wait_for_everyone()
    summary: dict[str, Any] = {}
    full_state = accelerator.get_state_dict(model) if fsdp else None  # a collective: every process takes part
    if accelerator.is_main_process:
        unwrapped = accelerator.unwrap_model(model)
        if fsdp:  # a fresh, unsharded copy of the model carrying the gathered weights
            fresh = build_models({**config, "distill": {**ds_cfg, "teacher": None}})
            unwrapped = fresh.transformer
            unwrapped.load_state_dict(full_state)
            unwrapped.to(accelerator.device)
            restore = [(m, attr, v) for m, attr, v in restore if m in set(unwrapped.modules())]
        for module, attribute, value in restore:
            setattr(module, attribute, value)
        unwrapped.eval()
        if ema is not None and e_cfg["export"]:
            ema.copy_to(trainable_params)
        if frozen_fp32:  # the frozen weights back at full precision for evaluation and export
            for name, p in unwrapped.named_parameters():
                if name in frozen_fp32:
                    p.data = frozen_fp32[name].to(p.device)
        eval_end: dict = {}
        if eval_set is not None:
            with accelerator.autocast():
                eval_end = evaluate_heldout(parts, unwrapped, eval_set, **eval_kwargs)
        export_model(parts, unwrapped, final_dir, sampler=config["export"]["sampler"], id2label=id2label,
                     lora_export=config["lora"]["export"])
        write_loss_csv(out / LOSS_CSV, rows)
        if rows:
            try:
                curves = {Path(out).name: ([r[0] for r in rows], [r[1] for r in rows])}
                if any(len(r[3]) > 1 for r in rows):
                    for name, (steps_, values) in read_loss_terms(out / LOSS_CSV).items():
                        curves[f"{name} term"] = (steps_, values)
                plot_loss_curves(curves, out / LOSS_PNG)
            except ImportError:
                accelerator.print(f"matplotlib is not installed: {LOSS_PNG} skipped (pip install matplotlib)")
        recent = [r[1] for r in rows[-log_every:]]
        mixing = mixing_parameters(unwrapped)
        summary = {
            "final_dir": str(final_dir),
            "steps": step,
            "final_loss": sum(recent) / len(recent) if recent else math.nan,
            "wall_time_s": round(wall, 2),
            "step_time_s": round(wall / steps_this_run, 4) if steps_this_run else None,
            # CPU seconds of this process per step: robust to other processes sharing the cores.
            "step_cpu_time_s": round(cpu / steps_this_run, 4) if steps_this_run else None,
            "num_parameters": num_params,
            "num_trainable_parameters": num_trainable,
            "family": parts.family,
            "objective": parts.objective.kind,
            "trainable": t_cfg["trainable"],
            "mhla": is_mhla_model(unwrapped),
            "mhla_layers": len(mixing),
            "mixing_range": [min(float(p.detach().min()) for p in mixing), max(float(p.detach().max()) for p in mixing)] if mixing else None,
            "batch_size": batch_size * accelerator.num_processes * accum,
            # steps whose update was not applied (a non-finite gradient norm; see loss.csv's grad_norm_* columns)
            "skipped_steps": [r[0] for r in rows if len(r) > 4 and any(not math.isfinite(v) for v in r[4].values())],
            "eval_loss_start": eval_start.get("loss"),  # None when eval.samples = 0 or when resumed
            "eval_loss": eval_end.get("loss"),
            "eval_distill_start": eval_start.get("distill_output"),
            "eval_distill": eval_end.get("distill_output"),
        }
        _atomic_write_json(out / SUMMARY, summary)
    accelerator.wait_for_everyone()
    accelerator.end_training()
    return summary
