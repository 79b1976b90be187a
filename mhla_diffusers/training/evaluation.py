"""Held-out losses on fixed noise and timesteps: the same numbers for every model given the same arguments."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.utils.data import default_collate

from mhla_diffusers.training.flow import Objective
from mhla_diffusers.training.recipes import TrainingParts

__all__ = ["evaluate_heldout", "evaluate_loss"]


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
    """Held-out losses of ``model`` on ``num_samples`` items: deterministic draws, noise seeded on the CPU.

    Returns ``{"loss", "distill_output"}``: the objective's MSE per element, and the MSE to the
    teacher's output (``None`` without a teacher).

    Raises:
        ValueError: ``num_samples < 1`` or an empty dataset.
    """
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
    """Held-out epsilon MSE per element of a DiT (:func:`evaluate_heldout`, whose errors it raises)."""
    parts = TrainingParts("dit", transformer, vae, noise_scheduler, Objective("epsilon", noise_scheduler))
    return evaluate_heldout(parts, transformer, dataset, num_samples=num_samples, batch_size=batch_size, seed=seed)["loss"]
