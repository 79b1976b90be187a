"""The training config: :data:`DEFAULT_CONFIG` (every key, with its default), YAML loading,
``key.path=value`` overrides and validation.

Validation is a table (:data:`_RULES`: one typed rule per checked key: a choice, an integer bound
or a number range) plus a few checks that tie keys together (:func:`validate_config`). Every error
names the key and what to do.
"""

from __future__ import annotations

import copy
import importlib.util
import math
import os
from pathlib import Path
from typing import Any, Iterable, Mapping

import yaml

from mhla_diffusers.families import FAMILIES
from mhla_diffusers.models.spec import GATE_FORMS, LEPE_INITS, ROPE_MODES, check_mixing_init
from mhla_diffusers.training.config_rules import Boolean, Choice, Integer, Number
from mhla_diffusers.training.context import check_context_section
from mhla_diffusers.training.distill import CONDITIONS, TRANSFER_LAYERS
from mhla_diffusers.training.flow import LOSS_WEIGHTING, OBJECTIVES, TIMESTEP_SAMPLING

__all__ = [
    "DEFAULT_CONFIG", "TRAINABLE_SETS", "TRAINED_FAMILIES", "default_family", "load_config", "apply_overrides", "validate_config",
]

# The families with a training recipe (Family.training; mhla_diffusers.training.recipes.RECIPES has one for each).
TRAINED_FAMILIES = tuple(name for name, family in FAMILIES.items() if family.training is not None)
# Those whose recipe builds a model from model.init (DiT) / continues one at another model.sample_size (DiT).
_FROM_SCRATCH = [f for f in FAMILIES.values() if f.training is not None and f.training.from_scratch]
_RESIZABLE = [f for f in FAMILIES.values() if f.training is not None and f.training.resizable]


def default_family() -> str:
    """The family of a config that names none and whose ``model.pretrained`` tells none: the first that trains
    from scratch (``"dit"``)."""
    return _FROM_SCRATCH[0].name


def _names(families, attr: str = "title") -> str:
    return " / ".join(getattr(f, attr) for f in families)
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
        # DiT with `pretrained` only: continue at another latent size (progressive resolution; the
        # sincos positional embedding is recomputed, no weight changes). null: the checkpoint's.
        "sample_size": None,
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
        # Wan 2.2 A14B (two experts): which one to fine-tune, transformer (high noise: timesteps >=
        # boundary_ratio * 1000) | transformer_2 (low noise: below); timesteps are drawn in that expert's range.
        # null: transformer (pipelines with one transformer); a two-expert pipeline must name one.
        "expert": None,
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
        "alpha": None,  # > 0; null: rank (scale 1)
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
        # | teacher (no data: the teacher's own samples, distill.teacher; the teacher section below)
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
        "num_workers": 0,  # DataLoader workers (0: load in the main process)
        "caption_column": "text",  # kind=captions: the metadata.jsonl key of the caption
        "missing_caption": "error",  # kind=captions: error | empty
        "caption_template": "{}",  # text families on class-labelled data: caption = template.format(class name)
        "cache": False,  # encode latents (and text embeddings) once, to disk (fixes each index's crop)
        "cache_dir": None,  # null: output_dir/latent_cache
        # kind=teacher: the store of the teacher's samples (docs/training.md, "Data-free retrofit")
        "teacher": {
            "samples": 64,  # trajectories (the store holds whole shards: a multiple of shard_size)
            "steps": None,  # sampler steps K (a trajectory gives K training pairs); null: the pipeline's default
            "pairs_per_trajectory": None,  # steps stored per trajectory, evenly spaced (null: all K; videos: keep the store small)
            "guidance_scale": None,  # classifier-free guidance; null: the pipeline's default
            "prompts": None,  # text families: a text file, one prompt per line; null: the list shipped with the package
            "classes": None,  # class families: the class ids drawn in turn; null: the model's labelled classes
            "seed": 0,  # initial noise and the order of conditions
            "shard_size": 8,  # trajectories per shard (one sampler batch)
            "store_dir": None,  # null: output_dir/teacher_store
            "use": "auto",  # pairs (stored noisy latents + teacher predictions) | samples (clean latents) | auto: pairs iff data_weight = 0
        },
    },
    "train": {
        "max_steps": 1000,  # optimizer steps
        "trainable": "full",  # full | lora | attention (self-attention modules) | mixing (MHLA parameters only)
        "train_mixing": True,  # the MHLA parameters (mixing matrices, Wan output norms) train, whatever the set
        "lr": 1e-4,
        "mixing_lr": None,  # lr of the MHLA mixing matrices, > 0 (null: lr; to freeze them, train_mixing: false)
        "weight_decay": 0.0,  # >= 0; not applied to the mixing matrices
        "adam_beta1": 0.9,
        "adam_beta2": 0.999,
        "adam_eps": 1e-8,
        "lr_scheduler": "constant_with_warmup",  # any name of diffusers.optimization.get_scheduler
        "warmup_steps": 0,  # learning-rate warm-up steps (0: none)
        "grad_clip": 1.0,  # max gradient norm of each parameter group (model, lora, mhla_mixing), clipped one by one; 0 / null: off
        "mixed_precision": "no",  # no | fp16 | bf16 (autocast; trainable parameters stay fp32)
        "gradient_accumulation_steps": 1,
        "gradient_checkpointing": False,
        "class_dropout": 0.1,  # label -> null class (classifier-free guidance; DiT)
        "caption_dropout": 0.1,  # caption -> "" (classifier-free guidance; text families)
        "checkpointing_steps": 0,  # accelerate save_state every N steps (0: never)
        "checkpoints_total_limit": 2,  # complete checkpoints kept, >= 1 (null: all)
        "resume": False,  # resume from the latest complete state in output_dir/checkpoints
        "seed": 0,  # model init, noise, timesteps, label dropout
        "log_every": 10,  # tqdm postfix and loss CSV flush, in steps
        "report_to": None,  # null | tensorboard (needs the tensorboard package)
        "find_unused_parameters": False,  # DDP
    },
    "eval": {
        "samples": 0,  # > 0: held-out losses on this many fixed crops, before and after training; 0: none
        # null: held-out items of the training data (kind=teacher: a held-out store of eval.seed). A mapping:
        # data keys for the held-out set, over the data section (e.g. {kind: photos} for a data-free run)
        "data": None,
        "seed": 12345,  # crops, noise; timesteps evenly spaced
        "batch_size": 16,
    },
    "parallel": {
        # null: each process trains its own samples (data parallel). {ring_degree: P} or {ulysses_degree: P}: P processes
        # share each sample's tokens (context parallelism; Wan, DiT; + ring_anything / ulysses_anything: uneven shards)
        "context": None,
    },
    "export": {
        "sampler": "dpm",  # DiT: dpm | ddim | ddpm : the scheduler of the exported pipeline (SANA keeps its own)
        "dir": None,  # the final pipeline folder (null: output_dir/final; else a path as given)
    },
}
_FREE_SECTIONS = {("model", "init"), ("model", "vae"), ("model", "noise_scheduler"), ("mhla",), ("eval", "data"), ("parallel", "context")}
_MHLA_KEYS = {
    "layers", "num_blocks", "block_grid", "normalize", "eps", "backend", "init", "output_norm", "feature_eps", "mixing_clamp",
    "feature_power", "rope", "gate", "lepe", "lepe_init",
}


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
        ValueError: malformed override (a YAML syntax error in the value included) or unknown key.
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
        node[parts[-1]] = _parse_yaml(raw, f"override {item!r}", "quote or fix the value", at_mark=False) if raw.strip() else None
        config = _merge(DEFAULT_CONFIG, config)  # rejects unknown keys
    return config


def _parse_yaml(text: str, where: str, fix: str, *, at_mark: bool = True) -> Any:
    """``yaml.safe_load(text)`` (``""``: None); a syntax error becomes one line: ``where:line:column: not valid YAML (problem); fix``
    (``where: ...`` without ``at_mark``).

    Raises:
        ValueError: ``text`` is not valid YAML (line and column counted from 1).
    """
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as err:
        mark = (getattr(err, "problem_mark", None) or getattr(err, "context_mark", None)) if at_mark else None
        at = f":{mark.line + 1}:{mark.column + 1}" if mark is not None else ""
        problem = " ".join(str(getattr(err, "problem", None) or err).split())
        raise ValueError(f"{where}{at}: not valid YAML ({problem}); {fix}") from None


def load_config(path: str | os.PathLike | None = None, overrides: Iterable[str] = ()) -> dict:
    """Defaults (:data:`DEFAULT_CONFIG`) <- the YAML file at ``path`` <- ``overrides``; validated.

    Returns:
        The complete config dict (every key present).

    Raises:
        FileNotFoundError: ``path`` does not exist.
        ValueError: a YAML syntax error (one line naming the file, line and column), unknown keys, a missing
            ``output_dir``, neither or both of ``model.pretrained`` and ``model.init``, bad values (the message
            names the key and what to do; negative, boolean, NaN or infinite numbers where they mean nothing).
    """
    config = copy.deepcopy(DEFAULT_CONFIG)
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"config file {path} does not exist")
        loaded = _parse_yaml(path.read_text(), str(path), "fix the file") or {}
        if not isinstance(loaded, Mapping):
            raise ValueError(
                f"{path} must hold a YAML mapping "
                "(sections model, mhla, objective, distill, lora, ema, data, train, eval, export; output_dir)"
            )
        config = _merge(config, loaded)
    config = apply_overrides(config, overrides)
    validate_config(config)
    return config



# -- validation: one typed rule per checked key ---------------------------------------------------
_ANY = Number()
_POSITIVE = Number(lambda v: v > 0, "a finite number > 0")
_NON_NEGATIVE = Number(lambda v: v >= 0, "a finite number >= 0")
_PROBABILITY = Number(lambda v: 0.0 <= v < 1.0, "a finite number in [0, 1)")
_SEED = Integer(0)
# SD3's mode density is a density (u stays in [0, 1]) for -1 <= mode_scale <= 2 / (pi - 2)
_MODE_SCALE_MAX = 2.0 / (math.pi - 2.0)

# Checked in this order by validate_config; a rule's check may normalise the value (numbers to float,
# YAML booleans back to the choice written).
_RULES: dict[str, Choice | Integer | Number | Boolean] = {
    "model.expert": Choice(("transformer", "transformer_2"), nullable=True),
    "data.kind": Choice(("photos", "folder", "captions", "video", "teacher")),
    "data.teacher.samples": Integer(1),
    "data.teacher.steps": Integer(1, nullable=True, note="null: the pipeline's default"),
    "data.teacher.guidance_scale": Number(lambda v: v >= 0, "a finite number >= 0", nullable=True, note="null: the pipeline's default"),
    "data.teacher.seed": _SEED,
    "data.teacher.pairs_per_trajectory": Integer(1, nullable=True, note="null: every step"),
    "data.teacher.shard_size": Integer(1),
    "data.teacher.use": Choice(("auto", "pairs", "samples")),
    "data.missing_caption": Choice(("error", "empty")),
    "data.short_side": Integer(1, nullable=True, note="null: the dataset's default"),
    "data.crops_per_image": Integer(1),
    "data.num_frames": Integer(1),
    "data.frame_stride": Integer(1),
    "data.seed": _SEED,
    "data.batch_size": Integer(1),
    "data.num_workers": Integer(0, note="0: load in the main process"),
    "train.max_steps": Integer(1),
    "train.gradient_accumulation_steps": Integer(1),
    "train.log_every": Integer(1),
    "train.seed": _SEED,
    "lora.rank": Integer(1),
    "model.text.max_sequence_length": Integer(1, nullable=True),
    "model.sample_size": Integer(1, nullable=True),
    "train.warmup_steps": Integer(0, note="0: no warm-up"),
    "train.checkpointing_steps": Integer(0, note="0: never"),
    "train.checkpoints_total_limit": Integer(1, nullable=True, note="null: keep every checkpoint"),
    "ema.update_after_step": Integer(0),
    "eval.samples": Integer(0, note="0: no held-out evaluation"),
    "eval.seed": _SEED,
    "eval.batch_size": Integer(1),
    "train.lr": _POSITIVE,
    "train.mixing_lr": Number(
        lambda v: v > 0, "a finite number > 0", nullable=True,
        note="null: train.lr; to freeze the mixing matrices set train.train_mixing: false",
    ),
    "train.weight_decay": _NON_NEGATIVE,
    "train.adam_beta1": _PROBABILITY,
    "train.adam_beta2": _PROBABILITY,
    "train.adam_eps": _POSITIVE,
    "train.grad_clip": Number(lambda v: v >= 0, "a finite number >= 0", nullable=True, note="0 or null: no clipping"),
    "train.class_dropout": _PROBABILITY,
    "train.caption_dropout": _PROBABILITY,
    "train.mixed_precision": Choice(("no", "fp16", "bf16")),
    "train.trainable": Choice(TRAINABLE_SETS),
    "train.report_to": Choice(("tensorboard",), nullable=True),
    "export.sampler": Choice(("dpm", "ddim", "ddpm")),
    "objective.kind": Choice(OBJECTIVES, nullable=True),
    "objective.timestep_sampling": Choice(TIMESTEP_SAMPLING),
    "objective.loss_weighting": Choice(LOSS_WEIGHTING),
    "objective.shift": Number(lambda v: v > 0, "a finite number > 0", nullable=True),
    "objective.logit_mean": _ANY,
    "objective.logit_std": _POSITIVE,
    "objective.mode_scale": Number(
        lambda v: -1.0 <= v <= _MODE_SCALE_MAX, "a finite number in [-1, 1.75]", note="SD3's mode density: 2 / (pi - 2) at most; 0: uniform"
    ),
    "distill.condition": Choice(CONDITIONS),
    "distill.layers": Choice(TRANSFER_LAYERS),
    "distill.data_weight": _NON_NEGATIVE,
    "distill.output_weight": _NON_NEGATIVE,
    "distill.attention_weight": _NON_NEGATIVE,
    "lora.export": Choice(("merge", "separate")),
    "lora.alpha": Number(lambda v: v > 0, "a finite number > 0", nullable=True, note="null: the rank, a scale of 1"),
    "lora.dropout": _PROBABILITY,
    "ema.decay": Number(lambda v: 0.0 < v < 1.0, "a finite number in (0, 1)"),
}

# Rules of the optional keys of the ``mhla`` section (apply_mhla's arguments), checked when present.
_MHLA_RULES: dict[str, Choice | Integer | Number | Boolean] = {
    # phi = ReLU(x) + feature_eps (the authors' Wan model: 1e-6); 0 = the paper's ReLU
    "feature_eps": _NON_NEGATIVE,
    # the mixing matrices used clamped to [0, 1] (the paper) or as stored (false: the authors' Wan model)
    "mixing_clamp": Boolean(),
    # phi = ReLU(x) ** feature_power (1: ReLU)
    "feature_power": _POSITIVE,
    # families with RoPE (Wan): after the feature map (default) | before it | none; null: the family's
    "rope": Choice(ROPE_MODES, nullable=True),
    # a LePE depthwise convolution on the values, and its start
    "lepe": Boolean(),
    "lepe_init": Choice(LEPE_INITS),
}


def validate_config(config: dict) -> None:
    """Check a merged config in place (numeric strings become floats, YAML booleans the choice written).

    Raises:
        ValueError: naming the offending key and what to do.
    """
    if not config.get("output_dir"):
        raise ValueError("output_dir is not set: add `output_dir: <folder>` to the YAML or pass --set output_dir=<folder>")
    _check_model(config["model"])
    _check_mhla(config["mhla"])
    for name, rule in _RULES.items():
        *path, key = name.split(".")
        section = config
        for part in path:
            section = section[part]
        section[key] = rule.check(name, section[key])
    _check_data(config["data"])
    if config["train"]["report_to"] == "tensorboard" and importlib.util.find_spec("tensorboard") is None:
        raise ValueError("train.report_to=tensorboard needs the tensorboard package: pip install tensorboard (or set report_to: null)")
    _check_distill(config["distill"])
    _check_teacher_run(config)
    _check_parallel(config)
    if config["model"]["expert"] == "transformer_2" and config["train"]["trainable"] == "lora" and config["lora"]["export"] == "separate":
        raise ValueError(
            "lora.export=separate writes the adapter as transformer_lora/, which loads onto the first expert: with "
            "model.expert=transformer_2 use lora.export=merge"
        )
    targets = config["lora"]["target_modules"]
    if not isinstance(targets, list) or not targets or not all(isinstance(s, str) for s in targets):
        raise ValueError(f"lora.target_modules must be a non-empty list of module-name suffixes; got {targets!r}")


def _check_model(m: Mapping) -> None:
    """``model``: exactly one of pretrained / init, a family with a recipe, the text options."""
    scratch_class = " / ".join(f.model_classes[0] for f in _FROM_SCRATCH)
    if (m["pretrained"] is None) == (m["init"] is None):
        raise ValueError(
            "set exactly one of model.pretrained (a pipeline folder) and model.init "
            f"(a {scratch_class} config dict to train from scratch)"
        )
    if m["init"] is not None and not isinstance(m["init"], Mapping):
        raise ValueError(f"model.init must be a mapping of {scratch_class} arguments; got {m['init']!r}")
    if m["family"] is not None and m["family"] not in TRAINED_FAMILIES:
        known = sorted(FAMILIES)
        raise ValueError(f"model.family must be one of {sorted(TRAINED_FAMILIES)} (MHLA knows {known}) or null; got {m['family']!r}")
    if m["init"] is not None and m["family"] not in (None, *(f.name for f in _FROM_SCRATCH)):
        raise ValueError(
            f"model.init (training from scratch) is supported for {_names(_FROM_SCRATCH)} only; family {m['family']!r} needs "
            "model.pretrained"
        )
    if m["sample_size"] is not None and (m["pretrained"] is None or m["family"] not in (None, *(f.name for f in _RESIZABLE))):
        raise ValueError(
            f"model.sample_size (continue a pretrained {_names(_RESIZABLE)} at another latent size) needs model.pretrained and "
            f"the {_names(_RESIZABLE, 'name')} family; for model.init set init.sample_size instead (got sample_size={m['sample_size']!r})"
        )
    chi = m["text"]["complex_human_instruction"]
    if not (chi is None or chi == "default" or (isinstance(chi, list) and all(isinstance(s, str) for s in chi))):
        raise ValueError(f"model.text.complex_human_instruction must be 'default', null or a list of strings; got {chi!r}")


def _check_mhla(mh: Any) -> None:
    """``mhla``: null or a mapping of :func:`mhla_diffusers.apply_mhla` arguments."""
    if mh is None:
        return
    if not isinstance(mh, Mapping):
        raise ValueError(f"mhla must be null or a mapping with keys {sorted(_MHLA_KEYS)}; got {mh!r}")
    unknown = set(mh) - _MHLA_KEYS
    if unknown:
        raise ValueError(f"unknown mhla keys {sorted(unknown)}; valid: {sorted(_MHLA_KEYS)}")
    for key, rule in _MHLA_RULES.items():
        if key in mh:
            mh[key] = rule.check(f"mhla.{key}", mh[key])
    gate = mh.get("gate")
    if not (gate is None or isinstance(gate, bool) or (isinstance(gate, str) and gate in GATE_FORMS)):
        raise ValueError(
            f"mhla.gate must be one of {list(GATE_FORMS)}, true ('neutral'), false or null (no gate); got {mh['gate']!r}"
        )
    if "init" in mh:
        try:
            check_mixing_init(mh["init"])
        except ValueError as err:
            raise ValueError(f"mhla.init: {err}") from None
    if mh.get("layers") == "auto":
        raise ValueError(
            "mhla.layers=auto is not available in the trainer (the selection needs calibration inputs and keep_softmax / "
            "an attention budget): convert first with conversion/convert.py --layers auto --keep-softmax K (or "
            "--attention-budget F) and fine-tune the converted folder (model.pretrained)"
        )


def _check_data(d: Mapping) -> None:
    """``data``: a root for folder kinds, the caption template, the crop size (``[h, w]`` for videos)."""
    if d["kind"] in ("folder", "captions", "video") and not d["root"]:
        raise ValueError(f"data.kind={d['kind']} needs data.root (the image folder)")
    if not isinstance(d["caption_template"], str) or "{}" not in d["caption_template"]:
        raise ValueError(f"data.caption_template must be a string containing {{}}; got {d['caption_template']!r}")
    _check_teacher(d)
    r = d["resolution"]
    if d["kind"] in ("video", "teacher"):  # a teacher store of a text family samples at [height, width] too
        if not (_is_positive_int(r) or (isinstance(r, list) and len(r) == 2 and all(_is_positive_int(x) for x in r))):
            raise ValueError(
                f"data.resolution must be a positive integer or [height, width] of them for videos and teacher stores (pixels); got {r!r}"
            )
    elif not _is_positive_int(r):
        raise ValueError(f"data.resolution must be a positive integer (pixels: square crops of images); got {r!r}")


def _check_teacher_run(config: Mapping) -> None:
    """``data.kind=teacher`` needs the teacher; its pairs train output matching on their own conditions; ``eval.data``."""
    d, ds, ev = config["data"], config["distill"], config["eval"]
    if ev["data"] is not None:
        if not isinstance(ev["data"], Mapping) or set(ev["data"]) - set(d):
            raise ValueError(f"eval.data must be null or a mapping of data keys ({sorted(d)}); got {ev['data']!r}")
        held = {**d, **ev["data"]}
        for name, rule in _RULES.items():
            if name.count(".") == 1 and name.startswith("data.") and name[5:] in ev["data"]:
                held[name[5:]] = ev["data"][name[5:]] = rule.check(f"eval.{name}", held[name[5:]])
        if held["kind"] == "teacher":
            raise ValueError("eval.data.kind=teacher: leave eval.data null for held-out samples of the teacher (a store of eval.seed)")
        _check_data(held)
    if d["kind"] != "teacher":
        return
    if ds["teacher"] is None:
        raise ValueError(
            "data.kind=teacher samples from the original model: set distill.teacher (original or the original pipeline folder)"
        )
    pairs = d["teacher"]["use"] == "pairs" or (d["teacher"]["use"] == "auto" and ds["data_weight"] == 0)
    if pairs and (ds["data_weight"] > 0 or ds["condition"] == "random"):
        raise ValueError(
            "data.teacher.use=pairs trains output matching on the stored conditions: set distill.data_weight=0 and "
            "distill.condition to dataset or null (or data.teacher.use=samples for the data loss)"
        )


def _check_teacher(d: Mapping) -> None:
    """``data.teacher``: class ids, a prompts path; no latent cache over a store (it holds latents already)."""
    t = d["teacher"]
    classes = t["classes"]
    if classes is not None and not (isinstance(classes, list) and classes and all(_is_int(c) and c >= 0 for c in classes)):
        raise ValueError(f"data.teacher.classes must be null or a non-empty list of class ids >= 0; got {t['classes']!r}")
    for key in ("prompts", "store_dir"):
        if t[key] is not None and not isinstance(t[key], str):
            raise ValueError(f"data.teacher.{key} must be null or a path; got {t[key]!r}")
    if d["kind"] == "teacher" and d["cache"]:
        raise ValueError("data.cache with data.kind=teacher: the teacher store already holds latents; set data.cache=false")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_positive_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def _check_parallel(config: Mapping) -> None:
    """``parallel.context``: a section diffusers accepts; attention transfer refused under it."""
    context = config["parallel"]["context"]
    check_context_section(context)
    if context is not None and config["distill"]["attention_weight"]:
        raise ValueError(
            "distill.attention_weight > 0 under parallel.context: attention transfer compares each layer's whole output "
            "with the teacher's, and a rank holds only its share of the tokens. Set distill.attention_weight: 0 (the data "
            "loss and output matching run under context parallelism) or parallel.context: null"
        )


def _check_distill(ds: Mapping) -> None:
    """``distill``: the loss weights against the teacher (none: the data loss alone)."""
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
