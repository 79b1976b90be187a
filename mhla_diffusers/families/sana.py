"""SANA (``SanaTransformer2DModel`` + ``SanaPipeline``): text-to-image, ReLU linear self-attention.

The :data:`SANA` entry (stock eps 1e-15, q/k norms across heads, fp16 output clip), Gemma-2 prompt
encoding, flow-matching training and the ``"layers"`` context-parallel plan (the feed-forward's 3x3
convolution mixes tokens). Details: ``docs/families/index.md``.
"""

from __future__ import annotations

from typing import Sequence

import torch
from diffusers.models.attention_processor import SanaLinearAttnProcessor2_0
from diffusers.models.transformers.sana_transformer import SanaAttnProcessor2_0

from mhla_diffusers.families.base import Family, TrainingSpec, call_default, grid_2d, reference_grid_2d, register_family

__all__ = ["SANA", "SanaTraining", "encode_sana_prompts"]


def _encode(pipe, prompts, device, max_sequence_length, complex_human_instruction):
    """``(embeds [B, L, D], mask [B, L])`` of ``prompts`` through ``SanaPipeline.encode_prompt`` (no CFG)."""
    embeds, mask, _, _ = pipe.encode_prompt(
        list(prompts), do_classifier_free_guidance=False, device=device, clean_caption=False,
        max_sequence_length=max_sequence_length, complex_human_instruction=complex_human_instruction,
    )
    return embeds, mask


def encode_sana_prompts(pipe, prompts: list, device) -> dict:
    """SANA: ``{"encoder_hidden_states" [B, L, D], "encoder_attention_mask" [B, L]}`` (Gemma-2, with the
    pipeline's default complex human instruction and sequence length, as ``SanaPipeline.__call__``)."""
    embeds, mask = _encode(
        pipe, prompts, device, call_default(pipe, "max_sequence_length") or 300, call_default(pipe, "complex_human_instruction")
    )
    return {"encoder_hidden_states": embeds, "encoder_attention_mask": mask}


def _sana_linear_attn_processor():
    return SanaLinearAttnProcessor2_0()


def _sana_attn_processor():
    return SanaAttnProcessor2_0()


class SanaTraining(TrainingSpec):
    """Text-to-image SANA (``SanaTransformer2DModel`` + ``SanaPipeline``): flow matching (target
    ``noise - x0``), captions encoded by the pipeline's ``encode_prompt`` (Gemma-2, with the
    complex human instruction as at inference unless ``model.text`` says otherwise), caption dropout
    to the empty caption; exported as the same pipeline (its text encoder, vae and sampler)."""

    recipe_name = "SanaRecipe"
    condition_keys = {"prompt_embeds": "encoder_hidden_states", "prompt_attention_mask": "encoder_attention_mask"}

    def finish_load(self, parts, config: dict) -> None:
        """``complex_human_instruction: default`` becomes the pipeline's own."""
        if parts.text["complex_human_instruction"] == "default":
            parts.text["complex_human_instruction"] = call_default(parts.pipeline, "complex_human_instruction")

    def encode_text(self, parts, captions: Sequence[str], device) -> dict:
        """``{"prompt_embeds" [B, L, D], "prompt_attention_mask" [B, L]}`` of ``captions`` (no grad)."""
        with torch.no_grad():
            embeds, mask = _encode(
                parts.pipeline, captions, device, int(parts.text["max_sequence_length"]), parts.text["complex_human_instruction"]
            )
        return {"prompt_embeds": embeds, "prompt_attention_mask": mask}

    def predict(self, model, noisy, timesteps, cond):
        """The velocity prediction ``v = noise - x0``."""
        return model(
            noisy, encoder_hidden_states=cond["encoder_hidden_states"], encoder_attention_mask=cond["encoder_attention_mask"],
            timestep=timesteps, return_dict=False,
        )[0]


SANA = register_family(Family(
    name="sana",
    display_name="SANA",
    model_classes=("SanaTransformer2DModel",),
    pipeline_classes=("SanaPipeline",),
    self_attention=r"^transformer_blocks\.(\d+)\.attn1$",
    patch_embed="patch_embed",  # PatchEmbed(latent [B, C, H, W]); tokens (H / p) x (W / p), row-major
    grid_from_latent=grid_2d,
    reference_grid=reference_grid_2d,  # sample_size 32, patch 1 -> 32 x 32 (1024 px); 16 -> 512 px
    stock_self_processor=_sana_linear_attn_processor,
    default_eps=1e-15,
    cross_attention=r"^transformer_blocks\.(\d+)\.attn2$",
    stock_cross_processor=_sana_attn_processor,
    qk_norm_across_heads=True,
    attention_output_dtype="input",
    fp16_output_clip=65504.0,
    empty_blocks=True,  # e.g. 64 x 1024 px without binning: 2 x 32 tokens under 4 x 4 blocks
    stock_attention="linear",
    conditioning="text",
    noise="flow",
    encode_prompts=encode_sana_prompts,
    context_parallel="layers",  # GLUMBConv: a 3x3 depthwise convolution over the token grid in every block
    training=SanaTraining(),
))
