"""Tiny, deterministic SANA-Video components for tests (offline, CPU): the transformer, its inputs and a
``SanaVideoPipeline`` over the tiny Gemma-2 text encoder (helpers_sana) and the tiny Wan VAE (helpers_wan).

Reuse from any test module::

    from helpers_sana_video import tiny_sana_video, sana_video_inputs, run_sana_video, tiny_sana_video_pipeline
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["tiny_sana_video", "sana_video_inputs", "run_sana_video", "tiny_sana_video_pipeline"]


def tiny_sana_video(
    num_layers: int = 2,
    heads: int = 2,
    head_dim: int = 12,
    in_channels: int = 4,
    caption_channels: int = 32,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    **config,
):
    """An eval-mode ``SanaVideoTransformer3DModel``: patch (1, 2, 2), 2 heads x 12 (RoPE split 4 / 4 / 4), q/k
    RMSNorms across heads, cross-attention 2 x 12 over 32-channel captions; ``config`` overrides any constructor
    argument. Weights from ``torch.manual_seed(seed)`` (the adaLN modulation drawn wide, std 0.2, so it matters);
    the global RNG is restored."""
    from diffusers import SanaVideoTransformer3DModel

    kwargs = dict(
        in_channels=in_channels,
        out_channels=in_channels,
        num_attention_heads=heads,
        attention_head_dim=head_dim,
        num_layers=num_layers,
        num_cross_attention_heads=heads,
        cross_attention_head_dim=head_dim,
        cross_attention_dim=heads * head_dim,
        caption_channels=caption_channels,
        patch_size=(1, 2, 2),
        sample_size=30,
        qk_norm="rms_norm_across_heads",
        rope_max_seq_len=32,
    )
    kwargs.update(config)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = SanaVideoTransformer3DModel(**kwargs)
        nn.init.normal_(model.time_embed.linear.weight, std=0.2)
    model.eval()
    return model if dtype == torch.float32 else model.to(dtype)


def sana_video_inputs(
    batch: int = 2,
    frames: int = 3,
    size: int | tuple[int, int] = (8, 12),
    in_channels: int = 4,
    caption_channels: int = 32,
    text_len: int = 6,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
):
    """``(latent [B, C, F, H, W], encoder_hidden_states [B, L, caption], timestep [B], encoder_attention_mask [B, L])``;
    tokens ``F x H/2 x W/2`` (default 3 x 4 x 6 = 72). The mask hides the last two text tokens of sample 0."""
    from helpers_sana import sana_inputs

    return sana_inputs(batch, size, in_channels, caption_channels, text_len, seed, dtype, frames=frames)


def run_sana_video(model, inputs) -> torch.Tensor:
    """The model's output sample for ``inputs`` from :func:`sana_video_inputs` (no grad)."""
    latent, text, timestep, mask = inputs
    with torch.no_grad():
        return model(latent, encoder_hidden_states=text, timestep=timestep, encoder_attention_mask=mask).sample


def tiny_sana_video_pipeline(num_layers: int = 2, seed: int = 0):
    """A ``SanaVideoPipeline`` from :func:`tiny_sana_video` (16 latent channels, the VAE's), the tiny Gemma-2 and
    tokenizer of helpers_sana, the tiny Wan VAE and SANA's flow DPM-Solver scheduler. 64 x 64 px, 5 frames:
    2 x 4 x 4 tokens. Call it with ``use_resolution_binning=False`` (binning maps tiny sizes to 480p bins)."""
    from diffusers import DPMSolverMultistepScheduler, SanaVideoPipeline
    from helpers_sana import tiny_gemma2, tiny_gemma_tokenizer
    from helpers_wan import tiny_wan_vae

    scheduler = DPMSolverMultistepScheduler(
        num_train_timesteps=1000, prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=8.0
    )
    pipe = SanaVideoPipeline(
        tokenizer=tiny_gemma_tokenizer(),
        text_encoder=tiny_gemma2(seed=seed),
        vae=tiny_wan_vae(seed=seed),
        transformer=tiny_sana_video(num_layers=num_layers, in_channels=16, seed=seed),
        scheduler=scheduler,
    )
    pipe.set_progress_bar_config(disable=True)
    return pipe
