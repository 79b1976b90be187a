"""The training loss: data loss plus distillation terms (:func:`training_loss`); DiT's plain :func:`diffusion_loss`."""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any, Mapping

import torch
import torch.nn.functional as F

from mhla_diffusers.training.distill import attention_transfer_loss, output_matching_loss

if TYPE_CHECKING:  # annotations only: recipes imports the modules that import this one
    from mhla_diffusers.training.recipes import TrainingParts

__all__ = ["training_loss", "diffusion_loss"]


# -- the loss --------------------------------------------------------------------------------------
def _step_draws(parts: TrainingParts, latents: torch.Tensor, generator, *, rank: int, world_size: int, dropout: float,
                condition: str, num_classes: int | None):
    """The random draws of one micro-batch, made for the global batch and sliced (sample ``j`` of rank ``r``: ``j * world + r``)."""
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


def _stored_pair(batch: Mapping[str, Any], drop: torch.Tensor, condition: str, data_weight: float):
    """``(noisy, timesteps, teacher prediction)`` of a teacher store's pairs (``None`` for other batches): the stored
    latent at a step of the teacher's trajectory and its prediction there, the null-condition one for dropped samples.

    Raises:
        ValueError: a data loss or random labels on stored pairs, or dropped samples without stored null predictions.
    """
    if "teacher_pred" not in batch:
        return None
    if data_weight > 0 or condition == "random":
        raise ValueError("a teacher store's pairs train output matching on their own conditions: distill.data_weight must be 0 "
                         "and distill.condition dataset or null (data.teacher.use=samples trains the data loss)")
    pred = batch["teacher_pred"]
    dropped = drop.to(pred.device) if condition != "null" else torch.ones(len(drop), dtype=torch.bool, device=pred.device)
    if bool(dropped.any()):
        if "teacher_null_pred" not in batch:
            raise ValueError("the teacher store holds no null-condition predictions (sampled without guidance): set the "
                             "condition dropout to 0 (train.class_dropout / caption_dropout) or build it with guidance_scale > 1")
        pred = torch.where(dropped.view(-1, *([1] * (pred.ndim - 1))), batch["teacher_null_pred"], pred)
    return batch["noisy"], batch["timesteps"], pred


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

    ``batch`` holds ``pixel_values`` or cached ``latents`` plus labels, captions or embeddings, on the
    device; the step's draws come from ``generator`` for the global batch (``rank`` of ``world_size``);
    A teacher store's pair (``noisy``, ``timesteps``, ``teacher_pred``: :class:`~mhla_diffusers.data.store.TeacherPairs`)
    brings its own noisy latent and the teacher's prediction, which replace the drawn noise and the teacher's forward.
    ``condition`` is ``"dataset"``, ``"random"`` or ``"null"``; ``recorders`` the ``(student, teacher)``
    :class:`~mhla_diffusers.training.distill.AttentionRecorder` pair for attention transfer.

    Returns:
        ``(loss, terms)``: the fp32 scalar and its unweighted terms with a weight > 0.
    """
    recipe = parts.recipe
    latents = recipe.latents(parts, batch, generator, rank=rank, world_size=world_size)  # posterior noise: global draw
    noise, draw, drop, random_labels = _step_draws(
        parts, latents, generator, rank=rank, world_size=world_size, dropout=dropout, condition=condition, num_classes=num_classes,
    )
    stored = _stored_pair(batch, drop, condition, data_weight)
    if stored is None:
        noisy, timesteps, target, weights = parts.objective.inputs(latents, noise, draw)
    else:
        noisy, timesteps, stored_pred = stored
    cond = recipe.condition(parts, batch, drop, condition, random_labels)
    student_rec, teacher_rec = recorders if recorders is not None else (None, None)
    if attention_weight > 0 and student_rec is None:
        raise ValueError("attention_weight > 0 needs recorders=(student, teacher) AttentionRecorders")
    with student_rec if attention_weight > 0 else contextlib.nullcontext():
        pred = recipe.predict(model, noisy, timesteps, cond)
    terms: dict[str, torch.Tensor] = {}
    if data_weight > 0:
        terms["data"] = parts.objective.loss(pred, target, weights)
    if output_weight > 0 or attention_weight > 0:
        teacher_pred = stored_pred if stored is not None else None
        if teacher_pred is None or attention_weight > 0:  # a teacher store's pair holds the prediction, not the attention
            if parts.teacher is None:
                raise ValueError("distillation weights > 0 need parts.teacher (distill.teacher)")
            with torch.no_grad(), teacher_rec if attention_weight > 0 else contextlib.nullcontext():
                live = recipe.predict(parts.teacher, noisy, timesteps, cond)
            teacher_pred = live if teacher_pred is None else teacher_pred
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
    """DDPM epsilon-prediction loss of one DiT batch: ``mean ||eps - eps_theta(x_t, t, y)||^2`` (fp32).

    ``batch``: ``pixel_values`` float ``[B, 3, H, W]`` in ``[-1, 1]`` and ``class_labels`` long ``[B]``;
    labels are replaced by ``null_class`` with probability ``class_dropout``; ``generator`` (``None``:
    the global RNG) draws ``t``, ``eps`` and the dropout.
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
