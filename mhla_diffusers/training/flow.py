"""Training objectives: DDPM epsilon prediction (DiT; Ho et al. 2020, Eq. 14) and rectified-flow
matching (SANA, Wan; as in diffusers' ``train_dreambooth_lora_sana.py``).

Equations: ``docs/training.md``, "Objectives".
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
    """A ``FlowMatchEulerDiscreteScheduler`` with the training sigma table (``shift`` applied; ``ValueError`` if ``<= 0``)."""
    if not shift > 0:
        raise ValueError(f"the flow-matching shift must be > 0; got {shift!r}")
    return FlowMatchEulerDiscreteScheduler(num_train_timesteps=int(num_train_timesteps), shift=float(shift))


class Objective:
    """The noising and the regression target of one objective, ``kind`` ``"epsilon"`` or ``"flow"``.

    ``scheduler``: ``DDPMScheduler``-like (epsilon) or :func:`flow_match_scheduler`'s table (flow). Flow
    only: ``timestep_sampling`` (``"logit_normal"``, ``"mode"``, ``"uniform"``) and its parameters,
    ``loss_weighting`` (``"none"``, ``"sigma_sqrt"``, ``"cosmap"``), ``timestep_range`` (``(low, high)``
    in transformer timestep units: Wan 2.2's experts).

    Raises:
        ValueError: unknown options; a ``timestep_range`` for epsilon or holding no timestep of the table.
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
        """One draw per sample ``[n]``: epsilon ``t`` (long), flow ``u`` in ``(0, 1)``."""
        if self.kind == "epsilon":
            return torch.randint(0, self.num_train_timesteps, (n,), generator=generator, device=device)
        return compute_density_for_timestep_sampling(
            self.timestep_sampling, n, logit_mean=self.logit_mean, logit_std=self.logit_std,
            mode_scale=self.mode_scale, device=device, generator=generator,
        )

    def evenly_spaced(self, index: torch.Tensor, n: int) -> torch.Tensor:
        """Deterministic held-out draws: epsilon ``t = round(i (T-1) / (n-1))``, flow ``u = (i + 0.5) / n``."""
        index = torch.as_tensor(index)
        if self.kind == "epsilon":
            t = [round(int(i) * (self.num_train_timesteps - 1) / max(n - 1, 1)) for i in index]
            return torch.tensor(t, dtype=torch.long, device=index.device)
        return (index.to(torch.float64) + 0.5) / n

    # -- noising and target -----------------------------------------------------------------------
    def inputs(
        self, latents: torch.Tensor, noise: torch.Tensor, draw: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """``(noisy, timesteps, target, weights)`` for clean ``latents``, same-shape ``noise`` and ``draw`` ``[B]``.

        ``timesteps`` as the transformer takes them; ``weights`` ``[B]`` or ``None``.
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
        """Mean squared error in fp32, per-sample weighted when ``weights`` ``[B]`` is given."""
        if weights is None:
            return F.mse_loss(pred.float(), target.float(), reduction="mean")
        per_sample = (pred.float() - target.float()).pow(2).reshape(pred.shape[0], -1).mean(dim=1)
        return (weights.float() * per_sample).mean()
