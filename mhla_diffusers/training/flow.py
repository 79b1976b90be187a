"""Training objectives: DDPM epsilon prediction (DiT) and rectified-flow matching (SANA, Wan).

One small class, :class:`Objective`, turns clean latents, noise and one random draw per sample
into what the loss needs, the same way in training and in the held-out evaluation:

- ``kind="epsilon"`` (Ho et al. 2020, Eq. 14; DiT): ``t ~ U{0..T-1}``,
  ``x_t = sqrt(alpha_bar_t) x_0 + sqrt(1 - alpha_bar_t) eps`` (``DDPMScheduler.add_noise``),
  target ``eps``.
- ``kind="flow"`` (rectified flow / flow matching as trained by SD3, SANA and Wan; diffusers'
  ``train_dreambooth_lora_sana.py``): ``u`` from
  :func:`diffusers.training_utils.compute_density_for_timestep_sampling` (``logit_normal`` by
  default), mapped through the shifted sigma table of a ``FlowMatchEulerDiscreteScheduler``
  (``sigma = shift s / (1 + (shift - 1) s)``), ``x_t = (1 - sigma) x_0 + sigma eps``,
  transformer timestep ``sigma * 1000``, target ``eps - x_0`` (the velocity), per-sample loss
  weights from :func:`diffusers.training_utils.compute_loss_weighting_for_sd3`.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from diffusers import FlowMatchEulerDiscreteScheduler
from diffusers.training_utils import compute_density_for_timestep_sampling, compute_loss_weighting_for_sd3

__all__ = ["OBJECTIVES", "TIMESTEP_SAMPLING", "LOSS_WEIGHTING", "Objective", "flow_match_scheduler"]

OBJECTIVES = ("epsilon", "flow")
TIMESTEP_SAMPLING = ("logit_normal", "mode", "uniform")
LOSS_WEIGHTING = ("none", "sigma_sqrt", "cosmap")


def flow_match_scheduler(shift: float = 1.0, num_train_timesteps: int = 1000):
    """A fresh ``FlowMatchEulerDiscreteScheduler`` whose sigma table is the training one (``shift`` applied).

    ``scheduler.sigmas[i]`` / ``scheduler.timesteps[i]`` (``i = 0 .. T - 1``) run from ``sigma = 1``
    (pure noise) down to ``shift / (T + shift - 1)``; timesteps are ``sigma * T``.

    Raises:
        ValueError: ``shift <= 0``.
    """
    if not shift > 0:
        raise ValueError(f"the flow-matching shift must be > 0; got {shift!r}")
    return FlowMatchEulerDiscreteScheduler(num_train_timesteps=int(num_train_timesteps), shift=float(shift))


class Objective:
    """The noising and the regression target of one training objective.

    Args:
        kind: ``"epsilon"`` or ``"flow"``.
        scheduler: ``DDPMScheduler``-like (epsilon: ``add_noise``, ``config.num_train_timesteps``) or
            the flow table from :func:`flow_match_scheduler`.
        timestep_sampling: flow only; ``"logit_normal"`` (SD3 / SANA / Wan), ``"mode"`` or ``"uniform"``.
        logit_mean, logit_std: of the logit-normal density (default 0, 1).
        mode_scale: of the ``"mode"`` density (SD3's 1.29).
        loss_weighting: flow only; ``"none"``, ``"sigma_sqrt"`` (``sigma^-2``) or ``"cosmap"``.
        timestep_range: flow only; ``(low, high)``: train on the table's timesteps ``t`` with
            ``low <= t < high`` only (transformer timestep units, ``sigma * T``), the draw ``u`` spread
            over them in the same order (Wan 2.2 A14B's experts: ``transformer`` on
            ``[boundary_ratio * T, inf)``, ``transformer_2`` on ``[0, boundary_ratio * T)``, as
            ``WanPipeline`` switches them). ``None``: every timestep.

    Raises:
        ValueError: unknown ``kind`` / ``timestep_sampling`` / ``loss_weighting``; a ``timestep_range``
            for the epsilon objective or one holding no timestep of the table.
    """

    def __init__(
        self,
        kind: str,
        scheduler: Any,
        *,
        timestep_sampling: str = "logit_normal",
        logit_mean: float = 0.0,
        logit_std: float = 1.0,
        mode_scale: float = 1.29,
        loss_weighting: str = "none",
        timestep_range: tuple[float, float] | None = None,
    ):
        if kind not in OBJECTIVES:
            raise ValueError(f"objective must be one of {OBJECTIVES}; got {kind!r}")
        if timestep_sampling not in TIMESTEP_SAMPLING:
            raise ValueError(f"timestep_sampling must be one of {TIMESTEP_SAMPLING}; got {timestep_sampling!r}")
        if loss_weighting not in LOSS_WEIGHTING:
            raise ValueError(f"loss_weighting must be one of {LOSS_WEIGHTING}; got {loss_weighting!r}")
        self.kind = kind
        self.scheduler = scheduler
        self.num_train_timesteps = int(scheduler.config.num_train_timesteps)
        self.timestep_sampling = timestep_sampling
        self.logit_mean, self.logit_std, self.mode_scale = float(logit_mean), float(logit_std), float(mode_scale)
        self.loss_weighting = loss_weighting
        self.timestep_range = None if timestep_range is None else (float(timestep_range[0]), float(timestep_range[1]))
        self._first, self._count = 0, self.num_train_timesteps  # the table rows u is spread over
        if timestep_range is not None:
            if kind != "flow":
                raise ValueError("timestep_range is defined for the flow objective only")
            t = scheduler.timesteps[: self.num_train_timesteps].double()
            rows = torch.nonzero((t >= self.timestep_range[0]) & (t < self.timestep_range[1])).flatten()
            if rows.numel() == 0:
                span = f"{float(t.min()):.1f} to {float(t.max()):.1f}"
                raise ValueError(f"timestep_range {timestep_range} holds no timestep of the table ({span})")
            self._first, self._count = int(rows[0]), int(rows.numel())  # the table is monotone: one run of rows

    def __repr__(self) -> str:
        extra = "" if self.kind == "epsilon" else (
            f", timestep_sampling={self.timestep_sampling!r}, shift={self.scheduler.config.shift}, loss_weighting={self.loss_weighting!r}"
        )
        if self.timestep_range is not None:
            extra += f", timestep_range={self.timestep_range}"
        return f"Objective({self.kind!r}, T={self.num_train_timesteps}{extra})"

    # -- the random draw of each sample ---------------------------------------------------------
    def draw(self, n: int, generator: torch.Generator | None, device: torch.device | str = "cpu") -> torch.Tensor:
        """One draw per sample, ``[n]``: epsilon ``t`` (long, uniform over ``0 .. T-1``); flow ``u`` in ``(0, 1)`` (float)."""
        if self.kind == "epsilon":
            return torch.randint(0, self.num_train_timesteps, (n,), generator=generator, device=device)
        return compute_density_for_timestep_sampling(
            self.timestep_sampling, n, logit_mean=self.logit_mean, logit_std=self.logit_std,
            mode_scale=self.mode_scale, device=device, generator=generator,
        )

    def evenly_spaced(self, index: torch.Tensor, n: int) -> torch.Tensor:
        """Deterministic draws for a held-out evaluation: sample ``i`` of ``n`` gets epsilon
        ``t = round(i (T - 1) / (n - 1))`` or flow ``u = (i + 0.5) / n`` (midpoints, every noise level)."""
        index = torch.as_tensor(index)
        if self.kind == "epsilon":
            t = [round(int(i) * (self.num_train_timesteps - 1) / max(n - 1, 1)) for i in index]
            return torch.tensor(t, dtype=torch.long, device=index.device)
        return (index.to(torch.float64) + 0.5) / n

    # -- noising and target -----------------------------------------------------------------------
    def inputs(
        self, latents: torch.Tensor, noise: torch.Tensor, draw: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """``(noisy, timesteps, target, weights)`` for clean ``latents`` ``[B, ...]``, ``noise`` (same
        shape) and ``draw`` ``[B]`` from :meth:`draw` / :meth:`evenly_spaced`.

        ``timesteps`` is what the transformer receives (epsilon: long ``t``; flow: float
        ``sigma * T``); ``weights`` ``[B]`` is ``None`` when every sample weighs the same.
        """
        if self.kind == "epsilon":
            t = draw.to(latents.device)
            return self.scheduler.add_noise(latents, noise, t), t, noise, None
        idx = self._first + (draw.to(torch.float64) * self._count).long().clamp(0, self._count - 1).cpu()
        sigmas = self.scheduler.sigmas[idx].to(latents.device, torch.float32)
        timesteps = self.scheduler.timesteps[idx].to(latents.device, torch.float32)
        s = sigmas.view(-1, *([1] * (latents.ndim - 1)))
        noisy = (1.0 - s) * latents + s * noise
        target = noise - latents
        weights = None
        if self.loss_weighting != "none":
            weights = compute_loss_weighting_for_sd3(self.loss_weighting, sigmas).float()
        return noisy.to(latents.dtype), timesteps, target, weights

    @staticmethod
    def loss(pred: torch.Tensor, target: torch.Tensor, weights: torch.Tensor | None = None) -> torch.Tensor:
        """Mean squared error in fp32; with ``weights`` ``[B]``, the mean over samples of
        ``weights[b] * mean((pred[b] - target[b])^2)``."""
        if weights is None:
            return F.mse_loss(pred.float(), target.float(), reduction="mean")
        per_sample = (pred.float() - target.float()).pow(2).reshape(pred.shape[0], -1).mean(dim=1)
        return (weights.float() * per_sample).mean()
