"""An exact, parameter-free "autoencoder" with the diffusers VAE interface: space-to-depth.

``latents [B, C*f*f, H/f, W/f] <-> pixels [B, C, H, W]``, bitwise exact; ``scaling_factor`` is not
applied by ``encode`` / ``decode`` (the diffusers convention). See ``docs/training.md``.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F
from diffusers.configuration_utils import ConfigMixin, register_to_config
from diffusers.models.autoencoders.vae import DecoderOutput
from diffusers.models.modeling_outputs import AutoencoderKLOutput
from diffusers.models.modeling_utils import ModelMixin
from diffusers.utils import SAFETENSORS_WEIGHTS_NAME
from safetensors.torch import save_file

from mhla_diffusers.checkpoint.io import atomic_output

__all__ = ["SpaceToDepthAutoencoder", "PointLatentDistribution", "vae_scale_factor"]


class PointLatentDistribution:
    """A deterministic posterior with all its mass on ``mean`` ``[B, C*f*f, H/f, W/f]``.

    ``sample(generator)`` and ``mode()`` return ``mean``; ``std``, ``var`` and ``kl()`` are zeros.
    """

    deterministic = True

    def __init__(self, mean: torch.Tensor):
        self.mean = mean

    @property
    def std(self) -> torch.Tensor:
        return torch.zeros_like(self.mean)

    @property
    def var(self) -> torch.Tensor:
        return torch.zeros_like(self.mean)

    def sample(self, generator: torch.Generator | None = None) -> torch.Tensor:
        return self.mean

    def mode(self) -> torch.Tensor:
        return self.mean

    def kl(self, other=None) -> torch.Tensor:
        return torch.zeros(self.mean.shape[0], dtype=self.mean.dtype, device=self.mean.device)


class SpaceToDepthAutoencoder(ModelMixin, ConfigMixin):
    """Exact, parameter-free autoencoder: ``pixel_unshuffle`` by ``factor`` to encode, ``pixel_shuffle`` to decode.

    A drop-in ``vae`` for ``DiTPipeline``; ``import mhla_diffusers`` before ``from_pretrained`` of a
    pipeline that names it. ``scaling_factor`` is recorded, not applied.

    Raises:
        ValueError: a non-positive ``factor``, ``in_channels`` or ``scaling_factor``.
    """

    _supports_gradient_checkpointing = False

    @register_to_config
    def __init__(self, factor: int = 2, in_channels: int = 3, scaling_factor: float = 1.0):
        super().__init__()
        if int(factor) != factor or factor < 1:
            raise ValueError(f"factor must be a positive integer; got {factor!r}")
        if int(in_channels) != in_channels or in_channels < 1:
            raise ValueError(f"in_channels must be a positive integer; got {in_channels!r}")
        if not scaling_factor > 0:
            raise ValueError(f"scaling_factor must be > 0; got {scaling_factor!r}")
        # An empty, non-persistent buffer: gives the module a device and dtype (pipelines ask for
        # them) without adding anything to the state dict.
        self.register_buffer("_anchor", torch.zeros(0), persistent=False)

    def save_pretrained(self, save_directory, is_main_process: bool = True, variant: str | None = None, **kwargs):
        """``ModelMixin.save_pretrained`` plus an empty weights file, so ``from_pretrained`` accepts the folder."""
        super().save_pretrained(save_directory, is_main_process=is_main_process, variant=variant, **kwargs)
        if not is_main_process:
            return
        name = SAFETENSORS_WEIGHTS_NAME
        if variant is not None:
            stem, ext = name.rsplit(".", 1)
            name = f"{stem}.{variant}.{ext}"
        path = os.path.join(save_directory, name)
        if not os.path.exists(path):
            with atomic_output(path) as tmp:
                save_file({}, str(tmp), metadata={"format": "pt"})

    @property
    def latent_channels(self) -> int:
        return self.config.in_channels * self.config.factor**2

    def _check(self, x: torch.Tensor, channels: int, what: str, divisible: bool) -> None:
        if not torch.is_tensor(x) or x.dim() != 4:
            raise ValueError(f"{what} must be a 4-D tensor [B, {channels}, H, W]; got {getattr(x, 'shape', type(x))}")
        if x.shape[1] != channels:
            raise ValueError(
                f"{what} must have {channels} channels (in_channels={self.config.in_channels}, "
                f"factor={self.config.factor}); got shape {tuple(x.shape)}"
            )
        f = self.config.factor
        if divisible and (x.shape[-2] % f or x.shape[-1] % f):
            raise ValueError(
                f"image height and width must be divisible by factor={f}; got {tuple(x.shape[-2:])}. "
                f"Crop or resize the image to a multiple of {f}."
            )

    def encode(self, x: torch.Tensor, return_dict: bool = True) -> AutoencoderKLOutput | tuple:
        """Fold ``x`` ``[B, C, H, W]`` into ``z`` ``[B, C*f*f, H/f, W/f]``: ``AutoencoderKLOutput(latent_dist=PointLatentDistribution(z))``.

        Unscaled, in ``x``'s dtype and device; a 1-tuple if not ``return_dict``.

        Raises:
            ValueError: wrong rank or channel count, or ``H``, ``W`` not divisible by ``factor``.
        """
        self._check(x, self.config.in_channels, "encode input", divisible=True)
        z = F.pixel_unshuffle(x, self.config.factor)
        dist = PointLatentDistribution(z)
        if not return_dict:
            return (dist,)
        return AutoencoderKLOutput(latent_dist=dist)

    def decode(self, z: torch.Tensor, return_dict: bool = True, generator=None) -> DecoderOutput | tuple:
        """``DecoderOutput(sample=x)``: ``z`` ``[B, C*f*f, h, w]`` unfolded into ``x`` ``[B, C, h*f, w*f]`` (no clamping).

        ``ValueError`` for a wrong rank or channel count.
        """
        self._check(z, self.latent_channels, "decode input", divisible=False)
        x = F.pixel_shuffle(z, self.config.factor)
        if not return_dict:
            return (x,)
        return DecoderOutput(sample=x)

    def forward(self, sample: torch.Tensor, return_dict: bool = True) -> DecoderOutput | tuple:
        """Encode then decode ``[B, C, H, W]``: exactly the identity."""
        z = self.encode(sample).latent_dist.mode()
        return self.decode(z, return_dict=return_dict)


def vae_scale_factor(vae) -> int:
    """Pixels per latent pixel: ``config.factor``, or ``2 ** (len(block_out_channels) - 1)`` for ``AutoencoderKL``."""
    if "factor" in vae.config:
        return int(vae.config.factor)
    return 2 ** (len(vae.config.block_out_channels) - 1)
