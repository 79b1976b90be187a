"""An exact, parameter-free "autoencoder" with the diffusers VAE interface: space-to-depth.

No pretrained VAE can be downloaded offline, yet a latent-diffusion pipeline such as
:class:`diffusers.DiTPipeline` needs a ``vae`` with ``encode(x).latent_dist`` and
``decode(z).sample``. :class:`SpaceToDepthAutoencoder` folds every ``f x f`` pixel patch into
channels (``torch.nn.functional.pixel_unshuffle``) and back (``pixel_shuffle``): the round trip is
bitwise exact, it has no weights, and generated latents are real pixels you can look at.

    latents [B, C*f*f, H/f, W/f]  <->  pixels [B, C, H, W] in [-1, 1]

Like a diffusers VAE it does *not* apply ``scaling_factor`` itself: training multiplies the
encoded latents by ``vae.config.scaling_factor`` and pipelines divide by it before ``decode``.
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
    """A deterministic "posterior": all its mass on ``mean`` (what ``encode(x).latent_dist`` returns).

    Offers what diffusers code uses of ``DiagonalGaussianDistribution``: ``sample(generator)``
    and ``mode()`` (both return ``mean`` itself, no noise, the generator is not consumed),
    ``mean``, ``std`` / ``var`` (zeros), ``kl()`` (zeros).

    Args:
        mean: the latents, ``[B, C*f*f, H/f, W/f]``, any floating dtype.
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
        """The latents (deterministic; ``generator`` is accepted for interface compatibility and unused)."""
        return self.mean

    def mode(self) -> torch.Tensor:
        """The latents."""
        return self.mean

    def kl(self, other=None) -> torch.Tensor:
        """Zeros ``[B]`` (a point mass has no KL term to train)."""
        return torch.zeros(self.mean.shape[0], dtype=self.mean.dtype, device=self.mean.device)


class SpaceToDepthAutoencoder(ModelMixin, ConfigMixin):
    """Exact, parameter-free autoencoder: ``pixel_unshuffle`` to encode, ``pixel_shuffle`` to decode.

    Drop-in ``vae`` for :class:`diffusers.DiTPipeline` (and any code that calls
    ``vae.encode(x).latent_dist.sample()`` / ``vae.decode(z).sample`` / ``vae.config.scaling_factor``).
    It has no parameters and no persistent buffers, so ``save_pretrained`` writes its config and an
    empty weights file; ``from_pretrained`` and ``DiffusionPipeline.from_pretrained`` load it
    offline. ``model_index.json`` names its module (``["mhla_diffusers.autoencoder",
    "SpaceToDepthAutoencoder"]``) and diffusers 0.42 only resolves modules that are already imported:
    ``import mhla_diffusers`` before ``DiTPipeline.from_pretrained`` (else diffusers raises a
    ``ValueError`` saying so); :func:`mhla_diffusers.load_mhla_pipeline` does it for you.

    Args:
        factor: spatial downsampling ``f`` (int >= 1). Latent channels are ``in_channels * f * f``.
        in_channels: image channels ``C`` (3 for RGB).
        scaling_factor: multiply encoded latents by this before diffusion (the diffusers
            convention: roughly ``1 / std`` of the latents; for pixels in ``[-1, 1]`` of natural
            photos about 2). Not applied by ``encode`` / ``decode`` themselves.

    Raises:
        ValueError: for a non-positive ``factor`` / ``in_channels`` or a non-positive ``scaling_factor``.
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
        """``ModelMixin.save_pretrained`` plus an empty ``diffusion_pytorch_model[.variant].safetensors``.

        diffusers writes no weights file for a model without tensors, and its ``from_pretrained``
        then refuses the folder; the empty safetensors file (written atomically) makes the folder
        loadable by ``from_pretrained`` and ``DiffusionPipeline.from_pretrained``.
        """
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
        """Channels of the latents: ``in_channels * factor**2``."""
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
        """Fold ``f x f`` pixel patches into channels.

        Args:
            x: images ``[B, C, H, W]``, any floating dtype, by convention in ``[-1, 1]``;
                ``H`` and ``W`` divisible by ``factor``.
            return_dict: return an ``AutoencoderKLOutput`` (else a 1-tuple), as diffusers VAEs do.

        Returns:
            ``AutoencoderKLOutput(latent_dist=PointLatentDistribution(z))`` with
            ``z`` ``[B, C*f*f, H/f, W/f]``, same dtype / device as ``x`` (unscaled).

        Raises:
            ValueError: wrong rank / channel count, or ``H``, ``W`` not divisible by ``factor``.
        """
        self._check(x, self.config.in_channels, "encode input", divisible=True)
        z = F.pixel_unshuffle(x, self.config.factor)
        dist = PointLatentDistribution(z)
        if not return_dict:
            return (dist,)
        return AutoencoderKLOutput(latent_dist=dist)

    def decode(self, z: torch.Tensor, return_dict: bool = True, generator=None) -> DecoderOutput | tuple:
        """Unfold channels back into ``f x f`` pixel patches (exact inverse of :meth:`encode`).

        Args:
            z: latents ``[B, C*f*f, h, w]`` (already divided by ``scaling_factor``).
            return_dict: return a ``DecoderOutput`` (else a 1-tuple), as diffusers VAEs do.
            generator: ignored (interface compatibility).

        Returns:
            ``DecoderOutput(sample=x)`` with ``x`` ``[B, C, h*f, w*f]``; no clamping.

        Raises:
            ValueError: wrong rank or channel count.
        """
        self._check(z, self.latent_channels, "decode input", divisible=False)
        x = F.pixel_shuffle(z, self.config.factor)
        if not return_dict:
            return (x,)
        return DecoderOutput(sample=x)

    def forward(self, sample: torch.Tensor, return_dict: bool = True) -> DecoderOutput | tuple:
        """Encode then decode (the identity, exactly). ``sample``: ``[B, C, H, W]``."""
        z = self.encode(sample).latent_dist.mode()
        return self.decode(z, return_dict=return_dict)


def vae_scale_factor(vae) -> int:
    """Pixels per latent pixel of ``vae``: ``config.factor`` (:class:`SpaceToDepthAutoencoder`) or
    ``2 ** (levels - 1)`` (diffusers' ``AutoencoderKL``, ``levels = len(config.block_out_channels)``)."""
    if "factor" in vae.config:
        return int(vae.config.factor)
    return 2 ** (len(vae.config.block_out_channels) - 1)
