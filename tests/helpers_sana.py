"""Tiny, deterministic SANA components for tests (offline, CPU): the transformer, its inputs, a tiny
AutoencoderDC, a one-layer Gemma2 text encoder with a tokenizer trained in memory, and a SanaPipeline.

Reuse from any test module::

    from helpers_sana import tiny_sana, sana_inputs, run_sana, tiny_sana_pipeline, SANA_600M
"""

from __future__ import annotations

import copy
from functools import lru_cache

import torch
from torch import nn

__all__ = [
    "SANA_600M",
    "tiny_sana",
    "sana_inputs",
    "run_sana",
    "sana_self_attn",
    "sana_cross_attn",
    "tiny_dc_ae",
    "tiny_gemma2",
    "tiny_gemma_tokenizer",
    "tiny_sana_pipeline",
    "original_sana_state_dict",
]

from mhla_diffusers.models.configs import SANA_600M  # noqa: E402  (the published SANA-600M config)


def tiny_sana(
    num_layers: int = 2,
    heads: int = 2,
    head_dim: int = 8,
    cross_heads: int = 2,
    cross_head_dim: int = 8,
    sample_size: int = 32,
    patch_size: int = 1,
    in_channels: int = 4,
    caption_channels: int = 32,
    qk_norm: str | None = None,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    **config,
):
    """An eval-mode ``SanaTransformer2DModel`` (FACTS.md section 3 sizes by default); ``config``
    overrides any constructor argument. Weights from ``torch.manual_seed(seed)``, global RNG restored."""
    from diffusers import SanaTransformer2DModel

    kwargs = dict(
        in_channels=in_channels,
        out_channels=in_channels,
        num_attention_heads=heads,
        attention_head_dim=head_dim,
        num_layers=num_layers,
        num_cross_attention_heads=cross_heads,
        cross_attention_head_dim=cross_head_dim,
        cross_attention_dim=heads * head_dim,
        caption_channels=caption_channels,
        sample_size=sample_size,
        patch_size=patch_size,
        qk_norm=qk_norm,
    )
    kwargs.update(config)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = SanaTransformer2DModel(**kwargs)
        # diffusers leaves the adaLN modulation (time_embed.linear) at its default init; make its
        # effect clearly visible, as for the DiT helper.
        nn.init.normal_(model.time_embed.linear.weight, std=0.2)
    model.eval()
    return model if dtype == torch.float32 else model.to(dtype)


def sana_inputs(
    batch: int = 2,
    size: int | tuple[int, int] = 8,
    in_channels: int = 4,
    caption_channels: int = 32,
    text_len: int = 6,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    frames: int | None = None,
):
    """``(latent [B, C, H, W], encoder_hidden_states [B, L, caption], timestep [B], encoder_attention_mask [B, L])``;
    with ``frames`` a video latent ``[B, C, frames, H, W]`` (SANA-Video).

    The mask hides the last two text tokens of sample 0 (so the cross-attention mask path runs).
    """
    h, w = (size, size) if isinstance(size, int) else size
    g = torch.Generator().manual_seed(seed)
    latent = torch.randn(batch, in_channels, *(() if frames is None else (frames,)), h, w, generator=g).to(dtype)
    text = torch.randn(batch, text_len, caption_channels, generator=g).to(dtype)
    timestep = torch.rand(batch, generator=g) * 1000
    mask = torch.ones(batch, text_len, dtype=torch.long)
    if text_len > 2:
        mask[0, -2:] = 0
    return latent, text, timestep, mask


def run_sana(model, inputs) -> torch.Tensor:
    """The model's output sample for ``inputs`` from :func:`sana_inputs` (no grad)."""
    latent, text, timestep, mask = inputs
    with torch.no_grad():
        return model(latent, encoder_hidden_states=text, timestep=timestep, encoder_attention_mask=mask).sample


def sana_self_attn(model) -> list[nn.Module]:
    return [block.attn1 for block in model.transformer_blocks]


def sana_cross_attn(model) -> list[nn.Module]:
    return [block.attn2 for block in model.transformer_blocks]


def tiny_dc_ae(levels: int = 2, latent_channels: int = 4, seed: int = 0):
    """An ``AutoencoderDC`` with ``levels`` ResBlock levels of 8 channels (spatial factor ``2**(levels-1)``)."""
    from diffusers import AutoencoderDC

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        vae = AutoencoderDC(
            in_channels=3,
            latent_channels=latent_channels,
            attention_head_dim=8,
            encoder_block_types="ResBlock",
            decoder_block_types="ResBlock",
            encoder_block_out_channels=(8,) * levels,
            decoder_block_out_channels=(8,) * levels,
            encoder_layers_per_block=(1,) * levels,
            decoder_layers_per_block=(1,) * levels,
            encoder_qkv_multiscales=((),) * levels,
            decoder_qkv_multiscales=((),) * levels,
            scaling_factor=0.41407,
        )
    return vae.eval()


_SENTENCES = [
    "a photo of a cat sitting on a red chair",
    "a watercolor painting of a lighthouse at dawn",
    "an astronaut riding a horse on the moon",
    "a bowl of fruit on a wooden table, studio lighting",
    "a small village in the mountains covered in snow",
    "a portrait of an old man with a white beard",
    "a futuristic city skyline at night with neon lights",
    "two dogs playing in a green field under a blue sky",
]


@lru_cache(maxsize=1)
def _tokenizer_data() -> tuple[tuple[tuple[str, int], ...], tuple[tuple[str, str], ...]]:
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    specials = ["<pad>", "<eos>", "<bos>", "<unk>", "<mask>"]
    trainer = trainers.BpeTrainer(vocab_size=200, special_tokens=specials, show_progress=False)
    tok.train_from_iterator(_SENTENCES * 4, trainer=trainer)
    data = tok.model.__getstate__()
    import json

    state = json.loads(data) if isinstance(data, (str, bytes)) else data
    vocab = tuple(sorted(state["vocab"].items(), key=lambda kv: kv[1]))
    merges = tuple(tuple(m) if isinstance(m, (list, tuple)) else tuple(m.split(" ")) for m in state["merges"])
    return vocab, merges


def tiny_gemma_tokenizer():
    """A ``GemmaTokenizer`` built in memory from a BPE trained on a few sentences (no Hub, no files)."""
    from transformers import GemmaTokenizer

    vocab, merges = _tokenizer_data()
    return GemmaTokenizer(vocab=dict(vocab), merges=list(merges))


def tiny_gemma2(hidden: int = 32, vocab_size: int = 200, seed: int = 0):
    """A one-layer ``Gemma2Model`` (hidden 32) as SANA's text encoder."""
    from transformers import Gemma2Config, Gemma2Model

    config = Gemma2Config(
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=hidden // 2,
        max_position_embeddings=1024,
        pad_token_id=0,
        eos_token_id=1,
        bos_token_id=2,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Gemma2Model(config)
    return model.eval()


def tiny_sana_pipeline(num_layers: int = 3, sample_size: int = 32, vae_levels: int = 3, seed: int = 0):
    """A ``SanaPipeline`` from :func:`tiny_sana`, :func:`tiny_dc_ae`, :func:`tiny_gemma2`, the in-memory
    tokenizer and SANA's flow DPM-Solver scheduler. Call it with ``use_resolution_binning=False`` unless
    the test is about binning (binning maps a tiny request to the model's native 512-4096 px bins)."""
    from diffusers import DPMSolverMultistepScheduler, SanaPipeline

    scheduler = DPMSolverMultistepScheduler(
        num_train_timesteps=1000, prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=3.0
    )
    pipe = SanaPipeline(
        tokenizer=tiny_gemma_tokenizer(),
        text_encoder=tiny_gemma2(seed=seed),
        vae=tiny_dc_ae(levels=vae_levels, seed=seed),
        transformer=tiny_sana(num_layers=num_layers, sample_size=sample_size, seed=seed),
        scheduler=scheduler,
    )
    pipe.set_progress_bar_config(disable=True)
    return pipe


def original_sana_state_dict(model) -> dict[str, torch.Tensor]:
    """The state dict of a diffusers ``SanaTransformer2DModel`` in the ORIGINAL SANA checkpoint layout
    (the inverse of diffusers' ``convert_sana_transformer_to_diffusers``), for ``from_single_file`` tests.
    Covers the configurations that converter covers: no qk-norm, no guidance embedding, no attn1 bias."""
    sd = {k: v.detach().clone() for k, v in model.state_dict().items()}
    out = {
        "pos_embed": torch.zeros(1, 1, model.config.num_attention_heads * model.config.attention_head_dim),
        "x_embedder.proj.weight": sd.pop("patch_embed.proj.weight"),
        "x_embedder.proj.bias": sd.pop("patch_embed.proj.bias"),
        "t_embedder.mlp.0.weight": sd.pop("time_embed.emb.timestep_embedder.linear_1.weight"),
        "t_embedder.mlp.0.bias": sd.pop("time_embed.emb.timestep_embedder.linear_1.bias"),
        "t_embedder.mlp.2.weight": sd.pop("time_embed.emb.timestep_embedder.linear_2.weight"),
        "t_embedder.mlp.2.bias": sd.pop("time_embed.emb.timestep_embedder.linear_2.bias"),
        "t_block.1.weight": sd.pop("time_embed.linear.weight"),
        "t_block.1.bias": sd.pop("time_embed.linear.bias"),
        "y_embedder.y_embedding": torch.zeros(4, model.config.caption_channels),
        "y_embedder.y_proj.fc1.weight": sd.pop("caption_projection.linear_1.weight"),
        "y_embedder.y_proj.fc1.bias": sd.pop("caption_projection.linear_1.bias"),
        "y_embedder.y_proj.fc2.weight": sd.pop("caption_projection.linear_2.weight"),
        "y_embedder.y_proj.fc2.bias": sd.pop("caption_projection.linear_2.bias"),
        "attention_y_norm.weight": sd.pop("caption_norm.weight"),
        "final_layer.linear.weight": sd.pop("proj_out.weight"),
        "final_layer.linear.bias": sd.pop("proj_out.bias"),
        "final_layer.scale_shift_table": sd.pop("scale_shift_table"),
    }
    for i in range(model.config.num_layers):
        b, o = f"transformer_blocks.{i}", f"blocks.{i}"
        out[f"{o}.scale_shift_table"] = sd.pop(f"{b}.scale_shift_table")
        out[f"{o}.attn.qkv.weight"] = torch.cat([sd.pop(f"{b}.attn1.to_{x}.weight") for x in "qkv"])
        out[f"{o}.attn.proj.weight"] = sd.pop(f"{b}.attn1.to_out.0.weight")
        out[f"{o}.attn.proj.bias"] = sd.pop(f"{b}.attn1.to_out.0.bias")
        out[f"{o}.cross_attn.q_linear.weight"] = sd.pop(f"{b}.attn2.to_q.weight")
        out[f"{o}.cross_attn.q_linear.bias"] = sd.pop(f"{b}.attn2.to_q.bias")
        out[f"{o}.cross_attn.kv_linear.weight"] = torch.cat([sd.pop(f"{b}.attn2.to_k.weight"), sd.pop(f"{b}.attn2.to_v.weight")])
        out[f"{o}.cross_attn.kv_linear.bias"] = torch.cat([sd.pop(f"{b}.attn2.to_k.bias"), sd.pop(f"{b}.attn2.to_v.bias")])
        out[f"{o}.cross_attn.proj.weight"] = sd.pop(f"{b}.attn2.to_out.0.weight")
        out[f"{o}.cross_attn.proj.bias"] = sd.pop(f"{b}.attn2.to_out.0.bias")
        for new, old in (("inverted_conv", "conv_inverted"), ("depth_conv", "conv_depth"), ("point_conv", "conv_point")):
            out[f"{o}.mlp.{new}.conv.weight"] = sd.pop(f"{b}.ff.{old}.weight")
            if f"{b}.ff.{old}.bias" in sd:
                out[f"{o}.mlp.{new}.conv.bias"] = sd.pop(f"{b}.ff.{old}.bias")
    if sd:
        raise ValueError(f"keys the original SANA layout does not hold: {sorted(sd)[:5]}")
    return {k: v.contiguous() for k, v in out.items()}


def stock_copy(model):
    """A deep copy (taken BEFORE MHLA is installed, so it keeps the stock processors)."""
    return copy.deepcopy(model)
