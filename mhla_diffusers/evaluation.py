"""Held-out diffusion loss: the number the demo compares models by.

Training losses are noisy (random timesteps, noise and crops each step). The validation loss
fixes all of them: the same crops, the same noise, and timesteps stratified over ``[0, T)``, so
two models evaluated with the same arguments see exactly the same inputs.
"""

from __future__ import annotations

from typing import Mapping

import torch
import torch.nn.functional as F

__all__ = ["validation_loss"]


@torch.no_grad()
def validation_loss(
    transformer: torch.nn.Module,
    vae: torch.nn.Module,
    noise_scheduler,
    dataset,
    *,
    num_samples: int = 64,
    batch_size: int = 16,
    seed: int = 1234,
    timesteps_per_sample: int = 4,
) -> Mapping[str, float]:
    """Epsilon-prediction MSE of a class-conditional DiT on fixed held-out inputs.

    Args:
        transformer: ``DiTTransformer2DModel`` (put in eval mode for the call, restored after).
        vae: the pipeline's autoencoder. noise_scheduler: a ``DDPMScheduler``-like scheduler with
            ``add_noise`` and ``config.num_train_timesteps``.
        dataset: items ``{"pixel_values": [3, S, S] in [-1, 1], "class_labels": long}``; the first
            ``num_samples`` items are used.
        timesteps_per_sample: each sample is noised at this many timesteps, stratified over
            ``[0, T)`` (sample ``i``, draw ``j`` -> stratum ``(i * k + j) mod (n * k)``).

    Returns:
        ``{"loss": mean MSE, "loss_low_t": mean over t < T/2, "loss_high_t": mean over t >= T/2,
        "num_evaluations": int}``.

    Raises:
        ValueError: when the dataset holds fewer than ``num_samples`` items.
    """
    if len(dataset) < num_samples:
        raise ValueError(f"the validation set has {len(dataset)} items, fewer than num_samples={num_samples}")
    device = next(transformer.parameters()).device
    dtype = next(transformer.parameters()).dtype
    total_t = noise_scheduler.config.num_train_timesteps
    strata = num_samples * timesteps_per_sample
    generator = torch.Generator("cpu").manual_seed(seed)
    was_training = transformer.training
    transformer.eval()
    losses, times = [], []
    try:
        for start in range(0, num_samples, batch_size):
            items = [dataset[i] for i in range(start, min(start + batch_size, num_samples))]
            pixels = torch.stack([it["pixel_values"] for it in items]).to(device)
            labels = torch.stack([torch.as_tensor(it["class_labels"]) for it in items]).to(device)
            latents = vae.encode(pixels.to(vae.dtype)).latent_dist.mode() * vae.config.scaling_factor
            for j in range(timesteps_per_sample):
                idx = torch.arange(start, start + len(items)) * timesteps_per_sample + j
                lo = idx * total_t // strata
                hi = (idx + 1) * total_t // strata
                t = lo + (torch.rand(len(items), generator=generator) * (hi - lo).clamp(min=1)).long()
                t = t.clamp(max=total_t - 1)
                noise = torch.randn(latents.shape, generator=generator).to(device, latents.dtype)
                noisy = noise_scheduler.add_noise(latents, noise, t.to(device))
                pred = transformer(noisy.to(dtype), timestep=t.to(device), class_labels=labels).sample
                pred = pred[:, : latents.shape[1]].float()
                per_sample = F.mse_loss(pred, noise.float(), reduction="none").flatten(1).mean(1)
                losses.append(per_sample.cpu())
                times.append(t)
    finally:
        transformer.train(was_training)
    loss, t = torch.cat(losses).double(), torch.cat(times)
    low = t < total_t // 2
    return {
        "loss": float(loss.mean()),
        "loss_low_t": float(loss[low].mean()),
        "loss_high_t": float(loss[~low].mean()),
        "num_evaluations": int(loss.numel()),
    }
