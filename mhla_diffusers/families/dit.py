"""DiT (``DiTTransformer2DModel`` + ``DiTPipeline``): class-conditional, softmax self-attention.

The :data:`DIT` entry, its training specifics (DDPM epsilon, null class, from scratch), checkpoint
quirks (``Transformer2DModel`` alias, ``id2label`` repair) and its ``"trunk"`` context-parallel plan.
Details: ``docs/families/index.md``.
"""

from __future__ import annotations

import inspect
import json
from pathlib import Path
from typing import Mapping

import torch
from diffusers import DDPMScheduler, DiTTransformer2DModel
from diffusers.models.embeddings import LabelEmbedding
from huggingface_hub import try_to_load_from_cache

from mhla_diffusers.autoencoder import SpaceToDepthAutoencoder, vae_scale_factor
from mhla_diffusers.families.base import (
    Family,
    PipelineQuirks,
    TrainingSpec,
    attn_processor_2_0,
    grid_2d,
    reference_grid_2d,
    register_family,
)

__all__ = ["DIT", "DiTLabels", "DiTTraining", "build_dit_pipeline", "check_resolution", "disable_internal_label_dropout"]


# -- checkpoint quirks: id2label ---------------------------------------------------------------------
def _sorted_id2label(raw) -> dict[str, str]:
    """``{"0": name, "1": ...}``: string keys (as JSON stores them), in the order of the class ids."""
    items = [(str(k), str(v)) for k, v in dict(raw).items()]
    return dict(sorted(items, key=lambda kv: (0, int(kv[0]), "") if kv[0].lstrip("-").isdigit() else (1, 0, kv[0])))


def _source_id2label(name_or_path) -> dict[str, str] | None:
    """``id2label`` of the ``model_index.json`` a pipeline was loaded from: a local folder, or a Hub
    id's cached copy (never downloaded); ``None`` if unknown."""
    if not name_or_path:
        return None
    index = Path(str(name_or_path)) / "model_index.json"
    try:
        if not index.is_file():
            cached = try_to_load_from_cache(str(name_or_path), "model_index.json")
            if not isinstance(cached, str):
                return None
            index = Path(cached)
        raw = json.loads(index.read_text()).get("id2label")
        return _sorted_id2label(raw) if raw else None
    except Exception:  # no such repository id, unreadable JSON, ...: the names are rebuilt from pipe.labels
        return None


def _labels_of(id2label: dict[str, str]) -> dict[str, int]:
    """``DiTPipeline.labels`` built from ``id2label`` (names split at commas)."""
    return {name.strip(): int(key) for key, value in id2label.items() for name in value.split(",")}


def _pipeline_id2label(pipe) -> dict[str, str] | None:
    """The pipeline's ``id2label`` as ``model_index.json`` stores it (config, source file, else rebuilt from ``pipe.labels``)."""
    config = getattr(pipe, "config", None) or {}
    raw = config.get("id2label") if hasattr(config, "get") else None
    if raw:
        return _sorted_id2label(raw)
    labels = getattr(pipe, "labels", None)
    if not isinstance(labels, dict) or not labels:
        return None
    source = _source_id2label(config.get("_name_or_path") if hasattr(config, "get") else None)
    if source is not None and _labels_of(source) == {str(k): int(v) for k, v in labels.items()}:
        return source
    by_id: dict[int, list[str]] = {}
    for name, idx in labels.items():
        by_id.setdefault(int(idx), []).append(str(name))
    return {str(i): ", ".join(names) for i, names in sorted(by_id.items())}


def _write_id2label(pipe, folder: Path) -> None:
    """Put the pipeline's ``id2label`` into the written ``model_index.json`` when diffusers left it out."""
    index = Path(folder) / "model_index.json"
    if not index.is_file():
        return
    data = json.loads(index.read_text())
    if data.get("id2label"):
        return
    id2label = _pipeline_id2label(pipe)
    if id2label is None:
        return
    data["id2label"] = id2label
    index.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")


def _register_id2label(pipe, path: Path) -> None:
    """Keep ``model_index.json``'s ``id2label`` in ``pipe.config`` so a later ``save_pretrained`` writes it again."""
    config = getattr(pipe, "config", None)
    if config is None or config.get("id2label") or "id2label" not in inspect.signature(type(pipe).__init__).parameters:
        return
    index = Path(path) / "model_index.json"
    try:
        raw = json.loads(index.read_text()).get("id2label")
    except (OSError, ValueError, AttributeError):
        return
    if raw and isinstance(raw, dict):
        pipe.register_to_config(id2label=_sorted_id2label(raw))


class DiTLabels(PipelineQuirks):
    """DiT's class names (``id2label``): written into ``model_index.json`` when diffusers' ``save_pretrained``
    left them out, and kept in ``pipe.config`` on load. Pipelines without class names are left alone."""

    def after_load(self, pipe, path) -> None:
        _register_id2label(pipe, path)

    def after_save(self, pipe, folder) -> None:
        _write_id2label(pipe, folder)


# -- training ----------------------------------------------------------------------------------------
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


def disable_internal_label_dropout(transformer: torch.nn.Module) -> list[tuple[torch.nn.Module, float]]:
    """Turn off DiT's per-block label dropout (``training_loss`` drops labels itself); returns ``[(module, old_prob)]``."""
    changed = []
    for module in transformer.modules():
        if isinstance(module, LabelEmbedding) and module.dropout_prob > 0:
            changed.append((module, module.dropout_prob))
            module.dropout_prob = 0.0
    return changed


def build_dit_pipeline(transformer, vae, noise_scheduler, *, sampler: str = "dpm", id2label: Mapping[int, str] | None = None):
    """A ``DiTPipeline`` of the trained parts with ``id2label`` registered; ``sampler`` ``"dpm"`` / ``"ddim"`` / ``"ddpm"``.

    Raises:
        ValueError: unknown ``sampler``.
    """
    from diffusers import DDIMScheduler, DiTPipeline, DPMSolverMultistepScheduler  # pipelines: only when exporting

    classes = {"dpm": DPMSolverMultistepScheduler, "ddim": DDIMScheduler, "ddpm": DDPMScheduler}
    if sampler not in classes:
        raise ValueError(f"sampler must be one of {sorted(classes)}; got {sampler!r}")
    scheduler = classes[sampler].from_config(noise_scheduler.config)
    labels = {int(k): str(v) for k, v in id2label.items()} if id2label else None
    pipe = DiTPipeline(transformer=transformer, vae=vae, scheduler=scheduler, id2label=labels)
    if labels:
        pipe.register_to_config(id2label={str(k): v for k, v in sorted(labels.items())})
    return pipe


class DiTTraining(TrainingSpec):
    """Class-conditional DiT (``DiTTransformer2DModel`` + ``DiTPipeline``): DDPM epsilon prediction,
    label dropout to the null class ``num_embeds_ada_norm`` (1000), exported with a DPM / DDIM / DDPM sampler."""

    recipe_name = "DiTRecipe"
    objective = "epsilon"
    from_scratch = True
    resizable = True

    def from_pipeline(self, pipe):
        """``(transformer, vae, DDPM noise scheduler, id2label or None)`` of a loaded ``DiTPipeline``."""
        noise_scheduler = DDPMScheduler.from_config(pipe.scheduler.config)
        raw = pipe.config.get("id2label") if hasattr(pipe, "config") else None
        id2label = {int(k): str(v) for k, v in dict(raw).items()} if raw else None
        return pipe.transformer, pipe.vae, noise_scheduler, id2label

    def from_config(self, m: Mapping):
        """``(transformer, vae, noise scheduler)`` built from ``model.init`` / ``model.vae`` / ``model.noise_scheduler``.

        Raises:
            ValueError: a dict that is not a valid config of its class.
        """
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
        return transformer, vae, noise_scheduler

    def check(self, transformer, noise_scheduler) -> None:
        """Raise ``ValueError`` unless the scheduler predicts epsilon and the transformer is class-conditional."""
        if getattr(noise_scheduler.config, "prediction_type", "epsilon") != "epsilon":
            raise ValueError(f"only epsilon prediction is supported; the scheduler says {noise_scheduler.config.prediction_type!r}")
        if transformer.config.get("num_embeds_ada_norm") is None:
            raise ValueError("the transformer must be class-conditional (num_embeds_ada_norm set; DiTPipeline needs 1000)")

    def null_class(self, transformer) -> int:
        """The label of the dropped condition: ``num_embeds_ada_norm``."""
        return int(transformer.config.num_embeds_ada_norm)

    def prepare(self, parts, dataset, config) -> list:
        """Resolution vs ``sample_size``, class count vs the null label; diffusers' own label dropout off."""
        check_resolution(parts.transformer, parts.vae, int(config["data"]["resolution"]))
        null_class = self.null_class(parts.transformer)
        labels = getattr(dataset, "id2label", None) or {}
        if len(labels) > null_class:
            raise ValueError(f"{len(labels)} classes but the model has {null_class} (num_embeds_ada_norm)")
        restore = [(m, "dropout_prob", p) for m, p in disable_internal_label_dropout(parts.transformer)]
        if parts.teacher is not None:
            disable_internal_label_dropout(parts.teacher)
        return restore

    def predict(self, model, noisy, timesteps, cond):
        """The epsilon half of the output (learned-sigma models predict ``2 C`` channels)."""
        return self.prediction(model(noisy, timestep=timesteps, class_labels=cond["class_labels"], return_dict=False)[0], noisy)

    def prediction(self, output, noisy):
        """The first ``C`` channels of the output (``C`` = the latent's; learned-sigma models give ``2 C``)."""
        return output[:, : noisy.shape[1]]

    def pipeline(self, transformer, vae, noise_scheduler, *, sampler: str, id2label):
        """The pipeline a run exports (:func:`build_dit_pipeline`)."""
        return build_dit_pipeline(transformer, vae, noise_scheduler, sampler=sampler, id2label=id2label)


DIT = register_family(Family(
    name="dit",
    display_name="DiT",
    model_classes=("DiTTransformer2DModel",),
    class_aliases=(("Transformer2DModel", "DiTTransformer2DModel"),),  # the original DiT checkpoints' config.json
    pipeline_classes=("DiTPipeline",),
    self_attention=r"^transformer_blocks\.(\d+)\.attn1$",
    patch_embed="pos_embed",
    grid_from_latent=grid_2d,
    reference_grid=reference_grid_2d,
    stock_self_processor=attn_processor_2_0,
    empty_blocks=True,  # a latent smaller than the block grid (e.g. 64 px with 4 x 4 blocks on 32 x 32 tokens)
    context_parallel="trunk",  # blocks: per-token MLP and adaLN; proj_out_2 before the unpatchify reshape
    cp_trunk=("transformer_blocks.0", "proj_out_2"),
    fsdp_blocks=False,  # forward: conditioning = self.transformer_blocks[0].norm1.emb(...) for the output layer
    pipeline_quirks=DiTLabels(),
    training=DiTTraining(),
))
