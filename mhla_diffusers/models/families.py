"""Everything that differs per model family lives here, and only here.

A :class:`Family` says which diffusers transformer classes it covers, where their self- and
cross-attention modules are, which submodule embeds the latent into tokens (its input gives the
token grid exactly), the model's default token grid (for picking a block grid once, at conversion),
which stock processors restore the original model, and how the stock self-attention processor
handles q/k norms, dtypes and the output (so that MHLA with one block reproduces it).

Families:

* ``dit`` — ``DiTTransformer2DModel``: softmax self-attention (``AttnProcessor2_0``), no
  cross-attention, per-head q/k norms after the head split (none in released models).
* ``sana`` — ``SanaTransformer2DModel``: ReLU linear self-attention (``SanaLinearAttnProcessor2_0``:
  eps 1e-15, q/k norms over all heads before the head split, output cast to the layer input's dtype
  and clipped to +-65504 for fp16 inputs), softmax cross-attention (``SanaAttnProcessor2_0``).
* ``wan`` — ``WanTransformer3DModel`` (Wan 2.1 text-to-video and image-to-video; Wan 2.2: each of the two
  A14B experts, and TI2V-5B, whose native grid is 31 x 22 x 40): ``WanAttention``
  modules calling ``WanAttnProcessor`` positionally ``(attn, hidden_states, encoder_hidden_states,
  attention_mask, rotary_emb)``; q/k RMSNorm over all heads before the head split; interleaved 3D
  RoPE (:class:`WanRotary`), which MHLA applies after the feature map, in the numerator only; token
  grid ``(F / p_t, H / p_h, W / p_w)`` from the latent ``[B, C, F, H, W]`` entering
  ``patch_embedding``; the paper's ``M = 105`` blocks by default (``(3, 5, 7)`` on the native
  21 x 30 x 52 grid of 81 frames at 480 x 832 px), presets ``"paper"`` and ``"authors"``
  (``(3, 5, 10)``, M = 150, the authors' released configuration).
"""

from __future__ import annotations

import inspect
import re
from dataclasses import dataclass
from typing import Callable

import torch
from diffusers.models.attention_processor import AttnProcessor2_0, SanaLinearAttnProcessor2_0
from diffusers.models.transformers.sana_transformer import SanaAttnProcessor2_0
from diffusers.models.transformers.transformer_wan import WanAttnProcessor
from torch import nn

from mhla_diffusers.models.family_calls import FamilyAttention, StockSignature
from mhla_diffusers.ops.rotary import InterleavedRotary

__all__ = [
    "Family",
    "FAMILIES",
    "WanRotary",
    "wan_native_video",
    "attention_family",
    "attention_modules",
    "family_of",
    "find_family",
    "get_family",
    "self_attention_modules",
    "stock_processor",
]


@dataclass(frozen=True)
class Family(FamilyAttention):
    """Model-family facts used by the processor, the grid hooks and conversion (the per-call steps of a
    self-attention layer that read them: :class:`~mhla_diffusers.models.family_calls.FamilyAttention`).

    Attributes:
        name: short name used in configs and on the command line (``"dit"``).
        model_classes: diffusers class names of the transformers of this family.
        self_attention: regex over ``named_modules()`` names matching self-attention layers;
            group 1 is the layer index.
        patch_embed: name of the submodule that turns the latent into tokens; its first
            positional input is the latent.
        grid_from_latent: ``(latent, config) -> (T, H, W)``, the token grid of one forward.
        reference_grid: ``config -> (T, H, W)``, the token grid at the model's native resolution.
        stock_self_processor: factory of the processor the model's self-attention ships with.
        default_eps: denominator epsilon used when the processor does not set one (the stock
            linear attention's own eps where the model has one: SANA 1e-15).
        cross_attention: regex over ``named_modules()`` names matching cross-attention layers
            (group 1 the layer index), ``None`` when the model has none.
        stock_cross_processor: factory of the processor the model's cross-attention ships with;
            an MHLA processor installed there runs it unchanged. ``None``: diffusers' default
            ``AttnProcessor2_0``.
        qk_norm_across_heads: the stock self-attention applies ``attn.norm_q`` / ``attn.norm_k`` to
            the projected ``[B, N, heads * d]`` tensors before the head split (SANA), not per head
            after it (``AttnProcessor2_0``).
        attention_output_dtype: ``"query"`` — the attention output is cast to the query's dtype
            before ``to_out`` (``AttnProcessor2_0``); ``"input"`` — to the dtype of the layer's
            ``hidden_states`` input (``SanaLinearAttnProcessor2_0``).
        fp16_output_clip: when set, the self-attention output (after ``to_out``) is clipped to
            ``[-clip, clip]`` if the layer's input is float16, as the stock processor does (SANA:
            65504, part of the trained function).
        processor_call: ``"keywords"`` — the attention module calls its processor as the legacy
            diffusers ``Attention`` does (``encoder_hidden_states=``, ``attention_mask=``, named
            extras such as ``temb=``); ``"positional"`` — as ``WanAttention`` does:
            ``(attn, hidden_states, encoder_hidden_states, attention_mask, rotary_emb)``.
        rotary: ``rotary_emb -> callable`` turning the model's rotary embedding into the map that
            rotates a ``[B, heads, N, d]`` feature tensor (Wan: :class:`WanRotary`); ``None`` when the
            family has no RoPE.
        attention_classes: class names of attention modules found only in this family's models
            (``WanAttention``): an MHLA processor called on such a module outside its transformer
            follows this family.
        default_num_blocks: target ``M`` when the user gives neither ``num_blocks`` nor
            ``block_grid`` (``None``: :func:`~mhla_diffusers.default_num_blocks`); the block grid is
            then :func:`~mhla_diffusers.choose_block_grid` of the reference grid and this ``M``.
        block_grid_presets: ``((name, (bt, bh, bw)), ...)``: named block grids for this family.
        empty_blocks: when a forward's token grid has fewer tokens than the layer's block grid on
            an axis (Wan at 1 frame or a small size, an extreme SANA aspect ratio, a small DiT
            latent), run with the blocks that hold tokens and the matching rows / columns of the
            mixing matrix (exactly MHLA with the other blocks empty) instead of raising. All three
            families set it; ``False`` (the default) raises.
        output_norm_without_normalize: an MHLA processor with ``normalize=False`` and
            ``output_norm=None`` puts a per-head RMSNorm on the attention output (the authors' Wan
            recipe: numerator only, then RMSNorm).
        stock_attention: what the stock self-attention computes: ``"softmax"`` (DiT, Wan: cost
            ``O(N^2 d)`` per head) or ``"linear"`` (SANA's ReLU linear attention: ``O(N d^2)``), for
            the attention-cost model of automatic hybrid selection.
        conditioning: what the transformer's forward needs beside the latent and the timestep:
            ``"class"`` (``class_labels`` ``[B]`` long, DiT) or ``"text"`` (text-encoder states from
            :attr:`encode_prompts`).
        noise: the training noise process, for calibration inputs: ``"ddpm"`` (``x_t = sqrt(a_t) x0 +
            sqrt(1 - a_t) eps``, integer timesteps, DiT) or ``"flow"`` (``x_t = (1 - s) x0 + s eps``,
            timestep ``1000 s``, SANA, Wan).
        encode_prompts: ``(pipe, prompts, device) -> {forward keyword: tensor}``: the prompts through the
            pipeline's own ``encode_prompt`` as its ``__call__`` does by default (``None`` for
            class-conditional families).
        context_parallel: how :func:`~mhla_diffusers.context_parallel_plan` splits the tokens under diffusers'
            context parallelism. ``"model"``: the transformer's own ``_cp_plan`` (its softmax layers run
            diffusers' ring / Ulysses attention); ``"trunk"``: split at the input of ``cp_trunk[0]``, gathered
            after ``cp_trunk[1]`` (everything between is per token but self-attention, which must all be
            MHLA: the family's stock processor has no context parallelism); ``"layers"``: each MHLA
            self-attention alone is split (its input) and gathered (after ``to_out.0``), for models whose
            other parts mix tokens (SANA's feed-forward convolution). ``None``: no plan.
        cp_trunk: ``(first module, last module)`` of the ``"trunk"`` plan.
        max_grid: ``config -> (T, H, W)``, the largest token count per axis the model's forward takes (Wan:
            its RoPE table, ``rope_max_seq_len`` positions per axis); ``None``: no such bound.
        fsdp_blocks: each transformer block (the module holding a self-attention layer) can be an
            FSDP unit (``fully_shard``). ``False`` when the model's forward uses a block's submodule
            outside that block's forward, where FSDP has not gathered its parameters (DiT's root calls
            ``transformer_blocks[0].norm1.emb``): the whole model is then one unit.
    """

    name: str
    model_classes: tuple[str, ...]
    self_attention: str
    patch_embed: str
    grid_from_latent: Callable[[torch.Tensor, dict], tuple[int, int, int]]
    reference_grid: Callable[[dict], tuple[int, int, int]]
    stock_self_processor: Callable[[], object]
    default_eps: float = 1e-6
    cross_attention: str | None = None
    stock_cross_processor: Callable[[], object] | None = None
    qk_norm_across_heads: bool = False
    attention_output_dtype: str = "query"
    fp16_output_clip: float | None = None
    processor_call: str = "keywords"
    rotary: Callable[[object], Callable[[torch.Tensor], torch.Tensor]] | None = None
    attention_classes: tuple[str, ...] = ()
    default_num_blocks: int | None = None
    block_grid_presets: tuple[tuple[str, tuple[int, int, int]], ...] = ()
    empty_blocks: bool = False
    output_norm_without_normalize: bool = False
    stock_attention: str = "softmax"
    conditioning: str = "class"
    noise: str = "ddpm"
    encode_prompts: Callable[[object, list, object], dict] | None = None
    context_parallel: str | None = None
    cp_trunk: tuple[str, str] | None = None
    max_grid: Callable[[dict], tuple[int, int, int]] | None = None
    fsdp_blocks: bool = True

    def __reduce__(self):  # a registry entry: copies and pickles stand for the registered family itself
        return get_family, (self.name,)

    def __post_init__(self):
        if self.attention_output_dtype not in ("query", "input"):
            raise ValueError(f"attention_output_dtype must be 'query' or 'input'; got {self.attention_output_dtype!r}")
        if self.processor_call not in ("keywords", "positional"):
            raise ValueError(f"processor_call must be 'keywords' or 'positional'; got {self.processor_call!r}")
        if self.stock_attention not in ("softmax", "linear") or self.conditioning not in ("class", "text"):
            raise ValueError(f"bad stock_attention {self.stock_attention!r} or conditioning {self.conditioning!r}")
        if self.noise not in ("ddpm", "flow"):
            raise ValueError(f"noise must be 'ddpm' or 'flow'; got {self.noise!r}")
        if self.context_parallel not in (None, "model", "trunk", "layers") or (self.context_parallel == "trunk") != (
            self.cp_trunk is not None
        ):
            raise ValueError(
                f"context_parallel must be None, 'model', 'trunk' (with cp_trunk) or 'layers'; got {self.context_parallel!r}, "
                f"cp_trunk={self.cp_trunk!r}"
            )

    def preset(self, name: str) -> tuple[int, int, int]:
        """The block grid of the preset ``name``.

        Raises:
            ValueError: for a name this family has no preset of (listing the presets it has).
        """
        presets = dict(self.block_grid_presets)
        if name not in presets:
            known = ", ".join(f"{k!r} {v}" for k, v in presets.items()) or "none"
            raise ValueError(f"the {self.name} family has no block-grid preset {name!r}; its presets: {known}")
        return presets[name]

    def native_latent_shape(self, config) -> tuple[int, ...]:
        """The latent of one sample at the model's native resolution: ``(C, H, W)`` for image families,
        ``(C, F, H, W)`` for video ones (:attr:`reference_grid` times the patch size)."""
        patch = _patch(config)
        grid = self.reference_grid(config)[-len(patch):] if len(patch) > 1 else self.reference_grid(config)[1:]
        patch = patch if len(patch) > 1 else patch * 2
        return (int(config["in_channels"]), *(n * p for n, p in zip(grid, patch)))

    @property
    def stock_signature(self) -> StockSignature:
        """What the stock self-attention processor's ``__call__`` accepts (read once, at import)."""
        return _STOCK_SIGNATURES[self.name]

    def make_stock_cross_processor(self):
        """A fresh instance of the stock cross-attention processor of this family."""
        if self.stock_cross_processor is not None:
            return self.stock_cross_processor()
        return _attn_processor_2_0()


def _patch(config) -> tuple[int, ...]:
    p = config["patch_size"]
    return tuple(p) if isinstance(p, (tuple, list)) else (p,)


def _grid_2d(latent: torch.Tensor, config) -> tuple[int, int, int]:
    if latent.ndim != 4:
        raise ValueError(f"expected a latent [batch, channels, height, width]; got shape {tuple(latent.shape)}")
    (p,) = _patch(config)[-1:]
    return (1, latent.shape[-2] // p, latent.shape[-1] // p)


def _reference_grid_2d(config) -> tuple[int, int, int]:
    size = config["sample_size"]
    h, w = (size, size) if isinstance(size, int) else tuple(size)
    (p,) = _patch(config)[-1:]
    return (1, h // p, w // p)


def _grid_3d(latent: torch.Tensor, config) -> tuple[int, int, int]:
    if latent.ndim != 5:
        raise ValueError(f"expected a video latent [batch, channels, frames, height, width]; got shape {tuple(latent.shape)}")
    pt, ph, pw = _patch(config)
    return (latent.shape[-3] // pt, latent.shape[-2] // ph, latent.shape[-1] // pw)


# Wan 2.1's native size: 81 frames at 480 x 832 px, VAE factors 4 (time) and 8 (space): a latent of
# 21 x 60 x 104, i.e. 21 x 30 x 52 tokens with patch (1, 2, 2). Wan 2.2 A14B (T2V, I2V) keeps that VAE.
WAN_NATIVE_LATENT = (21, 60, 104)
WAN_NATIVE_VIDEO = {"height": 480, "width": 832, "frames": 81}
# Wan 2.2 TI2V-5B: its own VAE (z_dim 48, factors 4 and 16), 121 frames at 704 x 1280 px (720p, 24 fps): a
# latent of 31 x 44 x 80, i.e. 31 x 22 x 40 = 27,280 tokens with patch (1, 2, 2).
WAN22_TI2V_LATENT_CHANNELS = 48
WAN22_TI2V_NATIVE_LATENT = (31, 44, 80)
WAN22_TI2V_NATIVE_VIDEO = {"height": 704, "width": 1280, "frames": 121}


def wan_native_video(config) -> dict:
    """``{"height", "width", "frames"}`` (pixels, frames) a Wan transformer of ``config`` was trained at: Wan 2.2
    TI2V-5B (``out_channels`` 48, the z_dim 48 VAE) 704 x 1280 px, 121 frames; Wan 2.1 and 2.2 A14B 480 x 832 px,
    81 frames (the A14B experts also run 720p; 480p is the size both releases share)."""
    is_ti2v = config.get("out_channels") == WAN22_TI2V_LATENT_CHANNELS
    return dict(WAN22_TI2V_NATIVE_VIDEO if is_ti2v else WAN_NATIVE_VIDEO)


def _reference_grid_wan(config) -> tuple[int, int, int]:
    pt, ph, pw = _patch(config)
    is_ti2v = config.get("out_channels") == WAN22_TI2V_LATENT_CHANNELS
    t, h, w = WAN22_TI2V_NATIVE_LATENT if is_ti2v else WAN_NATIVE_LATENT
    return (max(1, t // pt), max(1, h // ph), max(1, w // pw))


def _max_grid_wan(config) -> tuple[int, int, int]:
    """diffusers' ``WanRotaryPosEmbed`` holds ``rope_max_seq_len`` positions per axis (default 1024): a token grid
    longer on an axis fails in the model's forward."""
    n = int(config.get("rope_max_seq_len") or 1024)
    return (n, n, n)


class WanRotary(InterleavedRotary):
    """Wan 2.1's 3D rotary embedding as a map on ``[B, heads, N, d]`` feature tensors.

    The exact rotation of diffusers' ``WanAttnProcessor`` (``apply_rotary_emb``, interleaved pairs):
    for channel pairs ``(x1, x2) = (x[..., 0::2], x[..., 1::2])`` with ``cos = freqs_cos[..., 0::2]``
    and ``sin = freqs_sin[..., 1::2]``::

        out[..., 0::2] = x1 * cos - x2 * sin
        out[..., 1::2] = x1 * sin + x2 * cos

    An :class:`~mhla_diffusers.ops.InterleavedRotary` on those tables: computed in the promoted
    dtype of the input and the (float32) tables, returned in the input's dtype; for float32 /
    float64 inputs as one complex multiplication (on this CPU bit-identical to diffusers' formula).
    The Triton backend applies it inside its kernels.

    Args:
        rotary_emb: ``(freqs_cos, freqs_sin)`` as ``WanTransformer3DModel.rope`` returns it: two float
            tensors of shape ``(1, N, 1, d)`` (tokens row-major ``f * H * W + h * W + w``).

    Raises:
        ValueError: if ``rotary_emb`` is not such a pair, or (when called) if the feature tensor's
            token count or head dim does not match the tables.
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


def _call_default(pipe, name: str):
    """The default of the argument ``name`` of the pipeline's ``__call__`` (``None`` if it has none)."""
    parameter = inspect.signature(type(pipe).__call__).parameters.get(name)
    return None if parameter is None or parameter.default is inspect.Parameter.empty else parameter.default


def _encode_sana(pipe, prompts: list, device) -> dict:
    """SANA: ``{"encoder_hidden_states" [B, L, D], "encoder_attention_mask" [B, L]}`` (Gemma-2, with the
    pipeline's default complex human instruction and sequence length, as ``SanaPipeline.__call__``)."""
    embeds, mask, _, _ = pipe.encode_prompt(
        list(prompts), do_classifier_free_guidance=False, device=device, clean_caption=False,
        max_sequence_length=_call_default(pipe, "max_sequence_length") or 300,
        complex_human_instruction=_call_default(pipe, "complex_human_instruction"),
    )
    return {"encoder_hidden_states": embeds, "encoder_attention_mask": mask}


def _encode_wan(pipe, prompts: list, device) -> dict:
    """Wan: ``{"encoder_hidden_states" [B, L, D]}`` (UMT5, zero rows after each prompt's tokens, the
    pipeline's default sequence length, as ``WanPipeline.__call__``)."""
    embeds, _ = pipe.encode_prompt(
        list(prompts), do_classifier_free_guidance=False, device=device,
        max_sequence_length=_call_default(pipe, "max_sequence_length") or 512,
    )
    return {"encoder_hidden_states": embeds}


def _wan_attn_processor():
    return WanAttnProcessor()


def _attn_processor_2_0():
    return AttnProcessor2_0()


def _sana_linear_attn_processor():
    return SanaLinearAttnProcessor2_0()


def _sana_attn_processor():
    return SanaAttnProcessor2_0()


DIT = Family(
    name="dit",
    model_classes=("DiTTransformer2DModel",),
    self_attention=r"^transformer_blocks\.(\d+)\.attn1$",
    patch_embed="pos_embed",
    grid_from_latent=_grid_2d,
    reference_grid=_reference_grid_2d,
    stock_self_processor=_attn_processor_2_0,
    empty_blocks=True,  # a latent smaller than the block grid (e.g. 64 px with 4 x 4 blocks on 32 x 32 tokens)
    context_parallel="trunk",  # blocks: per-token MLP and adaLN; proj_out_2 before the unpatchify reshape
    cp_trunk=("transformer_blocks.0", "proj_out_2"),
    fsdp_blocks=False,  # forward: conditioning = self.transformer_blocks[0].norm1.emb(...) for the output layer
)

SANA = Family(
    name="sana",
    model_classes=("SanaTransformer2DModel",),
    self_attention=r"^transformer_blocks\.(\d+)\.attn1$",
    patch_embed="patch_embed",  # PatchEmbed(latent [B, C, H, W]); tokens (H / p) x (W / p), row-major
    grid_from_latent=_grid_2d,
    reference_grid=_reference_grid_2d,  # sample_size 32, patch 1 -> 32 x 32 (1024 px); 16 -> 512 px
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
    encode_prompts=_encode_sana,
    context_parallel="layers",  # GLUMBConv: a 3x3 depthwise convolution over the token grid in every block
)

WAN = Family(
    name="wan",
    model_classes=("WanTransformer3DModel",),  # text-to-video and image-to-video (image_dim set)
    self_attention=r"^blocks\.(\d+)\.attn1$",
    patch_embed="patch_embedding",  # Conv3d(latent [B, C, F, H, W]); tokens f*H*W + h*W + w
    grid_from_latent=_grid_3d,
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
    block_grid_presets=(("paper", (3, 5, 7)), ("authors", (3, 5, 10))),
    empty_blocks=True,
    output_norm_without_normalize=True,
    conditioning="text",
    noise="flow",
    encode_prompts=_encode_wan,
    context_parallel="model",  # WanTransformer3DModel._cp_plan: split at blocks.0 (RoPE with it), gathered after proj_out
    max_grid=_max_grid_wan,
)

FAMILIES: dict[str, Family] = {f.name: f for f in (DIT, SANA, WAN)}

# Attention modules called alone, outside any supported transformer (with token_grid): diffusers'
# generic AttnProcessor2_0 behaviour. Not a registered family.
GENERIC = Family(
    name="",
    model_classes=(),
    self_attention=r"(?!)",
    patch_embed="",
    grid_from_latent=_grid_2d,
    reference_grid=_reference_grid_2d,
    stock_self_processor=_attn_processor_2_0,
)
_STOCK_SIGNATURES = {f.name: StockSignature(f.stock_self_processor()) for f in (*FAMILIES.values(), GENERIC)}
_BY_CLASS = {cls: f for f in FAMILIES.values() for cls in f.model_classes}
_BY_ATTENTION_CLASS = {cls: f for f in FAMILIES.values() for cls in f.attention_classes}


_BY_TYPE: dict[type, str | None] = {}


def find_family(model: nn.Module) -> Family | None:
    """The :class:`Family` of ``model`` (by class name, walking the MRO; cached per type), or ``None``."""
    name = family_name_of_type(type(model))
    return None if name is None else FAMILIES[name]  # a registry lookup: torch.compile can trace its methods


@torch.compiler.assume_constant_result  # traced by torch.compile: run once, a constant str of the graph
def family_name_of_type(model_type: type) -> str | None:
    """The name of the family whose transformer class ``model_type`` is (walking the MRO; cached), or ``None``."""
    try:
        return _BY_TYPE[model_type]
    except KeyError:
        pass
    family = next((_BY_CLASS[c.__name__] for c in model_type.__mro__ if c.__name__ in _BY_CLASS), None)
    _BY_TYPE[model_type] = None if family is None else family.name
    return _BY_TYPE[model_type]


def attention_family(attn: nn.Module) -> Family | None:
    """The family whose models alone use the attention module class of ``attn`` (Wan's ``WanAttention``),
    or ``None`` (the legacy diffusers ``Attention`` serves several families)."""
    name = _attention_family_name(type(attn))
    return None if name is None else FAMILIES[name]


@torch.compiler.assume_constant_result
def _attention_family_name(attn_type: type) -> str | None:
    return next((_BY_ATTENTION_CLASS[c.__name__].name for c in attn_type.__mro__ if c.__name__ in _BY_ATTENTION_CLASS), None)


def block_grid_preset_names() -> set[str]:
    """Every preset name some family knows (``"paper"``, ``"authors"``)."""
    return {name for f in FAMILIES.values() for name, _ in f.block_grid_presets}


def supported_model_classes() -> list[str]:
    """The class names of the transformers MHLA supports, sorted."""
    return sorted(_BY_CLASS)


def family_of(model: nn.Module) -> Family:
    """Like :func:`find_family` but raises ``ValueError`` naming the supported classes."""
    family = find_family(model)
    if family is None:
        raise ValueError(
            f"{type(model).__name__} is not a supported transformer; MHLA supports {supported_model_classes()}. "
            f"Pass the pipeline's transformer (pipe.transformer), not the pipeline."
        )
    return family


def get_family(family: "str | Family") -> Family:
    """The :class:`Family` named ``family`` (a :class:`Family` is returned as is).

    Raises:
        ValueError: for an unknown name, listing the known ones.
    """
    if isinstance(family, Family):
        return family
    if family not in FAMILIES:
        raise ValueError(f"unknown model family {family!r}; choose one of {sorted(FAMILIES)}")
    return FAMILIES[family]


def stock_processor(family: Family, module_name: str):
    """A fresh stock processor for the attention module ``module_name`` of a model of ``family``:
    the stock cross-attention processor for cross-attention layers, the stock self-attention
    processor otherwise (what ``remove_mhla`` must restore there)."""
    if family.cross_attention is not None and re.match(family.cross_attention, module_name):
        return family.make_stock_cross_processor()
    return family.stock_self_processor()


def self_attention_modules(model: nn.Module, family: Family | None = None) -> list[tuple[str, nn.Module]]:
    """``[(name, attention module)]`` of the self-attention layers, ordered by layer index."""
    family = family or family_of(model)
    pattern = re.compile(family.self_attention)
    found = []
    for name, module in model.named_modules():
        match = pattern.match(name)
        if match:
            found.append((int(match.group(1)), name, module))
    found.sort(key=lambda item: item[0])
    return [(name, module) for _, name, module in found]


def attention_modules(model: nn.Module) -> dict[str, nn.Module]:
    """All diffusers attention modules of ``model`` (those with ``set_processor``), keyed as diffusers
    keys ``attn_processors``: ``"<module path>.processor"``."""
    return {
        f"{name}.processor": module
        for name, module in model.named_modules()
        if hasattr(module, "set_processor") and hasattr(module, "processor")
    }
