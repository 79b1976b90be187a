"""SANA-Video (``SanaVideoTransformer3DModel`` + ``SanaVideoPipeline`` / ``SanaImageToVideoPipeline``): video, ReLU
linear self-attention with RoPE.

Its stock self-attention, diffusers' ``SanaLinearAttnProcessor3_0``, is MHLA with one block in Wan's RoPE form:
``phi = ReLU`` after the across-heads q/k RMSNorms, the 3D RoPE (Wan's table and pair convention) turning
``phi(q)``, ``phi(k)`` in the numerator only, the un-rotated features in the denominator, eps 1e-15, the output
cast to the layer input's dtype (no float16 clip). So ``MHLAProcessor(num_blocks=1)`` is the stock layer, and
``M > 1`` on the spatiotemporal block grid is the paper's upgrade of a linear-attention video model.

The :data:`SANA_VIDEO` entry reuses SANA's Gemma-2 prompt encoding and Wan's RoPE map and latent normalisation;
the context-parallel plan splits each MHLA layer alone (``"layers"``: the feed-forward's convolutions mix
tokens over space and time). Details: ``docs/families/sana-video.md``.
"""

from __future__ import annotations

from diffusers.models.transformers.transformer_sana_video import SanaAttnProcessor2_0, SanaLinearAttnProcessor3_0

from mhla_diffusers.families.base import Family, GenerationError, grid_3d, patch_of, register_family
from mhla_diffusers.families.sana import SanaTraining, encode_sana_prompts
from mhla_diffusers.families.wan import WAN_NATIVE_LATENT, WanRotary, WanTraining, rope_max_grid

__all__ = ["SANA_VIDEO", "SanaVideoTraining", "sana_video_native_video", "image_to_video_pipeline"]

# SanaVideoPipeline's defaults: 81 frames at 480 x 832 px; with its Wan 2.1 VAE (factors 4 and 8) a latent of
# 21 x 60 x 104, i.e. 21 x 30 x 52 tokens with patch (1, 2, 2), Wan 2.1's grid.
SANA_VIDEO_NATIVE_VIDEO = {"height": 480, "width": 832, "frames": 81}


def sana_video_native_video(config) -> dict:
    """``{"height", "width", "frames"}`` SANA-Video generates by default (its pipelines' defaults: 480 x 832 px, 81 frames)."""
    return dict(SANA_VIDEO_NATIVE_VIDEO)


def _reference_grid(config) -> tuple[int, int, int]:
    """The token grid of the native size: the 21 x 60 x 104 latent over the patch."""
    pt, ph, pw = patch_of(config)
    t, h, w = WAN_NATIVE_LATENT
    return (max(1, t // pt), max(1, h // ph), max(1, w // pw))


def image_to_video_pipeline(pipe, checkpoint="the pipeline"):
    """The image-to-video form of a SANA-Video pipeline: a ``SanaImageToVideoPipeline`` as is; a
    ``SanaVideoPipeline`` becomes one over the same components (the first frame is its latent's first frame).

    Raises:
        GenerationError: another pipeline class.
    """
    from diffusers import SanaImageToVideoPipeline, SanaVideoPipeline  # pipelines: only when generating

    if isinstance(pipe, SanaImageToVideoPipeline):
        return pipe
    if isinstance(pipe, SanaVideoPipeline):
        i2v = SanaImageToVideoPipeline(**pipe.components)
        i2v.set_progress_bar_config(**getattr(pipe, "_progress_bar_config", {}))
        return i2v
    raise GenerationError(f"{checkpoint} holds a {type(pipe).__name__}, not a SANA-Video pipeline")


class SanaVideoTraining(SanaTraining):
    """Text-to-video SANA-Video (``SanaVideoTransformer3DModel`` + ``SanaVideoPipeline``): SANA's recipe (flow
    matching, target ``noise - x0``; Gemma-2 captions through ``encode_prompt`` with the pipeline's complex human
    instruction; caption dropout) on video latents of its ``AutoencoderKLWan``, normalised with ``latents_mean`` /
    ``latents_std`` as the pipeline undoes before decoding. Images train as one-frame videos."""

    recipe_name = "SanaVideoRecipe"
    encode_latents = WanTraining.encode_latents

    def finish_load(self, parts, config: dict) -> None:
        """SANA's, and the VAE must be the Wan one (``latents_mean`` / ``latents_std`` in its config).

        Raises:
            ValueError: another VAE (SANA-Video's LTX-2 or DC-AE variants are not trained here).
        """
        super().finish_load(parts, config)
        vae_config = parts.vae.config
        if vae_config.get("latents_mean") is None or vae_config.get("z_dim") is None:
            raise ValueError(
                f"{config['model']['pretrained']}: its VAE is a {type(parts.vae).__name__}; the SANA-Video recipe trains "
                "with the Wan VAE (AutoencoderKLWan, SANA-Video 2B 480p)"
            )


def _sana_video_linear_attn_processor():
    return SanaLinearAttnProcessor3_0()


def _sana_video_attn_processor():
    return SanaAttnProcessor2_0()


SANA_VIDEO = register_family(Family(
    name="sana_video",
    display_name="SANA-Video",
    model_classes=("SanaVideoTransformer3DModel",),
    pipeline_classes=("SanaVideoPipeline", "SanaImageToVideoPipeline"),
    self_attention=r"^transformer_blocks\.(\d+)\.attn1$",
    patch_embed="patch_embedding",  # Conv3d(latent [B, C, F, H, W]); tokens f*H*W + h*W + w
    grid_from_latent=grid_3d,
    reference_grid=_reference_grid,  # 21 x 30 x 52 (81 frames, 480 x 832 px) for patch (1, 2, 2)
    stock_self_processor=_sana_video_linear_attn_processor,
    default_eps=1e-15,  # SanaLinearAttnProcessor3_0's
    cross_attention=r"^transformer_blocks\.(\d+)\.attn2$",
    stock_cross_processor=_sana_video_attn_processor,
    qk_norm_across_heads=True,  # rms_norm_across_heads on [B, N, heads * d]
    attention_output_dtype="input",  # .to(original_dtype), the layer input's
    rotary=WanRotary,  # rotary_emb: (cos, sin) of shape (1, N, 1, d), Wan's WanRotaryPosEmbed
    rotary_required=True,  # SanaLinearAttnProcessor3_0 fails without it
    empty_blocks=True,
    lepe_kernel=(3, 3, 3),
    stock_attention="linear",
    conditioning="text",
    noise="flow",
    encode_prompts=encode_sana_prompts,  # SanaVideoPipeline.encode_prompt takes SanaPipeline's arguments
    context_parallel="layers",  # GLUMBTempConv: 3x3 depthwise convolutions over (H, W) and a (3, 1) one over time
    max_grid=rope_max_grid,  # WanRotaryPosEmbed's rope_max_seq_len per axis
    native_video=sana_video_native_video,
    image_to_video=image_to_video_pipeline,
    training=SanaVideoTraining(),
))
