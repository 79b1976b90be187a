"""Tiny, deterministic Wan VACE components for tests (offline, CPU): the transformer, its inputs and a
``WanVACEPipeline`` over the tiny UMT5 and Wan VAE of helpers_wan.

Reuse from any test module::

    from helpers_wan_vace import tiny_wan_vace, wan_vace_inputs, run_wan_vace, tiny_wan_vace_pipeline
"""

from __future__ import annotations

import re

import torch

__all__ = ["tiny_wan_vace", "wan_vace_inputs", "run_wan_vace", "tiny_wan_vace_pipeline", "original_wan_vace_state_dict",
           "VACE_IN_CHANNELS"]

# the control latent's channels with the tiny Wan VAE (z_dim 16, spatial factor 8): inactive and reactive video
# latents (2 x 16) and the 8 x 8 mask folded into channels (64), as WanVACEPipeline builds them
VACE_IN_CHANNELS = 96


def tiny_wan_vace(
    num_layers: int = 3,
    vace_layers: tuple[int, ...] = (0, 2),
    heads: int = 2,
    head_dim: int = 12,
    text_dim: int = 32,
    ffn_dim: int = 32,
    in_channels: int = 16,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    **config,
):
    """An eval-mode ``WanVACETransformer3DModel`` with helpers_wan's tiny Wan sizes, ``num_layers`` main blocks and
    one VACE block per ``vace_layers`` entry (self-attention layers: the main ones, then the VACE ones). Weights from
    ``torch.manual_seed(seed)``; the global RNG is restored."""
    from diffusers import WanVACETransformer3DModel
    from helpers_wan import tiny_wan_config

    kwargs = dict(tiny_wan_config(num_layers, heads, head_dim, text_dim, ffn_dim, in_channels),
                  vace_layers=list(vace_layers), vace_in_channels=VACE_IN_CHANNELS)
    kwargs.update(config)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = WanVACETransformer3DModel(**kwargs)
    model.eval()
    return model if dtype == torch.float32 else model.to(dtype)


def wan_vace_inputs(
    batch: int = 2,
    frames: int = 3,
    size: int | tuple[int, int] = (8, 12),
    in_channels: int = 16,
    text_dim: int = 32,
    text_len: int = 6,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
) -> dict:
    """Keyword inputs of ``WanVACETransformer3DModel.forward``: ``hidden_states`` ``[B, C, F, H, W]`` (tokens
    ``F x H/2 x W/2``, default 3 x 4 x 6 = 72), ``timestep`` ``[B]``, ``encoder_hidden_states`` ``[B, L, text_dim]``,
    ``control_hidden_states`` ``[B, 96, F, H, W]`` and ``control_hidden_states_scale`` (one per VACE block: 1, 0.5)."""
    h, w = (size, size) if isinstance(size, int) else size
    g = torch.Generator().manual_seed(seed)
    return {
        "hidden_states": torch.randn(batch, in_channels, frames, h, w, generator=g).to(dtype),
        "timestep": torch.rand(batch, generator=g) * 1000,
        "encoder_hidden_states": torch.randn(batch, text_len, text_dim, generator=g).to(dtype),
        "control_hidden_states": torch.randn(batch, VACE_IN_CHANNELS, frames, h, w, generator=g).to(dtype),
        "control_hidden_states_scale": torch.tensor([1.0, 0.5]),
    }


def run_wan_vace(model, inputs: dict) -> torch.Tensor:
    """The model's output sample for ``inputs`` from :func:`wan_vace_inputs` (no grad)."""
    with torch.no_grad():
        return model(**inputs).sample


def tiny_wan_vace_pipeline(num_layers: int = 3, seed: int = 0):
    """A ``WanVACEPipeline`` from :func:`tiny_wan_vace` and helpers_wan's tiny UMT5, tokenizer, Wan VAE and flow UniPC
    scheduler. 64 x 64 px, 5 frames: 2 x 4 x 4 tokens."""
    from diffusers import WanVACEPipeline
    from helpers_wan import _flow_unipc, tiny_t5_tokenizer, tiny_umt5, tiny_wan_vae

    pipe = WanVACEPipeline(
        tokenizer=tiny_t5_tokenizer(), text_encoder=tiny_umt5(seed=seed), vae=tiny_wan_vae(seed=seed),
        transformer=tiny_wan_vace(num_layers=num_layers, seed=seed), scheduler=_flow_unipc(),
    )
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _to_original_vace() -> list[tuple[str, str]]:
    """helpers_wan's diffusers -> original renames, extended to the VACE branch: in the original VACE model a VACE
    block is a Wan block whose input projection is ``before_proj`` (block 0 only) and whose hint projection is
    ``after_proj``, and its cross-attention norm is ``norm3`` as in the main blocks."""
    from helpers_wan import _TO_ORIGINAL

    renames = [(p, r) for p, r in _TO_ORIGINAL if "norm2" not in p]
    return renames + [
        (r"^((?:vace_)?blocks\.\d+)\.norm2\.", r"\1.norm3."),
        (r"^(vace_blocks\.\d+)\.proj_in\.", r"\1.before_proj."),
        (r"^(vace_blocks\.\d+)\.proj_out\.", r"\1.after_proj."),
    ]


def original_wan_vace_state_dict(model, prefix: str = "") -> dict[str, torch.Tensor]:
    """The state dict of a diffusers ``WanVACETransformer3DModel`` in the ORIGINAL Wan VACE layout
    (``vace_blocks.0.before_proj.weight``, ``vace_blocks.1.after_proj.bias``, ``vace_blocks.0.self_attn.q.weight``,
    ``vace_patch_embedding.weight``, ``blocks.0.norm3.weight``, ``head.head.weight``, ...: the inverse of diffusers'
    ``convert_wan_transformer_to_diffusers``), for ``from_single_file`` tests; ``prefix`` as
    :func:`helpers_wan.original_wan_state_dict`'s."""
    renames = _to_original_vace()
    out = {}
    for key, value in model.state_dict().items():
        new = key
        for pattern, repl in renames:
            new = re.sub(pattern, repl, new)
        out[prefix + new] = value.detach().clone().contiguous()
    return out
