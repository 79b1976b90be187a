"""What differs per model family: a recipe class each (:class:`DiTRecipe`, :class:`SanaRecipe`,
:class:`WanRecipe`), and :func:`build_models`, which loads them into :class:`TrainingParts`.

See ``docs/training.md``, "Recipes".
"""

from __future__ import annotations

import abc
import inspect
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Sequence

import torch
from diffusers import DDPMScheduler, DiTTransformer2DModel
from diffusers.models.embeddings import LabelEmbedding

from mhla_diffusers.autoencoder import SpaceToDepthAutoencoder, vae_scale_factor
from mhla_diffusers.checkpoint.format import (
    expert_timestep_range,
    load_mhla_pipeline,
    pipeline_transformers,
    save_mhla_pipeline,
    transformer_folder,
)
from mhla_diffusers.models.families import FAMILIES
from mhla_diffusers.models.install import apply_mhla, is_mhla_model
from mhla_diffusers.training.config import TRAINED_FAMILIES
from mhla_diffusers.training.distill import load_teacher, make_teacher
from mhla_diffusers.training.export import export_pipeline
from mhla_diffusers.training.flow import Objective, flow_match_scheduler
from mhla_diffusers.training.optim import set_trainable

__all__ = [
    "TrainingParts", "DiTRecipe", "SanaRecipe", "WanRecipe", "RECIPES", "get_recipe", "resolve_family", "build_models",
    "check_resolution", "vae_scale_factor", "disable_internal_label_dropout", "select_expert", "posterior_sample",
]


def resolve_family(config: dict) -> str:
    """The config's model family: ``model.family``, else ``model.pretrained``'s transformer class, else ``"dit"``.

    ``ValueError`` for a transformer class without a recipe, or one contradicting ``model.family``.
    """
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
    """Everything :func:`train` builds besides the optimizer.

    ``transformer`` is trained (fp32, train mode); ``vae``, ``teacher`` and the ``pipeline``'s encoders
    are frozen; ``noise_scheduler`` is DiT's ``DDPMScheduler`` or the flow sigma table; ``expert`` is
    the pipeline component trained (Wan 2.2 A14B: ``"transformer"`` or ``"transformer_2"``).
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
    expert: str = "transformer"

    @property
    def recipe(self) -> "_Recipe":
        return get_recipe(self.family)


def posterior_sample(latent_dist, generator: torch.Generator | None = None, *, rank: int = 0, world_size: int = 1) -> torch.Tensor:
    """A VAE posterior sample ``[B, ...]`` whose noise is drawn for the global batch and sliced for ``rank``.

    The same global batch gets the same latents whatever ``world_size``; one process: exactly
    ``latent_dist.sample(generator)``. Non-Gaussian posteriors sample as they do.
    """
    from diffusers.models.autoencoders.vae import DiagonalGaussianDistribution

    if world_size == 1 or not isinstance(latent_dist, DiagonalGaussianDistribution):
        return latent_dist.sample(generator=generator)
    mean = latent_dist.mean
    b = mean.shape[0]
    noise = torch.randn((b * world_size,) + tuple(mean.shape[1:]), generator=generator, device=mean.device, dtype=mean.dtype)
    return mean + latent_dist.std * noise[torch.arange(b, device=mean.device) * world_size + rank]


def _encode_latents(vae, pixels: torch.Tensor, generator: torch.Generator | None = None, *, rank: int = 0,
                    world_size: int = 1) -> torch.Tensor:
    out = vae.encode(pixels.to(vae.dtype))
    if hasattr(out, "latent_dist"):
        z = posterior_sample(out.latent_dist, generator, rank=rank, world_size=world_size)
    elif hasattr(out, "latent"):
        z = out.latent
    else:
        z = out[0]
    return z.float() * vae.config.scaling_factor


class _Recipe(abc.ABC):
    """The per-family part of training."""

    family = ""
    objective = ""
    text_conditioned = False

    @abc.abstractmethod
    def load(self, config: dict) -> TrainingParts:
        """Load the models named by ``config`` (MHLA installed as configured)."""

    def dropout(self, config: dict) -> float:
        return float(config["train"]["caption_dropout" if self.text_conditioned else "class_dropout"])

    def prepare(self, parts: TrainingParts, dataset, config: dict) -> list:
        """Check the data against the model; returns ``[(module, attribute, value)]`` to restore before export."""
        return []

    def latents(self, parts: TrainingParts, batch: Mapping, generator: torch.Generator | None = None, *, rank: int = 0,
                world_size: int = 1) -> torch.Tensor:
        """A batch's clean latents: cached ``latents``, or the frozen vae on ``pixel_values``."""
        if "latents" in batch:
            return batch["latents"].float()
        with torch.no_grad():
            return _encode_latents(parts.vae, batch["pixel_values"], generator, rank=rank, world_size=world_size)

    @abc.abstractmethod
    def condition(self, parts, batch, drop, mode="dataset", random_labels=None) -> dict:
        """The transformer's conditioning kwargs for ``batch``; ``drop`` ``[B]`` bool marks dropped conditions."""

    @abc.abstractmethod
    def predict(self, model, noisy, timesteps, cond) -> torch.Tensor:
        """The model's prediction (epsilon or velocity) for ``noisy`` at ``timesteps``."""

    @abc.abstractmethod
    def cache_encode(self, parts: TrainingParts, batch: Mapping, device) -> dict:
        """What a latent cache stores for ``batch``."""

    def encoders(self, parts: TrainingParts) -> list:
        return [parts.vae]

    @abc.abstractmethod
    def write(self, model, parts: TrainingParts, out_dir: Path, *, sampler: str, id2label) -> None:
        """Write the trained model as a ready pipeline (converted-checkpoint format) into ``out_dir``."""


class DiTRecipe(_Recipe):
    """Class-conditional DiT: DDPM epsilon prediction, label dropout to the null class, DPM / DDIM / DDPM export."""

    family = "dit"
    objective = "epsilon"

    def load(self, config: dict) -> TrainingParts:
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
        if m.get("sample_size") is not None:
            transformer = resize_dit(transformer, int(m["sample_size"]))
        if getattr(noise_scheduler.config, "prediction_type", "epsilon") != "epsilon":
            raise ValueError(f"only epsilon prediction is supported; the scheduler says {noise_scheduler.config.prediction_type!r}")
        if transformer.config.get("num_embeds_ada_norm") is None:
            raise ValueError("the transformer must be class-conditional (num_embeds_ada_norm set; DiTPipeline needs 1000)")
        return TrainingParts(
            family=self.family, transformer=transformer, vae=vae, noise_scheduler=noise_scheduler,
            objective=Objective("epsilon", noise_scheduler), id2label=id2label,
        )

    def prepare(self, parts, dataset, config):
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
        return {"latents": _encode_latents(parts.vae, batch["pixel_values"].to(device)), "class_labels": batch["class_labels"]}

    def write(self, model, parts, out_dir, *, sampler, id2label):
        export_pipeline(model, parts.vae, parts.noise_scheduler, out_dir, sampler=sampler, id2label=id2label, overwrite=True)


def select_expert(pipe, expert: str | None, where="the pipeline") -> tuple[str, tuple[float, float] | None]:
    """``(component name, timestep range)`` of the transformer to fine-tune in ``pipe``.

    Wan 2.2 A14B: ``transformer`` for ``t >= boundary_ratio * T``, ``transformer_2`` below (as
    ``WanPipeline`` switches them). One transformer: range ``None``.

    Raises:
        ValueError: a two-expert pipeline without ``expert``, or an ``expert`` it does not have.
    """
    present = pipeline_transformers(pipe)
    boundary_ratio = getattr(pipe, "config", {}).get("boundary_ratio")
    if expert is None:
        if len(present) > 1:
            raise ValueError(
                f"{where} has two experts (transformer: timesteps >= {boundary_ratio} x 1000, transformer_2: below): "
                "set model.expert to transformer or transformer_2"
            )
        expert = next(iter(present), "transformer")
    if expert not in present:
        raise ValueError(f"model.expert={expert}: {where} has no {expert} (it has {sorted(present) or 'none'})")
    return expert, expert_timestep_range(pipe, expert)


def _expert_folder(path, expert: str):
    path = Path(path)
    if expert == "transformer" or not (path / "model_index.json").is_file():
        return path
    if not (path / expert / "config.json").is_file():
        raise FileNotFoundError(f"distill.teacher {path} has no {expert} (model.expert): give a pipeline with both experts")
    return path / expert


def _call_default(pipe, name: str):
    param = inspect.signature(type(pipe).__call__).parameters.get(name)
    return None if param is None or param.default is inspect.Parameter.empty else param.default


class _TextRecipe(_Recipe):
    """Shared by the text-conditioned flow-matching families (SANA, Wan)."""

    objective = "flow"
    text_conditioned = True
    transformer_class = ""
    # encode_text's outputs -> the transformer's keyword arguments
    condition_keys: dict[str, str] = {}

    def load(self, config: dict) -> TrainingParts:
        """Load ``model.pretrained`` and the flow objective (shift default: the scheduler's ``flow_shift``)."""
        m = config["model"]
        pipe = load_mhla_pipeline(m["pretrained"], torch_dtype=torch.float32)
        expert, timestep_range = select_expert(pipe, m.get("expert"), m["pretrained"])
        transformer = getattr(pipe, expert)
        if type(transformer).__name__ != self.transformer_class or not hasattr(pipe, "encode_prompt"):
            raise ValueError(f"family {self.family} expects a pipeline with a {self.transformer_class}; "
                             f"{m['pretrained']} holds {type(pipe).__name__} / {type(transformer).__name__}")
        frozen = [t for name, t in pipeline_transformers(pipe).items() if name != expert]  # the other expert, exported as loaded
        for module in (pipe.vae, pipe.text_encoder, *frozen):
            module.requires_grad_(False).eval()
        sched = pipe.scheduler.config
        shift = config["objective"]["shift"] or sched.get("flow_shift") or sched.get("shift") or 1.0
        table = flow_match_scheduler(float(shift), int(sched.get("num_train_timesteps", 1000)))
        o = config["objective"]
        objective = Objective(
            "flow", table, timestep_sampling=o["timestep_sampling"], logit_mean=o["logit_mean"], logit_std=o["logit_std"],
            mode_scale=o["mode_scale"], loss_weighting=o["loss_weighting"], timestep_range=timestep_range,
        )
        text = dict(m["text"])
        if text["max_sequence_length"] is None:
            text["max_sequence_length"] = _call_default(pipe, "max_sequence_length") or 300
        return TrainingParts(
            family=self.family, transformer=transformer, vae=pipe.vae, noise_scheduler=table,
            objective=objective, pipeline=pipe, text=text, expert=expert,
        )

    def prepare(self, parts, dataset, config):
        parts.null_condition = self.encode_text(parts, [""], parts.pipeline.text_encoder.device)
        return []

    @abc.abstractmethod
    def encode_text(self, parts, captions: Sequence[str], device) -> dict:
        """Encode ``captions`` with the pipeline's ``encode_prompt``."""

    @staticmethod
    def captions(batch: Mapping, id2label: Mapping | None, template: str = "{}") -> list[str]:
        """A batch's captions, or its class names through ``template``."""
        if "caption" in batch:
            return [str(c) for c in batch["caption"]]
        if "class_labels" in batch and id2label:
            return [template.format(id2label[int(i)]) for i in batch["class_labels"]]
        raise ValueError(
            "a text-conditioned model needs captions: use data.kind=captions / video, or class-labelled data (photos / folder)"
        )

    def condition(self, parts, batch, drop, mode="dataset", random_labels=None):
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
        captions = self.captions(batch, parts.id2label, parts.text.get("template", "{}"))
        latents = self.latents(parts, {"pixel_values": batch["pixel_values"].to(device)})
        return {"latents": latents, **self.encode_text(parts, captions, device)}

    def encoders(self, parts):
        return [parts.vae, parts.pipeline.text_encoder, {"text": {k: v for k, v in parts.text.items()}}]

    def write(self, model, parts, out_dir, *, sampler, id2label):
        components = dict(parts.pipeline.components)
        components[parts.expert] = model
        config = {k: parts.pipeline.config[k] for k in ("boundary_ratio", "expand_timesteps") if k in parts.pipeline.config}
        save_mhla_pipeline(type(parts.pipeline)(**components, **config), out_dir, overwrite=True)


class SanaRecipe(_TextRecipe):
    """Text-to-image SANA: flow matching, Gemma-2 captions via ``encode_prompt``, caption dropout."""

    family = "sana"
    transformer_class = "SanaTransformer2DModel"
    condition_keys = {"prompt_embeds": "encoder_hidden_states", "prompt_attention_mask": "encoder_attention_mask"}

    def load(self, config: dict) -> TrainingParts:
        parts = super().load(config)
        if parts.text["complex_human_instruction"] == "default":
            parts.text["complex_human_instruction"] = _call_default(parts.pipeline, "complex_human_instruction")
        return parts

    def encode_text(self, parts, captions: Sequence[str], device) -> dict:
        """``{"prompt_embeds" [B, L, D], "prompt_attention_mask" [B, L]}`` (no grad)."""
        with torch.no_grad():
            embeds, mask, _, _ = parts.pipeline.encode_prompt(
                list(captions), do_classifier_free_guidance=False, device=device, clean_caption=False,
                max_sequence_length=int(parts.text["max_sequence_length"]),
                complex_human_instruction=parts.text["complex_human_instruction"],
            )
        return {"prompt_embeds": embeds, "prompt_attention_mask": mask}

    def predict(self, model, noisy, timesteps, cond):
        return model(
            noisy, encoder_hidden_states=cond["encoder_hidden_states"], encoder_attention_mask=cond["encoder_attention_mask"],
            timestep=timesteps,
        ).sample


class WanRecipe(_TextRecipe):
    """Text-to-video Wan 2.1 / 2.2: flow matching, UMT5 captions, normalised ``AutoencoderKLWan`` latents."""

    family = "wan"
    transformer_class = "WanTransformer3DModel"
    condition_keys = {"prompt_embeds": "encoder_hidden_states"}

    def load(self, config: dict) -> TrainingParts:
        """As :meth:`_TextRecipe.load`; ``ValueError`` for image-to-video transformers (``in_channels`` != the VAE's ``z_dim``)."""
        parts = super().load(config)
        z_dim, channels = int(parts.vae.config.z_dim), int(parts.transformer.config.in_channels)
        if channels != z_dim:
            raise ValueError(
                f"{config['model']['pretrained']}: the {parts.expert} takes {channels} input channels, the VAE gives {z_dim}: an "
                "image-to-video model (noise + mask + first-frame latent); this trainer fine-tunes text-to-video Wan models"
            )
        return parts

    def latents(self, parts, batch, generator=None, *, rank=0, world_size=1):
        """Normalised video latents ``[B, z, F', H/8, W/8]`` of ``[B, 3, F, H, W]`` (or image) pixels."""
        if "latents" in batch:
            return batch["latents"].float()
        pixels = batch["pixel_values"]
        if pixels.ndim == 4:
            pixels = pixels.unsqueeze(2)
        vae = parts.vae
        with torch.no_grad():
            z = posterior_sample(vae.encode(pixels.to(vae.dtype)).latent_dist, generator, rank=rank, world_size=world_size).float()
        shape = (1, vae.config.z_dim) + (1,) * (z.ndim - 2)
        mean = torch.tensor(vae.config.latents_mean, device=z.device, dtype=z.dtype).view(shape)
        std = torch.tensor(vae.config.latents_std, device=z.device, dtype=z.dtype).view(shape)
        return (z - mean) / std

    def encode_text(self, parts, captions: Sequence[str], device) -> dict:
        """``{"prompt_embeds" [B, L, D]}``, zero rows after each caption (no grad)."""
        with torch.no_grad():
            embeds, _ = parts.pipeline.encode_prompt(
                list(captions), do_classifier_free_guidance=False, device=device,
                max_sequence_length=int(parts.text["max_sequence_length"]),
            )
        return {"prompt_embeds": embeds}

    def predict(self, model, noisy, timesteps, cond):
        return model(hidden_states=noisy, timestep=timesteps, encoder_hidden_states=cond["encoder_hidden_states"]).sample


RECIPES: dict[str, _Recipe] = {"dit": DiTRecipe(), "sana": SanaRecipe(), "wan": WanRecipe()}
assert tuple(RECIPES) == TRAINED_FAMILIES, "config.TRAINED_FAMILIES lists the families with a recipe"


def get_recipe(family: str) -> _Recipe:
    """The training recipe of a model family; ``ValueError`` if it has none."""
    if family not in RECIPES:
        raise ValueError(f"no training recipe for family {family!r}; available: {sorted(RECIPES)}")
    return RECIPES[family]


# -- models, data, optimizer -----------------------------------------------------------------------
def build_models(config: dict) -> TrainingParts:
    """Build the models training needs from ``config``: load, copy the teacher, apply MHLA, fp32, trainable set.

    Raises:
        ValueError: a bad ``model.*`` dict, a model that does not fit its family or objective, a teacher
            of another class.
        FileNotFoundError, MHLACheckpointError: from :func:`mhla_diffusers.load_mhla_pipeline`.
    """
    family = resolve_family(config)
    recipe = get_recipe(family)
    kind = config["objective"]["kind"]
    if kind is not None and kind != recipe.objective:
        raise ValueError(f"objective.kind={kind!r}: the {family} recipe trains {recipe.objective!r} (set objective.kind to it or null)")
    parts = recipe.load(config)
    if config["model"].get("expert") not in (None, parts.expert):  # a family whose recipe has no experts (DiT)
        raise ValueError(f"model.expert={config['model']['expert']}: the {family} pipeline trains its transformer only")
    transformer = parts.transformer
    teacher = config["distill"]["teacher"]
    if teacher == "original":
        parts.teacher = make_teacher(transformer)
    elif teacher:
        parts.teacher = load_teacher(_expert_folder(teacher, parts.expert))
        if type(parts.teacher) is not type(transformer):
            raise ValueError(
                f"distill.teacher {teacher} holds a {type(parts.teacher).__name__}; the student is a {type(transformer).__name__}"
            )
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


def resize_dit(transformer: torch.nn.Module, sample_size: int) -> torch.nn.Module:
    """The same DiT at latent size ``sample_size`` (progressive resolution); weights kept, sincos table rebuilt.

    ``ValueError`` for a model with MHLA (resize before converting) or a size not a patch multiple.
    """
    if int(transformer.config.sample_size) == sample_size:
        return transformer
    if is_mhla_model(transformer):
        raise ValueError("model.sample_size: resize the softmax DiT before converting it to MHLA (its block grids fit the old size)")
    if sample_size % int(transformer.config.patch_size):
        raise ValueError(f"model.sample_size={sample_size} does not divide by the patch size {transformer.config.patch_size}")
    resized = type(transformer).from_config({**dict(transformer.config), "sample_size": sample_size})
    resized.load_state_dict(transformer.state_dict(), strict=True)
    return resized.to(dtype=next(transformer.parameters()).dtype)


def check_resolution(transformer, vae, resolution: int) -> None:
    """Raise ``ValueError`` unless ``resolution / vae_scale_factor == transformer.config.sample_size``."""
    f = vae_scale_factor(vae)
    size = transformer.config.sample_size
    if resolution % f or resolution // f != size:
        raise ValueError(
            f"data.resolution={resolution} px gives {resolution / f:g} latent pixels (vae factor {f}), but the "
            f"transformer's sample_size is {size}: set data.resolution to {size * f}"
        )


def disable_internal_label_dropout(transformer: torch.nn.Module) -> list[tuple[torch.nn.Module, float]]:
    """Turn off diffusers' own label dropout inside DiT; returns ``[(module, old_prob)]`` to restore.

    :func:`training_loss` drops labels itself, once per sample, from a seeded generator.
    """
    changed = []
    for module in transformer.modules():
        if isinstance(module, LabelEmbedding) and module.dropout_prob > 0:
            changed.append((module, module.dropout_prob))
            module.dropout_prob = 0.0
    return changed
