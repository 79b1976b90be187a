"""Tiny, deterministic Wan 2.1 components for tests (offline, CPU): the transformer (text-to-video and
image-to-video), its inputs, a tiny AutoencoderKLWan, a one-layer UMT5 text encoder with a T5 tokenizer
trained in memory, a WanPipeline, the original (single-file) key layout, and the real Wan2.1-1.3B
architecture with random weights.

Reuse from any test module::

    from helpers_wan import tiny_wan, wan_inputs, run_wan, tiny_wan_pipeline, WAN_1_3B
"""

from __future__ import annotations

import copy
import re
from functools import lru_cache

import torch
from torch import nn

__all__ = [
    "tiny_wan_config",
    "WAN_1_3B",
    "tiny_wan",
    "wan_inputs",
    "run_wan",
    "wan_self_attn",
    "wan_cross_attn",
    "tiny_wan_vae",
    "tiny_umt5",
    "tiny_t5_tokenizer",
    "tiny_wan_pipeline",
    "tiny_wan22_vae",
    "tiny_clip_image_encoder",
    "tiny_wan_i2v_pipeline",
    "tiny_wan22_pipeline",
    "original_wan_state_dict",
    "random_wan",
    "stock_copy",
]

from mhla_diffusers.models.configs import WAN_1_3B  # noqa: E402  (the published Wan2.1-1.3B config)


def tiny_wan_config(num_layers: int = 2, heads: int = 2, head_dim: int = 12, text_dim: int = 32, ffn_dim: int = 32,
                    in_channels: int = 16) -> dict:
    """The constructor arguments of :func:`tiny_wan` (shared by Wan's other tiny transformers, Wan VACE)."""
    return dict(
        patch_size=(1, 2, 2),
        num_attention_heads=heads,
        attention_head_dim=head_dim,
        in_channels=in_channels,
        out_channels=in_channels,
        text_dim=text_dim,
        freq_dim=32,
        ffn_dim=ffn_dim,
        num_layers=num_layers,
        cross_attn_norm=True,
        qk_norm="rms_norm_across_heads",
        rope_max_seq_len=32,
    )


def tiny_wan(
    num_layers: int = 2,
    heads: int = 2,
    head_dim: int = 12,
    text_dim: int = 32,
    ffn_dim: int = 32,
    in_channels: int = 16,
    image_dim: int | None = None,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    **config,
):
    """An eval-mode ``WanTransformer3DModel`` (FACTS.md section 3 sizes: patch (1, 2, 2), 2 heads x 12,
    text_dim 32, ffn 32). ``image_dim`` set: the image-to-video variant (cross-attention with an image
    branch, ``added_kv_proj_dim = image_dim``). Weights from ``torch.manual_seed(seed)``; the global RNG
    is restored. The zero-initialised parts diffusers leaves (none of consequence) are kept."""
    from diffusers import WanTransformer3DModel

    kwargs = tiny_wan_config(num_layers, heads, head_dim, text_dim, ffn_dim, in_channels)
    if image_dim is not None:
        kwargs.update(image_dim=image_dim, added_kv_proj_dim=heads * head_dim)
    kwargs.update(config)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = WanTransformer3DModel(**kwargs)
    model.eval()
    return model if dtype == torch.float32 else model.to(dtype)


def wan_inputs(
    batch: int = 2,
    frames: int = 2,
    size: int | tuple[int, int] = 8,
    in_channels: int = 16,
    text_dim: int = 32,
    text_len: int = 6,
    image_dim: int | None = None,
    image_len: int = 257,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
) -> dict:
    """Keyword inputs of ``WanTransformer3DModel.forward``: ``hidden_states`` ``[B, C, F, H, W]`` (latent
    frames ``F``, latent pixels ``H x W``: tokens ``F x H/2 x W/2``), ``timestep`` ``[B]``,
    ``encoder_hidden_states`` ``[B, L, text_dim]`` and, with ``image_dim``, ``encoder_hidden_states_image``
    ``[B, image_len, image_dim]`` (the I2V transformer then needs ``text_len = 512``: diffusers hard-codes
    the text length when it splits image and text tokens)."""
    h, w = (size, size) if isinstance(size, int) else size
    g = torch.Generator().manual_seed(seed)
    out = {
        "hidden_states": torch.randn(batch, in_channels, frames, h, w, generator=g).to(dtype),
        "timestep": torch.rand(batch, generator=g) * 1000,
        "encoder_hidden_states": torch.randn(batch, text_len, text_dim, generator=g).to(dtype),
    }
    if image_dim is not None:
        out["encoder_hidden_states_image"] = torch.randn(batch, image_len, image_dim, generator=g).to(dtype)
    return out


def run_wan(model, inputs: dict) -> torch.Tensor:
    """The model's output sample for ``inputs`` from :func:`wan_inputs` (no grad)."""
    with torch.no_grad():
        return model(**inputs).sample


def wan_self_attn(model) -> list[nn.Module]:
    return [block.attn1 for block in model.blocks]


def wan_cross_attn(model) -> list[nn.Module]:
    return [block.attn2 for block in model.blocks]


def tiny_wan_vae(seed: int = 0):
    """An ``AutoencoderKLWan`` (base_dim 3, z_dim 16; spatial factor 8, temporal factor 4), as diffusers' tests."""
    from diffusers import AutoencoderKLWan

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        vae = AutoencoderKLWan(
            base_dim=3, z_dim=16, dim_mult=[1, 1, 1, 1], num_res_blocks=1, temperal_downsample=[False, True, True]
        )
    return vae.eval()


_SENTENCES = [
    "a photo of a cat sitting on a red chair",
    "a watercolor painting of a lighthouse at dawn",
    "an astronaut riding a horse on the moon",
    "a bowl of fruit on a wooden table, studio lighting",
    "a small village in the mountains covered in snow",
    "waves crashing on a rocky beach at sunset",
    "a futuristic city skyline at night with neon lights",
    "two dogs playing in a green field under a blue sky",
]


@lru_cache(maxsize=1)
def _unigram_vocab() -> tuple[tuple[str, float], ...]:
    """``((piece, log-probability), ...)`` of a Unigram model trained on a few sentences; ids 0, 1, 2 are
    T5's ``<pad>``, ``</s>``, ``<unk>``."""
    import json

    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.Unigram())
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    trainer = trainers.UnigramTrainer(
        vocab_size=150, special_tokens=["<pad>", "</s>", "<unk>"], unk_token="<unk>", show_progress=False
    )
    tok.train_from_iterator(_SENTENCES * 4, trainer=trainer)
    vocab = json.loads(tok.to_str())["model"]["vocab"]
    return tuple((piece, float(score)) for piece, score in vocab)


def tiny_t5_tokenizer():
    """A ``T5Tokenizer`` built in memory from a Unigram trained on a few sentences (no Hub, no files)."""
    from transformers import T5Tokenizer

    return T5Tokenizer(vocab=list(_unigram_vocab()), extra_ids=0)


def tiny_umt5(d_model: int = 32, seed: int = 0):
    """A one-layer ``UMT5EncoderModel`` (d_model 32) as Wan's text encoder."""
    from transformers import UMT5Config, UMT5EncoderModel

    config = UMT5Config(
        vocab_size=len(_unigram_vocab()),
        d_model=d_model,
        d_kv=8,
        d_ff=2 * d_model,
        num_layers=1,
        num_heads=4,
        relative_attention_num_buckets=8,
        pad_token_id=0,
        eos_token_id=1,
        decoder_start_token_id=0,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = UMT5EncoderModel(config)
    return model.eval()


def tiny_wan_pipeline(num_layers: int = 3, seed: int = 0):
    """A ``WanPipeline`` from :func:`tiny_wan` (text_dim 32), :func:`tiny_wan_vae`, :func:`tiny_umt5`, the
    in-memory tokenizer and Wan's flow UniPC scheduler (shift 3). 64 x 64 px, 5 frames: 2 x 4 x 4 tokens."""
    from diffusers import UniPCMultistepScheduler, WanPipeline

    scheduler = UniPCMultistepScheduler(
        prediction_type="flow_prediction", use_flow_sigmas=True, num_train_timesteps=1000, flow_shift=3.0
    )
    pipe = WanPipeline(
        tokenizer=tiny_t5_tokenizer(),
        text_encoder=tiny_umt5(seed=seed),
        vae=tiny_wan_vae(seed=seed),
        transformer=tiny_wan(num_layers=num_layers, seed=seed),
        scheduler=scheduler,
    )
    pipe.set_progress_bar_config(disable=True)
    return pipe


def tiny_wan22_vae(seed: int = 0):
    """The Wan 2.2 TI2V-5B autoencoder in small: ``AutoencoderKLWan`` with z_dim 48, a 2 x 2 pixel patchify
    (``patch_size=2``, ``in_channels=12``), residual blocks; spatial factor 16, temporal factor 4."""
    from diffusers import AutoencoderKLWan

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        vae = AutoencoderKLWan(
            base_dim=3, z_dim=48, in_channels=12, out_channels=12, is_residual=True, patch_size=2,
            latents_mean=[0.0] * 48, latents_std=[1.0] * 48, dim_mult=[1, 1, 1, 1], num_res_blocks=1,
            scale_factor_spatial=16, scale_factor_temporal=4, temperal_downsample=[False, True, True],
        )
    return vae.eval()


def tiny_clip_image_encoder(hidden: int = 16, seed: int = 0):
    """``(CLIPVisionModel, CLIPImageProcessor)`` in small (8 x 8 px input, patch 2: 17 image tokens of width
    ``hidden``), Wan 2.1 image-to-video's image encoder (the pipeline reads ``hidden_states[-2]``)."""
    from transformers import CLIPImageProcessor, CLIPVisionConfig, CLIPVisionModel

    config = CLIPVisionConfig(
        hidden_size=hidden, projection_dim=hidden, num_hidden_layers=2, num_attention_heads=2, image_size=8,
        intermediate_size=2 * hidden, patch_size=2,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        encoder = CLIPVisionModel(config)
    return encoder.eval(), CLIPImageProcessor(crop_size=8, size=8)


def _flow_unipc():
    from diffusers import UniPCMultistepScheduler

    return UniPCMultistepScheduler(
        prediction_type="flow_prediction", use_flow_sigmas=True, num_train_timesteps=1000, flow_shift=3.0
    )


def tiny_wan_i2v_pipeline(num_layers: int = 2, seed: int = 0):
    """A Wan 2.1 ``WanImageToVideoPipeline``: the image-to-video transformer (in_channels 36 = 16 noise + 4 mask
    + 16 first-frame latent; ``image_dim`` 16 with the image branch ``add_k_proj`` / ``add_v_proj`` in every
    cross-attention) and a tiny CLIP image encoder. 64 x 64 px, 5 frames: 2 x 4 x 4 tokens."""
    from diffusers import WanImageToVideoPipeline

    encoder, processor = tiny_clip_image_encoder(hidden=16, seed=seed)
    pipe = WanImageToVideoPipeline(
        tokenizer=tiny_t5_tokenizer(), text_encoder=tiny_umt5(seed=seed), vae=tiny_wan_vae(seed=seed),
        transformer=tiny_wan(num_layers=num_layers, in_channels=36, out_channels=16, image_dim=16, seed=seed),
        scheduler=_flow_unipc(), image_encoder=encoder, image_processor=processor,
    )
    pipe.set_progress_bar_config(disable=True)
    return pipe


def tiny_wan22_pipeline(kind: str = "t2v", num_layers: int = 2, seed: int = 0, boundary_ratio: float = 0.875):
    """Wan 2.2 in small, built as diffusers builds the real ones:

    * ``"t2v"``: A14B text-to-video, a ``WanPipeline`` with two experts ``transformer`` (high noise:
      timesteps >= ``boundary_ratio * 1000``) and ``transformer_2`` (low noise), different weights;
    * ``"i2v"``: A14B image-to-video, a ``WanImageToVideoPipeline`` with two experts taking 36 input
      channels (no image encoder: the first frame enters as a latent only);
    * ``"ti2v"``: TI2V-5B, a ``WanPipeline`` with one transformer of 48 channels, the z_dim 48 VAE
      (:func:`tiny_wan22_vae`, 16 x spatial) and ``expand_timesteps=True`` (per-token timesteps);
      ``WanImageToVideoPipeline(**pipe.components, expand_timesteps=True)`` is its image-to-video form.
    """
    from diffusers import WanImageToVideoPipeline, WanPipeline

    common = dict(tokenizer=tiny_t5_tokenizer(), text_encoder=tiny_umt5(seed=seed), scheduler=_flow_unipc())
    if kind == "t2v":
        experts = [tiny_wan(num_layers=num_layers, seed=seed + i) for i in (0, 1)]
        pipe = WanPipeline(vae=tiny_wan_vae(seed=seed), transformer=experts[0], transformer_2=experts[1],
                           boundary_ratio=boundary_ratio, **common)
    elif kind == "i2v":
        experts = [tiny_wan(num_layers=num_layers, in_channels=36, out_channels=16, seed=seed + i) for i in (0, 1)]
        pipe = WanImageToVideoPipeline(vae=tiny_wan_vae(seed=seed), transformer=experts[0], transformer_2=experts[1],
                                       boundary_ratio=boundary_ratio, **common)
    elif kind == "ti2v":
        pipe = WanPipeline(vae=tiny_wan22_vae(seed=seed), transformer=tiny_wan(num_layers=num_layers, in_channels=48, seed=seed),
                           expand_timesteps=True, **common)
    else:
        raise ValueError(f"kind must be t2v, i2v or ti2v; got {kind!r}")
    pipe.set_progress_bar_config(disable=True)
    return pipe


# diffusers name -> original Wan name (the inverse of diffusers' convert_wan_transformer_to_diffusers),
# applied in this order to every key.
_TO_ORIGINAL = [
    (r"^condition_embedder\.time_embedder\.linear_1\.", "time_embedding.0."),
    (r"^condition_embedder\.time_embedder\.linear_2\.", "time_embedding.2."),
    (r"^condition_embedder\.text_embedder\.linear_1\.", "text_embedding.0."),
    (r"^condition_embedder\.text_embedder\.linear_2\.", "text_embedding.2."),
    (r"^condition_embedder\.time_proj\.", "time_projection.1."),
    (r"^condition_embedder\.image_embedder\.norm1\.", "img_emb.proj.0."),
    (r"^condition_embedder\.image_embedder\.ff\.net\.0\.proj\.", "img_emb.proj.1."),
    (r"^condition_embedder\.image_embedder\.ff\.net\.2\.", "img_emb.proj.3."),
    (r"^condition_embedder\.image_embedder\.norm2\.", "img_emb.proj.4."),
    (r"^scale_shift_table$", "head.modulation"),
    (r"^proj_out\.", "head.head."),
    (r"\.attn1\.", ".self_attn."),
    (r"\.attn2\.", ".cross_attn."),
    (r"\.to_q\.", ".q."),
    (r"\.to_k\.", ".k."),
    (r"\.to_v\.", ".v."),
    (r"\.to_out\.0\.", ".o."),
    (r"\.add_k_proj\.", ".k_img."),
    (r"\.add_v_proj\.", ".v_img."),
    (r"\.norm_added_k\.", ".norm_k_img."),
    (r"\.scale_shift_table$", ".modulation"),
    (r"\.ffn\.net\.0\.proj\.", ".ffn.0."),
    (r"\.ffn\.net\.2\.", ".ffn.2."),
    (r"^(blocks\.\d+)\.norm2\.", r"\1.norm3."),  # the cross-attention norm is norm3 in the original
]


def original_wan_state_dict(model, prefix: str = "") -> dict[str, torch.Tensor]:
    """The state dict of a diffusers ``WanTransformer3DModel`` in the ORIGINAL Wan checkpoint layout
    (``blocks.0.self_attn.q.weight``, ``head.head.weight``, ...; the inverse of diffusers'
    ``convert_wan_transformer_to_diffusers``), for ``from_single_file`` tests. ``prefix``: e.g.
    ``"model.diffusion_model."`` as ComfyUI-style files have (diffusers strips it)."""
    out = {}
    for key, value in model.state_dict().items():
        new = key
        for pattern, repl in _TO_ORIGINAL:
            new = re.sub(pattern, repl, new)
        out[prefix + new] = value.detach().clone().contiguous()
    return out


def random_wan(config: dict = WAN_1_3B, dtype: torch.dtype = torch.bfloat16, seed: int = 0):
    """A ``WanTransformer3DModel`` of ``config`` with random weights, built fast and in ``dtype``: on the meta
    device, then materialised once in ``dtype`` (no float32 copy: the 1.3B model is 2.6 GB in bf16) and filled
    from ``torch.Generator(seed)``: weights uniform with std ``1/sqrt(fan_in)``, biases zero, norm weights
    one, modulation tables ``randn / sqrt(dim)`` (diffusers' init). Returns it in eval mode."""
    from diffusers import WanTransformer3DModel
    from diffusers.models.transformers.transformer_wan import WanRotaryPosEmbed

    with torch.device("meta"):
        model = WanTransformer3DModel(**config)
    keep = tuple(model._keep_in_fp32_modules or ())
    with torch.device("meta"):
        for name, p in model.named_parameters():
            if dtype != torch.float32 and not any(k in name.split(".") for k in keep):
                p.data = p.data.to(dtype)
    model.to_empty(device="cpu")
    model.rope = WanRotaryPosEmbed(config["attention_head_dim"], config["patch_size"], config["rope_max_seq_len"])
    g = torch.Generator().manual_seed(seed)
    dim = config["num_attention_heads"] * config["attention_head_dim"]
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("scale_shift_table"):
                p.copy_(torch.randn(p.shape, generator=g) / dim**0.5)
            elif p.ndim >= 2:
                bound = (3.0 / (p[0].numel())) ** 0.5
                p.uniform_(-bound, bound, generator=g)
            elif re.search(r"norm", name) and name.endswith("weight"):
                p.fill_(1.0)
            else:
                p.zero_()
    return model.eval()


def stock_copy(model):
    """A deep copy (taken BEFORE MHLA is installed, so it keeps the stock processors)."""
    return copy.deepcopy(model)
