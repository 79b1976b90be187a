"""Wan VACE (``WanVACETransformer3DModel`` + ``WanVACEPipeline``): Wan with a control branch, video editing and
reference-to-video.

The model is Wan's main blocks plus VACE blocks (``vace_blocks``, 8 of them in the 14B model, one per
``vace_layers`` entry) that run first, on the control latents (reference video, mask, reference images) beside
the main tokens, and add their hints to the main blocks' outputs. Every block carries a ``WanAttention``
self-attention over the same token grid (the control tokens are zero-padded to the main token count), so MHLA may
take both kinds: layer numbers count the main blocks first, then the VACE blocks (``vace_blocks.i.attn1`` is layer
``num_layers + i``), and automatic selection sees both. Every cross-attention, the control patch embedding and
the hint path stay stock.

The :data:`WAN_VACE` entry is Wan's in everything else (RoPE, q/k norms, ``M = 105``, UMT5 prompts, Wan 2.2's
two experts), with its own context-parallel plan (diffusers gives this class none). Details:
``docs/families/wan-vace.md``.
"""

from __future__ import annotations

import torch

from mhla_diffusers.families.base import Family, GenerationError, grid_3d, register_family
from mhla_diffusers.families.wan import WAN, wan_native_video

__all__ = ["WAN_VACE", "vace_context_parallel_plan", "vace_calibration_control"]


def vace_context_parallel_plan(model) -> dict:
    """The ``cp_plan`` of a ``WanVACETransformer3DModel`` (diffusers' ``_cp_plan`` of Wan, extended to the VACE branch).

    The RoPE tables are split with the tokens; the first VACE block's main and control tokens and the first main
    block's tokens are split on entry (every later block receives shards); the output is gathered after
    ``proj_out``. The hints of the VACE blocks are shards of the same tokens as the main blocks' states they are
    added to. Text states are not split.
    """
    from diffusers.models._modeling_parallel import ContextParallelInput, ContextParallelOutput  # device-mesh imports

    tokens = ContextParallelInput(split_dim=1, expected_dims=3, split_output=False)
    tables = ContextParallelInput(split_dim=1, expected_dims=4, split_output=True)
    return {
        "rope": {0: tables, 1: tables},
        "vace_blocks.0": {"hidden_states": tokens, "control_hidden_states": tokens},
        "blocks.0": {"hidden_states": tokens},
        "proj_out": ContextParallelOutput(gather_dim=1, expected_dims=3),
    }


def vace_calibration_control(config, latent: torch.Tensor, draw) -> dict:
    """``{"control_hidden_states": [1, vace_in_channels, F, H, W]}`` of one calibration sample (``latent``: its
    ``[1, C, F, H, W]`` noisy latent; ``draw(shape)``: a smooth random ``[1, *shape]``).

    Laid out as ``WanVACEPipeline`` lays out a control latent for a whole-video control task (a control video, no
    region kept, no reference image): the inactive video latent (``C`` channels) zero (the pipeline would encode
    the masked-out, all-grey video there), the reactive one a smooth random latent standing in for the encoded
    control video, and the VAE's ``8 x 8`` mask folded into the remaining channels, all ones (generate
    everywhere). A config with ``vace_in_channels <= 2 C`` gets one smooth random latent of that many channels.
    """
    channels, z, grid = int(config.get("vace_in_channels") or 96), int(latent.shape[1]), tuple(latent.shape[2:])
    if channels <= 2 * z:
        return {"control_hidden_states": draw((channels, *grid))}
    inactive, mask = torch.zeros(1, z, *grid), torch.ones(1, channels - 2 * z, *grid)
    return {"control_hidden_states": torch.cat([inactive, draw((z, *grid)), mask], dim=1)}


def _no_image_to_video(pipe, checkpoint):
    """``Family.image_to_video``: always a ``GenerationError`` (VACE takes its first frame in its own inputs)."""
    raise GenerationError(
        f"{checkpoint} holds a {type(pipe).__name__}: Wan VACE takes no first frame (--image); give it as a reference "
        "image (--reference-image), or as the first frame of --video with a --mask black on it and white elsewhere"
    )


WAN_VACE = register_family(Family(
    name="wan_vace",
    display_name="Wan VACE",
    model_classes=("WanVACETransformer3DModel",),
    pipeline_classes=("WanVACEPipeline",),
    # two kinds, in layer order: the main blocks, then the VACE blocks
    self_attention=r"^(?:blocks\.(\d+)|vace_blocks\.(\d+))\.attn1$",
    patch_embed="patch_embedding",  # the main latent [B, C, F, H, W]; the control latent has the same grid
    grid_from_latent=grid_3d,
    reference_grid=WAN.reference_grid,
    stock_self_processor=WAN.stock_self_processor,
    cross_attention=r"^(?:blocks\.(\d+)|vace_blocks\.(\d+))\.attn2$",
    stock_cross_processor=WAN.stock_cross_processor,
    qk_norm_across_heads=True,
    attention_output_dtype="query",
    processor_call="positional",
    rotary=WAN.rotary,
    default_num_blocks=WAN.default_num_blocks,
    block_grid_presets=WAN.block_grid_presets,
    empty_blocks=True,
    output_norm_without_normalize=True,
    lepe_kernel=(3, 3, 3),
    conditioning="text",
    noise="flow",
    encode_prompts=WAN.encode_prompts,
    calibration_extras=vace_calibration_control,  # the forward needs control latents
    context_parallel="model",
    cp_plan=vace_context_parallel_plan,
    max_grid=WAN.max_grid,
    experts=WAN.experts,  # Wan 2.2 VACE pipelines: transformer / transformer_2 around boundary_ratio
    native_video=wan_native_video,
    image_to_video=_no_image_to_video,  # --image: a clear refusal naming VACE's own inputs
))
