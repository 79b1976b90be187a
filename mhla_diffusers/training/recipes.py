"""The training recipes: :func:`build_models`, which loads a family's models into :class:`TrainingParts` (MHLA
applied if asked, the teacher, the trainable set), and one recipe per family (:data:`RECIPES`).

A recipe is the generic part written here, the class-conditional one (:class:`ClassConditionalRecipe`) or the
text one (:class:`TextRecipe`), bound to the family's :class:`~mhla_diffusers.families.TrainingSpec`
(``Family.training``: prediction, text encoding, loading checks, ...). Each family's recipe class is named
by its spec (``DiTRecipe``, ``SanaRecipe``, ``WanRecipe``) and importable from here.
"""

from __future__ import annotations

import abc
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Sequence

import torch

from mhla_diffusers.apply import apply_mhla
from mhla_diffusers.autoencoder import vae_scale_factor
from mhla_diffusers.checkpoint.format import (
    expert_timestep_range,
    load_mhla_pipeline,
    pipeline_transformers,
    save_mhla_pipeline,
    transformer_folder,
)
from mhla_diffusers.families import (
    FAMILIES,
    Family,
    TrainingSpec,
    canonical_model_class,
    family_of_class_name,
    posterior_sample,
)
from mhla_diffusers.families.base import call_default
from mhla_diffusers.families.dit import check_resolution, disable_internal_label_dropout  # re-exported (public names)
from mhla_diffusers.models.installer import is_mhla_model
from mhla_diffusers.training.config import TRAINED_FAMILIES, default_family
from mhla_diffusers.training.distill import load_teacher, make_teacher
from mhla_diffusers.training.flow import Objective, flow_match_scheduler
from mhla_diffusers.training.optim import set_trainable

__all__ = [
    "TrainingParts", "ClassConditionalRecipe", "TextRecipe", "RECIPES", "get_recipe", "resolve_family", "build_models",
    "check_resolution", "vae_scale_factor", "disable_internal_label_dropout", "select_expert", "posterior_sample",
]


def resolve_family(config: dict) -> str:
    """The model family of a config: ``model.family``, else the class of ``model.pretrained``'s
    transformer, else the family that trains from scratch (``"dit"``).

    Raises:
        ValueError: the pretrained transformer's class belongs to no family with a training recipe,
            or contradicts ``model.family``.
    """
    m = config["model"]
    found = None
    if m["pretrained"] is not None:
        try:
            folder = transformer_folder(m["pretrained"])
            name = json.loads((folder / "config.json").read_text()).get("_class_name")
        except (FileNotFoundError, json.JSONDecodeError):
            name = None  # the loader reports a missing / broken folder with its own message
        name = canonical_model_class(name)
        found = getattr(family_of_class_name(name), "name", None)
        if name is not None and found is None:
            raise ValueError(f"{m['pretrained']}: transformer class {name!r} belongs to no supported family")
        if found is not None and found not in RECIPES:
            raise ValueError(f"{m['pretrained']} is a {found} model; this trainer has recipes for {sorted(RECIPES)}")
    family = m["family"] or found or default_family()
    if found is not None and m["family"] is not None and found != m["family"]:
        raise ValueError(f"model.family is {m['family']!r} but {m['pretrained']} holds a {found} transformer")
    return family


# -- the generic recipes -------------------------------------------------------------------------
@dataclass
class TrainingParts:
    """Everything :func:`train` builds besides the optimizer: models, objective, teacher, options.

    Attributes:
        family: ``"dit"`` / ``"sana"`` / ``"wan"``. transformer: trained, fp32, train mode.
        vae: frozen. noise_scheduler: ``DDPMScheduler`` (class families) or the flow sigma table.
        objective: the :class:`~mhla_diffusers.training.flow.Objective`. pipeline: text families' loaded pipeline.
        id2label: class families' pretrained labels. mhla_applied: modules converted by this run.
        teacher: frozen teacher or ``None``. text: ``model.text``. null_condition: the empty caption's encoding.
        expert: the component trained (:func:`select_expert`). Fields in full: ``docs/training.md`` (Recipes).
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
        """The family's recipe."""
        return get_recipe(self.family)


class _Recipe(abc.ABC):
    """The generic part of training, bound to a family's :class:`~mhla_diffusers.families.TrainingSpec` (``spec``)."""

    family = ""
    objective = ""
    text_conditioned = False
    spec: TrainingSpec = TrainingSpec()

    @abc.abstractmethod
    def load(self, config: dict) -> TrainingParts:
        """Load the pipeline / transformer / VAE / encoders named by ``config`` (MHLA installed as configured)."""

    def dropout(self, config: dict) -> float:
        """Probability of dropping a sample's condition (classifier-free guidance)."""
        return float(config["train"]["caption_dropout" if self.text_conditioned else "class_dropout"])

    def prepare(self, parts: TrainingParts, dataset, config: dict) -> list:
        """Check the data against the model; returns ``[(module, attribute, value)]`` to restore before export."""
        return []

    def latents(self, parts: TrainingParts, batch: Mapping, generator: torch.Generator | None = None, *, rank: int = 0,
                world_size: int = 1) -> torch.Tensor:
        """The clean latents of a batch: cached ``latents``, or the frozen vae on ``pixel_values`` (a posterior
        sample drawn for the global batch of ``world_size`` processes, :func:`posterior_sample`)."""
        if "latents" in batch:
            return batch["latents"].float()
        with torch.no_grad():
            return self.spec.encode_latents(parts.vae, batch["pixel_values"], generator, rank=rank, world_size=world_size)

    @abc.abstractmethod
    def condition(self, parts, batch, drop, mode="dataset", random_labels=None) -> dict:
        """The transformer's conditioning kwargs for ``batch`` (labels or text embeddings), ``drop`` [B] bool marking dropped conditions."""

    def predict(self, model, noisy, timesteps, cond) -> torch.Tensor:
        """The model's prediction for noisy latents ``noisy`` at ``timesteps`` (epsilon or flow velocity, by objective)."""
        return self.spec.predict(model, noisy, timesteps, cond)

    @abc.abstractmethod
    def cache_encode(self, parts: TrainingParts, batch: Mapping, device) -> dict:
        """What a latent cache stores for ``batch``: latents and, for text families, the text embeddings."""

    def encoders(self, parts: TrainingParts) -> list:
        """The frozen encoders whose outputs a latent cache stores (fingerprinted in its key)."""
        return [parts.vae]

    @abc.abstractmethod
    def write(self, model, parts: TrainingParts, out_dir: Path, *, sampler: str, id2label) -> None:
        """Write the trained model as a ready diffusers pipeline (converted-checkpoint format) into ``out_dir``."""


class ClassConditionalRecipe(_Recipe):
    """Class-conditional families (DiT): a pretrained pipeline or a model built from ``model.init``, label dropout to
    the spec's null class, a pipeline built from the trained parts (the spec's ``pipeline``) on export."""

    def load(self, config: dict) -> TrainingParts:
        """Load ``model.pretrained`` (a pipeline folder) or build ``model.init`` from scratch."""
        m = config["model"]
        id2label = None
        if m["pretrained"] is not None:
            pipe = load_mhla_pipeline(m["pretrained"], torch_dtype=torch.float32)
            transformer, vae, noise_scheduler, id2label = self.spec.from_pipeline(pipe)
        else:
            transformer, vae, noise_scheduler = self.spec.from_config(m)
        if type(transformer).__name__ not in self.model_classes:
            raise ValueError(
                f"family {self.family} expects a {self.model_classes[0]}; {m['pretrained']} holds a {type(transformer).__name__}"
            )
        if m.get("sample_size") is not None:
            transformer = resize_transformer(transformer, int(m["sample_size"]))
        self.spec.check(transformer, noise_scheduler)
        return TrainingParts(
            family=self.family, transformer=transformer, vae=vae, noise_scheduler=noise_scheduler,
            objective=Objective(self.objective, noise_scheduler), id2label=id2label,
        )

    def prepare(self, parts, dataset, config):
        """The spec's checks of the data against the model (DiT: resolution, class count; label dropout off)."""
        return self.spec.prepare(parts, dataset, config)

    def condition(self, parts, batch, drop, mode="dataset", random_labels=None):
        """``{"class_labels"}``: the batch's (``mode="dataset"``), ``random_labels`` (``"random"``) or
        the null class (``"null"``); dropped samples get the null class."""
        null_class = self.spec.null_class(parts.transformer)
        labels = batch["class_labels"]
        if mode == "random":
            labels = random_labels
        elif mode == "null":
            labels = torch.full_like(labels, null_class)
        return {"class_labels": torch.where(drop.to(labels.device), torch.full_like(labels, null_class), labels)}

    def cache_encode(self, parts, batch, device):
        """``{"latents", "class_labels"}`` of a batch."""
        return {"latents": self.spec.encode_latents(parts.vae, batch["pixel_values"].to(device)), "class_labels": batch["class_labels"]}

    def write(self, model, parts, out_dir, *, sampler, id2label):
        """A complete pipeline of the family (DiT: ``DiTPipeline``, :func:`~mhla_diffusers.training.export_pipeline`)."""
        pipe = self.spec.pipeline(model, parts.vae, parts.noise_scheduler, sampler=sampler, id2label=id2label)
        save_mhla_pipeline(pipe, out_dir, overwrite=True)


def select_expert(pipe, expert: str | None, where="the pipeline") -> tuple[str, tuple[float, float] | None]:
    """``(component name, timestep range)`` of the transformer to fine-tune in ``pipe`` (``model.expert``).

    Wan 2.2 A14B: ``transformer`` on ``t >= boundary_ratio * num_train_timesteps``, ``transformer_2`` below;
    one transformer: range ``None`` (every timestep).

    Raises:
        ValueError: a two-expert pipeline without ``expert``, or an ``expert`` the pipeline lacks.
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


class TextRecipe(_Recipe):
    """Text-conditioned flow-matching families (SANA, Wan): the pipeline's own ``encode_prompt`` (the spec's
    ``encode_text``), caption dropout to the empty caption, export as the same pipeline."""

    objective = "flow"
    text_conditioned = True
    transformer_class = ""
    # encode_text's outputs -> the transformer's keyword arguments
    condition_keys: dict[str, str] = {}

    def load(self, config: dict) -> TrainingParts:
        """Load ``model.pretrained`` (a pipeline folder, plain or converted) and the flow objective;
        the flow shift defaults to the pipeline scheduler's ``flow_shift``; then the spec's ``finish_load``."""
        m = config["model"]
        pipe = load_mhla_pipeline(m["pretrained"], torch_dtype=torch.float32)
        expert, timestep_range = select_expert(pipe, m.get("expert"), m["pretrained"])
        transformer = getattr(pipe, expert)
        if type(transformer).__name__ not in self.model_classes or not hasattr(pipe, "encode_prompt"):
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
            text["max_sequence_length"] = call_default(pipe, "max_sequence_length") or 300
        parts = TrainingParts(
            family=self.family, transformer=transformer, vae=pipe.vae, noise_scheduler=table,
            objective=objective, pipeline=pipe, text=text, expert=expert,
        )
        self.spec.finish_load(parts, config)
        _check_clip_frames(pipe, config["data"])
        return parts

    def prepare(self, parts, dataset, config):
        """Encode the empty caption once (caption dropout on cached embeddings)."""
        parts.null_condition = self.encode_text(parts, [""], parts.pipeline.text_encoder.device)
        return []

    def encode_text(self, parts, captions: Sequence[str], device) -> dict:
        """Encode ``captions`` with the pipeline's own ``encode_prompt`` (the spec's): the transformer's text kwargs."""
        return self.spec.encode_text(parts, captions, device)

    @staticmethod
    def captions(batch: Mapping, id2label: Mapping | None, template: str = "{}") -> list[str]:
        """A batch's captions: its ``caption`` strings, or its class names through ``template``."""
        if "caption" in batch:
            return [str(c) for c in batch["caption"]]
        if "class_labels" in batch and id2label:
            return [template.format(id2label[int(i)]) for i in batch["class_labels"]]
        raise ValueError(
            "a text-conditioned model needs captions: use data.kind=captions / video, or class-labelled data (photos / folder)"
        )
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
        components = dict(parts.pipeline.components)
        components[parts.expert] = model
        config = {k: parts.pipeline.config[k] for k in ("boundary_ratio", "expand_timesteps") if k in parts.pipeline.config}
        save_mhla_pipeline(type(parts.pipeline)(**components, **config), out_dir, overwrite=True)



def _check_clip_frames(pipe, data: Mapping) -> None:
    """Video data must have ``k * t + 1`` frames per clip for a VAE compressing time by ``t`` (the pipeline's
    ``vae_scale_factor_temporal``; Wan, SANA-Video: 4): the VAE would drop the frames beyond.

    Raises:
        ValueError: another count, naming the nearest valid ones.
    """
    factor = int(getattr(pipe, "vae_scale_factor_temporal", 1) or 1)
    frames = data.get("num_frames")
    if data.get("kind") != "video" or frames is None or (int(frames) - 1) % factor == 0:
        return
    low = max(1, (int(frames) - 1) // factor * factor + 1)
    raise ValueError(
        f"data.num_frames={frames}: the VAE of this {type(pipe).__name__} compresses time by {factor} and encodes "
        f"{factor}k + 1 frames (1, {1 + factor}, {1 + 2 * factor}, ...); a clip of {frames} would lose its last frames. "
        f"Nearest valid counts: {low} or {low + factor}"
    )


def _recipe_class(family: Family) -> type:
    """The recipe class of ``family``: the generic recipe of its conditioning bound to ``family.training``."""
    spec = family.training
    base = TextRecipe if family.conditioning == "text" else ClassConditionalRecipe
    attrs = {
        "__doc__": type(spec).__doc__, "__module__": __name__, "__qualname__": spec.recipe_name, "family": family.name,
        "objective": spec.objective, "spec": spec, "model_classes": family.model_classes,
    }
    if base is TextRecipe:
        attrs.update(transformer_class=family.model_classes[0], condition_keys=dict(spec.condition_keys))
    return type(spec.recipe_name, (base,), attrs)


# One recipe per family with a training spec, in registration order; its class is a name of this module.
RECIPES: dict[str, _Recipe] = {name: _recipe_class(f)() for name, f in FAMILIES.items() if f.training is not None}
globals().update({type(r).__name__: type(r) for r in RECIPES.values()})  # DiTRecipe, SanaRecipe, WanRecipe
__all__ += [type(r).__name__ for r in RECIPES.values()]
assert tuple(RECIPES) == TRAINED_FAMILIES, "config.TRAINED_FAMILIES lists the families with a recipe"


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
    """Build what training needs from ``config``: load, copy the teacher, apply MHLA, cast to fp32, set the trainable set.

    Returns:
        :class:`TrainingParts` (the transformer fp32, train mode; vae / text encoder / teacher frozen, eval).

    Raises:
        ValueError: a bad ``model.init`` / ``model.vae`` / ``model.noise_scheduler``, a model not fitting its
            family, an ``objective.kind`` the family does not train, a teacher of another family.
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
        parts.teacher = load_teacher(teacher, component=parts.expert)
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


def resize_transformer(transformer: torch.nn.Module, sample_size: int) -> torch.nn.Module:
    """The same model at latent size ``sample_size`` (progressive resolution; ``resizable`` families: DiT).

    The sincos positional table is rebuilt, every learned weight carried over; returns ``transformer`` itself
    when the size is unchanged. Why rebuilt: ``docs/training.md`` (Recipes, DiT).

    Raises:
        ValueError: the model has MHLA (convert after resizing), or ``sample_size`` does not divide by the patch size.
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


resize_dit = resize_transformer  # its former name
