"""Wan (``WanTransformer3DModel``: Wan 2.1 T2V / I2V, Wan 2.2 A14B experts and TI2V-5B): video, softmax attention.

The :data:`WAN` entry (positional processor calls, q/k norms across heads, 3D RoPE after the feature
map in the numerator only, default ``M = 105``, presets ``"paper"`` / ``"authors"``), native sizes, Wan
2.2's two experts, UMT5 prompt encoding, image-to-video, training and the model's own context-parallel
plan. Details: ``docs/families/index.md``.
"""

from __future__ import annotations

from typing import Sequence

import torch
from diffusers.models.transformers.transformer_wan import WanAttnProcessor

from mhla_diffusers.families.base import (
    Experts,
    Family,
    GenerationError,
    TrainingSpec,
    call_default,
    grid_3d,
    patch_of,
    pipeline_transformers,
    posterior_sample,
    register_family,
)
from mhla_diffusers.ops.rotary import InterleavedRotary

__all__ = [
    "WAN",
    "WanRotary",
    "WanTraining",
    "wan_native_video",
    "image_to_video_pipeline",
    "AUTHORS_BLOCK_GRID",
    "AUTHORS_NATIVE_SIZE",
    "rope_max_grid",
]

# Wan 2.1's native size: 81 frames at 480 x 832 px, VAE factors 4 (time) and 8 (space): a latent of
# 21 x 60 x 104, i.e. 21 x 30 x 52 tokens with patch (1, 2, 2). Wan 2.2 A14B (T2V, I2V) keeps that VAE.
WAN_NATIVE_LATENT = (21, 60, 104)
WAN_NATIVE_VIDEO = {"height": 480, "width": 832, "frames": 81}
# Wan 2.2 TI2V-5B: its own VAE (z_dim 48, factors 4 and 16), 121 frames at 704 x 1280 px (720p, 24 fps): a
# latent of 31 x 44 x 80, i.e. 31 x 22 x 40 = 27,280 tokens with patch (1, 2, 2).
WAN22_TI2V_LATENT_CHANNELS = 48
WAN22_TI2V_NATIVE_LATENT = (31, 44, 80)
WAN22_TI2V_NATIVE_VIDEO = {"height": 704, "width": 1280, "frames": 121}
# The authors' released Wan2.1-1.3B MHLA model (mhla_diffusers.checkpoint.authors): blocks (3, 5, 10) (their
# code's constructor default, M = 150), trained at 480 x 800 px, 81 frames (recorded in the imported config).
AUTHORS_BLOCK_GRID = (3, 5, 10)
AUTHORS_NATIVE_SIZE = {"height": 480, "width": 800, "frames": 81}


def wan_native_video(config) -> dict:
    """``{"height", "width", "frames"}`` (pixels, frames) a Wan transformer of ``config`` was trained at: Wan 2.2
    TI2V-5B (``out_channels`` 48, the z_dim 48 VAE) 704 x 1280 px, 121 frames; Wan 2.1 and 2.2 A14B 480 x 832 px,
    81 frames (the A14B experts also run 720p; 480p is the size both releases share)."""
    is_ti2v = config.get("out_channels") == WAN22_TI2V_LATENT_CHANNELS
    return dict(WAN22_TI2V_NATIVE_VIDEO if is_ti2v else WAN_NATIVE_VIDEO)


def _reference_grid_wan(config) -> tuple[int, int, int]:
    pt, ph, pw = patch_of(config)
    is_ti2v = config.get("out_channels") == WAN22_TI2V_LATENT_CHANNELS
    t, h, w = WAN22_TI2V_NATIVE_LATENT if is_ti2v else WAN_NATIVE_LATENT
    return (max(1, t // pt), max(1, h // ph), max(1, w // pw))


def rope_max_grid(config) -> tuple[int, int, int]:
    """diffusers' ``WanRotaryPosEmbed`` holds ``rope_max_seq_len`` positions per axis (default 1024): a token grid
    longer on an axis fails in the model's forward."""
    n = int(config.get("rope_max_seq_len") or 1024)
    return (n, n, n)


class WanRotary(InterleavedRotary):
    """Wan 2.1's 3D rotary embedding as a map on ``[B, heads, N, d]`` feature tensors.

    Exactly diffusers' ``apply_rotary_emb`` (interleaved pairs), as an :class:`~mhla_diffusers.ops.InterleavedRotary`;
    output in the input's dtype.

    Args:
        rotary_emb: ``(freqs_cos, freqs_sin)``, float, ``(1, N, 1, d)`` each, as ``WanTransformer3DModel.rope`` returns.

    Raises:
        ValueError: not such a pair, or (when called) token count or head dim not matching the tables.
    """

    def __init__(self, rotary_emb):
        if not (isinstance(rotary_emb, (tuple, list)) and len(rotary_emb) == 2):
            raise ValueError("Wan's rotary_emb must be a pair (freqs_cos, freqs_sin) of tensors of shape (1, N, 1, d)")
        cos, sin = rotary_emb
        if (
            not isinstance(cos, torch.Tensor) or not isinstance(sin, torch.Tensor)
            or cos.ndim != 4 or cos.shape != sin.shape or cos.shape[0] != 1 or cos.shape[2] != 1 or cos.shape[-1] % 2
        ):
            raise ValueError(
                f"Wan's rotary_emb tensors must have shape (1, N, 1, d) with even d; got "
                f"{tuple(getattr(cos, 'shape', ()))}, {tuple(getattr(sin, 'shape', ()))}"
            )
        # (1, N, 1, d) -> (N, d / 2)
        super().__init__(cos[0, :, 0, 0::2], sin[0, :, 0, 1::2])


def _encode(pipe, prompts, device, max_sequence_length):
    """``embeds [B, L, D]`` of ``prompts`` through ``WanPipeline.encode_prompt`` (no CFG)."""
    embeds, _ = pipe.encode_prompt(
        list(prompts), do_classifier_free_guidance=False, device=device, max_sequence_length=max_sequence_length,
    )
    return embeds


def _encode_wan(pipe, prompts: list, device) -> dict:
    """Wan: ``{"encoder_hidden_states" [B, L, D]}`` (UMT5, zero rows after each prompt's tokens, the
    pipeline's default sequence length, as ``WanPipeline.__call__``)."""
    return {"encoder_hidden_states": _encode(pipe, prompts, device, call_default(pipe, "max_sequence_length") or 512)}


def _wan_attn_processor():
    return WanAttnProcessor()


def _expert_timestep_range(pipe, expert: str) -> tuple[float, float] | None:
    """Wan 2.2 A14B: ``transformer`` on ``t >= boundary_ratio * T``, ``transformer_2`` below; ``None`` without ``boundary_ratio``."""
    boundary_ratio = getattr(pipe, "config", {}).get("boundary_ratio")
    if boundary_ratio is None:
        return None
    boundary = float(boundary_ratio) * int(pipe.scheduler.config.get("num_train_timesteps", 1000))
    return (boundary, float("inf")) if expert == "transformer" else (float("-inf"), boundary)


def image_to_video_pipeline(pipe, checkpoint="the pipeline"):
    """The image-to-video form of a Wan pipeline, sharing its components.

    A ``WanImageToVideoPipeline`` is returned as is; a TI2V-5B ``WanPipeline`` (``expand_timesteps``)
    becomes one over the same components and config.

    Raises:
        GenerationError: a text-to-video pipeline, or an I2V one missing its image encoder.
    """
    from diffusers import WanImageToVideoPipeline, WanPipeline  # pipelines: only when generating

    config = getattr(pipe, "config", {})
    name = type(pipe).__name__
    if isinstance(pipe, WanImageToVideoPipeline):
        transformers = pipeline_transformers(pipe)
        needs_encoder = any(t.config.get("image_dim") for t in transformers.values())
        if needs_encoder and (pipe.image_encoder is None or pipe.image_processor is None):
            raise GenerationError(
                f"{checkpoint}: its transformer reads CLIP image features (image_dim set) but the pipeline has no "
                "image_encoder / image_processor; use the complete Wan image-to-video checkpoint"
            )
        return pipe
    if isinstance(pipe, WanPipeline) and config.get("expand_timesteps"):
        i2v = WanImageToVideoPipeline(
            **pipe.components, boundary_ratio=config.get("boundary_ratio"), expand_timesteps=True
        )
        i2v.set_progress_bar_config(**getattr(pipe, "_progress_bar_config", {}))
        return i2v
    raise GenerationError(
        f"{checkpoint} holds a {name} that cannot take an image (text-to-video only); --image needs an image-to-video "
        "checkpoint: Wan 2.1 I2V, Wan 2.2 I2V A14B (WanImageToVideoPipeline) or Wan 2.2 TI2V-5B"
    )


class WanTraining(TrainingSpec):
    """Text-to-video Wan 2.1 (``WanTransformer3DModel`` + ``WanPipeline``): flow matching (the
    authors' recipe: shift 3 from the pipeline's scheduler, logit-normal timesteps), UMT5 captions
    through ``encode_prompt`` (zero-padded to ``max_sequence_length``, 512 by default), latents of
    ``AutoencoderKLWan`` normalised with its ``latents_mean`` / ``latents_std`` (the inverse of what
    ``WanPipeline`` does before decoding). Images (photos, folders) train as one-frame videos."""

    recipe_name = "WanRecipe"
    condition_keys = {"prompt_embeds": "encoder_hidden_states"}

    def finish_load(self, parts, config: dict) -> None:
        """Wan 2.2 A14B trains the expert ``model.expert``, TI2V-5B as text-to-video; image-to-video refused.

        Raises:
            ValueError: a transformer whose ``in_channels`` is not the VAE's ``z_dim`` (Wan I2V: 36 = 16 + 4 + 16).
        """
        z_dim, channels = int(parts.vae.config.z_dim), int(parts.transformer.config.in_channels)
        if channels != z_dim:
            raise ValueError(
                f"{config['model']['pretrained']}: the {parts.expert} takes {channels} input channels, the VAE gives {z_dim}: an "
                "image-to-video model (noise + mask + first-frame latent); this trainer fine-tunes text-to-video Wan models"
            )

    def encode_latents(self, vae, pixels, generator=None, *, rank=0, world_size=1):
        """Normalised video latents ``[B, z, F', H/8, W/8]`` (``pixels`` ``[B, 3, F, H, W]`` or images
        ``[B, 3, H, W]``); the posterior sample is drawn for the global batch (:func:`posterior_sample`)."""
        if pixels.ndim == 4:
            pixels = pixels.unsqueeze(2)
        z = posterior_sample(vae.encode(pixels.to(vae.dtype)).latent_dist, generator, rank=rank, world_size=world_size).float()
        shape = (1, vae.config.z_dim) + (1,) * (z.ndim - 2)
        mean = torch.tensor(vae.config.latents_mean, device=z.device, dtype=z.dtype).view(shape)
        std = torch.tensor(vae.config.latents_std, device=z.device, dtype=z.dtype).view(shape)
        return (z - mean) / std

    def encode_text(self, parts, captions: Sequence[str], device) -> dict:
        """``{"prompt_embeds" [B, L, D]}`` (zero rows after each caption's tokens), no grad."""
        with torch.no_grad():
            embeds = _encode(parts.pipeline, captions, device, int(parts.text["max_sequence_length"]))
        return {"prompt_embeds": embeds}

    def predict(self, model, noisy, timesteps, cond):
        """The velocity prediction ``v = noise - x0``."""
        return model(hidden_states=noisy, timestep=timesteps, encoder_hidden_states=cond["encoder_hidden_states"], return_dict=False)[0]


WAN = register_family(Family(
    name="wan",
    display_name="Wan",
    model_classes=("WanTransformer3DModel",),  # text-to-video and image-to-video (image_dim set)
    pipeline_classes=("WanPipeline", "WanImageToVideoPipeline"),
    self_attention=r"^blocks\.(\d+)\.attn1$",
    patch_embed="patch_embedding",  # Conv3d(latent [B, C, F, H, W]); tokens f*H*W + h*W + w
    grid_from_latent=grid_3d,
    # 21 x 30 x 52 (81 frames, 480 x 832 px) for patch (1, 2, 2); Wan 2.2 TI2V-5B 31 x 22 x 40 (121 frames, 704 x 1280)
    reference_grid=_reference_grid_wan,
    stock_self_processor=_wan_attn_processor,
    cross_attention=r"^blocks\.(\d+)\.attn2$",
    stock_cross_processor=_wan_attn_processor,
    qk_norm_across_heads=True,  # WanAttnProcessor: norm_q / norm_k on [B, N, heads * d]
    attention_output_dtype="query",  # .type_as(query)
    processor_call="positional",
    rotary=WanRotary,
    attention_classes=("WanAttention",),
    default_num_blocks=105,  # the paper's M = 105: (3, 5, 7) on 21 x 30 x 52
    block_grid_presets=(("paper", (3, 5, 7)), ("authors", AUTHORS_BLOCK_GRID)),
    empty_blocks=True,
    output_norm_without_normalize=True,
    lepe_kernel=(3, 3, 3),  # LePE: a 3 x 3 x 3 depthwise Conv3d over (T, H, W), as the authors' video layer
    conditioning="text",
    noise="flow",
    encode_prompts=_encode_wan,
    context_parallel="model",  # WanTransformer3DModel._cp_plan: split at blocks.0 (RoPE with it), gathered after proj_out
    max_grid=rope_max_grid,
    experts=Experts(components=("transformer", "transformer_2"), timestep_range=_expert_timestep_range),
    native_video=wan_native_video,
    image_to_video=image_to_video_pipeline,
    training=WanTraining(),
))
