"""What every model family shares: the :class:`Family` entry, the hooks a family may fill, the registry.

Generic modules ask the registry (:func:`family_of`, :func:`get_family`, :data:`FAMILIES`) and call
the entry's fields and hooks instead of naming families. Imports only torch and diffusers, so every
part of the package may import it. Fields and hooks in full: ``docs/families/index.md``.
"""

from __future__ import annotations

import inspect
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Callable

import torch
from diffusers.models.attention_processor import AttnProcessor2_0
from torch import nn

from mhla_diffusers.families.calls import FamilyAttention, StockSignature

__all__ = [
    "Family",
    "FAMILIES",
    "GENERIC",
    "Experts",
    "PipelineQuirks",
    "TrainingSpec",
    "GenerationError",
    "NATIVE_SIZE_KEY",
    "register_family",
    "get_family",
    "find_family",
    "family_name_of_type",
    "family_of",
    "family_of_class_name",
    "canonical_model_class",
    "attention_family",
    "attention_modules",
    "self_attention_modules",
    "stock_processor",
    "supported_model_classes",
    "block_grid_preset_names",
    "pipeline_quirks",
    "transformer_components",
    "pipeline_transformers",
    "expert_timestep_range",
    "posterior_sample",
    "encode_latents",
]

# The transformer's diffusers config key recording the size (pixels, frames) a model was trained at, when it
# differs from its family's (kept by save / load; written by the authors' Wan importer).
NATIVE_SIZE_KEY = "_mhla_native_size"


class GenerationError(ValueError):
    """Bad generation request (unknown label, wrong pipeline kind, ...)."""


# -- hooks a family may fill -------------------------------------------------------------------------
@dataclass(frozen=True)
class Experts:
    """Pipelines of a family that denoise with several transformers, each on its own timesteps (Wan 2.2 A14B).

    Attributes:
        components: the transformer components, in order (``("transformer", "transformer_2")``).
        timestep_range: ``(pipe, component) -> (low, high) | None``, the timesteps ``[low, high)`` it runs.
    """

    components: tuple[str, ...]
    timestep_range: Callable[[Any, str], "tuple[float, float] | None"]


class PipelineQuirks:
    """What the checkpoint format repairs in pipelines after diffusers saved or loaded them (DiT's ``id2label``).

    Every registered family's quirks see every pipeline and decide whether it is theirs; the defaults do nothing.
    """

    def after_load(self, pipe, path) -> None:
        """Called on a pipeline :func:`~mhla_diffusers.load_mhla_pipeline` loaded from the folder ``path``."""

    def after_save(self, pipe, folder) -> None:
        """Called after ``pipe.save_pretrained(folder)`` (the temporary folder being written)."""


class TrainingSpec:
    """The family-specific part of a training recipe (:mod:`mhla_diffusers.training.recipes` holds the rest).

    Methods take the recipe's ``TrainingParts`` as ``parts``; the generic recipe is class- or text-conditional
    (:attr:`Family.conditioning`).
    """

    recipe_name = ""  # the name of the family's recipe class (``DiTRecipe``)
    objective = "flow"  # ``"epsilon"`` (DDPM noise prediction) | ``"flow"`` (flow matching)
    from_scratch = False  # ``model.init`` builds the transformer from a config dict
    resizable = False  # ``model.sample_size`` continues a pretrained model at another latent size
    condition_keys: dict[str, str] = {}  # text families: encode_text's outputs -> the transformer's keywords

    def encode_latents(self, vae, pixels: torch.Tensor, generator=None, *, rank: int = 0, world_size: int = 1):
        """Clean fp32 latents of ``pixels`` (:func:`encode_latents` unless the family's VAE needs more)."""
        return encode_latents(vae, pixels, generator, rank=rank, world_size=world_size)

    def predict(self, model, noisy: torch.Tensor, timesteps: torch.Tensor, cond: dict) -> torch.Tensor:
        """The model's prediction (epsilon or flow velocity, by :attr:`objective`) for ``noisy`` at ``timesteps``."""
        raise NotImplementedError

    def prediction(self, output: torch.Tensor, noisy: torch.Tensor) -> torch.Tensor:
        """The prediction in :meth:`predict`'s terms from the transformer's ``sample`` output (the output itself)."""
        return output

    def finish_load(self, parts, config: dict) -> None:
        """Adjust or check the loaded ``parts`` (text families, after the generic load). Raises ``ValueError``."""

    def encode_text(self, parts, captions, device) -> dict:
        """Text families: ``captions`` through the pipeline's own ``encode_prompt`` (no grad)."""
        raise NotImplementedError


# -- the family entry ------------------------------------------------------------------------------
@dataclass(frozen=True)
class Family(FamilyAttention):
    """Model-family facts read by the processor, grid hooks, conversion, checkpoints, generation and training.

    One frozen entry per family, registered with :func:`register_family`; copies and pickles stand for the
    registered entry (:func:`get_family` by name). Per-call steps: :class:`~mhla_diffusers.families.calls.FamilyAttention`.
    """

    #: short name in configs and on the command line (``"dit"``).
    name: str
    #: diffusers class names of the family's transformers.
    model_classes: tuple[str, ...]
    #: regex over ``named_modules()`` names of self-attention layers; group 1 the layer index. A model with several
    #: kinds of self-attention layers (Wan VACE: main and VACE blocks) has one group per kind, in layer order.
    self_attention: str
    #: submodule turning the latent (its first positional input) into tokens.
    patch_embed: str
    #: ``(latent, config) -> (T, H, W)``, the token grid of one forward.
    grid_from_latent: Callable[[torch.Tensor, dict], tuple[int, int, int]]
    #: ``config -> (T, H, W)``, the token grid at the native resolution.
    reference_grid: Callable[[dict], tuple[int, int, int]]
    #: factory of the stock self-attention processor.
    stock_self_processor: Callable[[], object]
    #: denominator epsilon when the processor sets none (SANA: 1e-15, its stock one).
    default_eps: float = 1e-6
    #: regex of cross-attention layers (group 1 the index); ``None``: none.
    cross_attention: str | None = None
    #: factory of the stock cross-attention processor (run unchanged); ``None``: ``AttnProcessor2_0``.
    stock_cross_processor: Callable[[], object] | None = None
    #: q/k norms on ``[B, N, heads * d]`` before the head split (SANA, Wan), not per head.
    qk_norm_across_heads: bool = False
    #: ``"query"`` / ``"input"``: cast the output to the query's / the layer input's dtype before ``to_out``.
    attention_output_dtype: str = "query"
    #: clip the output (after ``to_out``) to ``[-clip, clip]`` for float16 inputs (SANA: 65504).
    fp16_output_clip: float | None = None
    #: ``"keywords"`` (diffusers' ``Attention``) or ``"positional"`` (``WanAttention``) processor calls.
    processor_call: str = "keywords"
    #: ``rotary_emb -> callable`` rotating ``[B, heads, N, d]`` features (Wan: ``WanRotary``); ``None``: no RoPE.
    rotary: Callable[[object], Callable[[torch.Tensor], torch.Tensor]] | None = None
    #: the stock self-attention cannot run without ``rotary_emb`` (SANA-Video's): MHLA refuses a call without it
    #: too instead of computing without RoPE (``rope="none"`` asks for that explicitly).
    rotary_required: bool = False
    #: attention classes only this family has (``WanAttention``): such a module follows this family.
    attention_classes: tuple[str, ...] = ()
    #: target ``M`` without ``num_blocks`` / ``block_grid`` (``None``: :func:`~mhla_diffusers.default_num_blocks`).
    default_num_blocks: int | None = None
    #: ``((name, (bt, bh, bw)), ...)``: named block grids.
    block_grid_presets: tuple[tuple[str, tuple[int, int, int]], ...] = ()
    #: a token grid smaller than the block grid runs with the non-empty blocks instead of raising.
    empty_blocks: bool = False
    #: ``normalize=False``, ``output_norm=None`` adds a per-head output RMSNorm (the authors' Wan).
    output_norm_without_normalize: bool = False
    #: kernel of the LePE depthwise convolution (``lepe=True``) over the token grid: ``(3, 3)`` (Conv2d over
    #: ``(H, W)``, each frame alone) for image families, ``(3, 3, 3)`` (Conv3d over ``(T, H, W)``) for video ones.
    lepe_kernel: tuple[int, ...] = (3, 3)
    #: ``"softmax"`` or ``"linear"``: the stock cost model, for automatic hybrid selection.
    stock_attention: str = "softmax"
    #: ``"class"`` (``class_labels`` ``[B]`` long) or ``"text"`` (states from :attr:`encode_prompts`).
    conditioning: str = "class"
    #: training noise process, for calibration: ``"ddpm"`` or ``"flow"`` (timestep ``1000 s``).
    noise: str = "ddpm"
    #: ``(pipe, prompts, device) -> {keyword: tensor}`` via the pipeline's ``encode_prompt``; ``None``: class families.
    encode_prompts: Callable[[object, list, object], dict] | None = None
    #: ``(config, latent, draw) -> {forward keyword: tensor}``: the further forward inputs of one calibration sample
    #: (Wan VACE: its control latent); ``draw(shape)`` is a smooth random ``[1, *shape]`` from calibration's generator.
    calibration_extras: Callable[[Mapping, torch.Tensor, Callable], dict] | None = None
    #: token split of :func:`~mhla_diffusers.context_parallel_plan`: ``"model"``, ``"trunk"``, ``"layers"`` or ``None``.
    context_parallel: str | None = None
    #: ``(first module, last module)`` of the ``"trunk"`` plan.
    cp_trunk: tuple[str, str] | None = None
    #: ``model -> cp_plan``: the ``"model"`` plan of a model class diffusers gives none (``None``: its ``_cp_plan``).
    cp_plan: Callable[[nn.Module], dict] | None = None
    #: ``config -> (T, H, W)``, the largest tokens per axis the forward takes (Wan: RoPE table); ``None``: no bound.
    max_grid: Callable[[dict], tuple[int, int, int]] | None = None
    #: each block can be an FSDP unit (``False`` for DiT: its root uses a block's submodule).
    fsdp_blocks: bool = True
    #: name in messages (``"DiT"``); ``""``: :attr:`name`.
    display_name: str = ""
    #: ``((config class name, model class name), ...)`` older checkpoints write (DiT: ``Transformer2DModel``).
    class_aliases: tuple[tuple[str, str], ...] = ()
    #: the family's diffusers pipeline classes.
    pipeline_classes: tuple[str, ...] = ()
    #: pipelines with several transformers (:class:`Experts`), or ``None``.
    experts: Experts | None = None
    #: pipeline repairs after diffusers saved / loaded it (:class:`PipelineQuirks`).
    pipeline_quirks: PipelineQuirks | None = None
    #: video families: ``config -> {"height", "width", "frames"}``, the trained size.
    native_video: Callable[[Mapping], dict] | None = None
    #: video families: ``(pipe, checkpoint) -> pipe``, the image-to-video form (or :class:`GenerationError`).
    image_to_video: Callable[[Any, Any], Any] | None = None
    #: the family's part of its training recipe (:class:`TrainingSpec`); ``None``: not trained here.
    training: TrainingSpec | None = None

    def __reduce__(self):  # a registry entry: copies and pickles stand for the registered family itself
        return get_family, (self.name,)

    def __post_init__(self):
        if self.attention_output_dtype not in ("query", "input"):
            raise ValueError(f"attention_output_dtype must be 'query' or 'input'; got {self.attention_output_dtype!r}")
        if self.processor_call not in ("keywords", "positional"):
            raise ValueError(f"processor_call must be 'keywords' or 'positional'; got {self.processor_call!r}")
        if self.stock_attention not in ("softmax", "linear") or self.conditioning not in ("class", "text"):
            raise ValueError(f"bad stock_attention {self.stock_attention!r} or conditioning {self.conditioning!r}")
        if len(self.lepe_kernel) not in (2, 3) or not all(isinstance(k, int) and k >= 1 and k % 2 for k in self.lepe_kernel):
            raise ValueError(f"lepe_kernel must be 2 or 3 odd positive integers; got {self.lepe_kernel!r}")
        if self.noise not in ("ddpm", "flow"):
            raise ValueError(f"noise must be 'ddpm' or 'flow'; got {self.noise!r}")
        if self.context_parallel not in (None, "model", "trunk", "layers") or (self.context_parallel == "trunk") != (
            self.cp_trunk is not None
        ):
            raise ValueError(
                f"context_parallel must be None, 'model', 'trunk' (with cp_trunk) or 'layers'; got {self.context_parallel!r}, "
                f"cp_trunk={self.cp_trunk!r}"
            )

    @property
    def title(self) -> str:
        """:attr:`display_name`, else :attr:`name`."""
        return self.display_name or self.name

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
        patch = patch_of(config)
        grid = self.reference_grid(config)[-len(patch):] if len(patch) > 1 else self.reference_grid(config)[1:]
        patch = patch if len(patch) > 1 else patch * 2
        return (int(config["in_channels"]), *(n * p for n, p in zip(grid, patch)))

    @property
    def stock_signature(self) -> StockSignature:
        """What the stock self-attention processor's ``__call__`` accepts (read once, at registration)."""
        return _STOCK_SIGNATURES[self.name]

    def make_stock_cross_processor(self):
        """A fresh instance of the stock cross-attention processor of this family."""
        if self.stock_cross_processor is not None:
            return self.stock_cross_processor()
        return attn_processor_2_0()

    def native_video_size(self, config) -> dict:
        """``{"height", "width", "frames"}`` the video transformer was trained at (:data:`NATIVE_SIZE_KEY`, else :attr:`native_video`).

        Raises:
            GenerationError: a recorded size that is not three positive integers.
            TypeError: a family without :attr:`native_video`.
        """
        recorded = config.get(NATIVE_SIZE_KEY) if hasattr(config, "get") else None
        if recorded is None:
            return self.native_video(config if hasattr(config, "get") else {})
        if not isinstance(recorded, Mapping) or sorted(recorded) != ["frames", "height", "width"] or not all(
            isinstance(v, int) and not isinstance(v, bool) and v >= 1 for v in recorded.values()
        ):
            raise GenerationError(
                f"the transformer config's {NATIVE_SIZE_KEY} must be {{'height': int, 'width': int, 'frames': int}}; "
                f"got {recorded!r}"
            )
        return dict(recorded)


# -- shared by the family modules ------------------------------------------------------------------
def patch_of(config) -> tuple[int, ...]:
    """The config's ``patch_size`` as a tuple (``(p,)`` for image models, ``(p_t, p_h, p_w)`` for video ones)."""
    p = config["patch_size"]
    return tuple(p) if isinstance(p, (tuple, list)) else (p,)


def grid_2d(latent: torch.Tensor, config) -> tuple[int, int, int]:
    """``(1, H / p, W / p)`` of a latent ``[B, C, H, W]``. Raises ``ValueError`` for another rank."""
    if latent.ndim != 4:
        raise ValueError(f"expected a latent [batch, channels, height, width]; got shape {tuple(latent.shape)}")
    (p,) = patch_of(config)[-1:]
    return (1, latent.shape[-2] // p, latent.shape[-1] // p)


def reference_grid_2d(config) -> tuple[int, int, int]:
    """``(1, H / p, W / p)`` at the config's ``sample_size`` (an int or ``(H, W)``)."""
    size = config["sample_size"]
    h, w = (size, size) if isinstance(size, int) else tuple(size)
    (p,) = patch_of(config)[-1:]
    return (1, h // p, w // p)


def grid_3d(latent: torch.Tensor, config) -> tuple[int, int, int]:
    """``(F / p_t, H / p_h, W / p_w)`` of a video latent ``[B, C, F, H, W]``. Raises ``ValueError`` for another rank."""
    if latent.ndim != 5:
        raise ValueError(f"expected a video latent [batch, channels, frames, height, width]; got shape {tuple(latent.shape)}")
    pt, ph, pw = patch_of(config)
    return (latent.shape[-3] // pt, latent.shape[-2] // ph, latent.shape[-1] // pw)


def call_default(pipe, name: str):
    """The default of the argument ``name`` of the pipeline's ``__call__`` (``None`` if it has none)."""
    parameter = inspect.signature(type(pipe).__call__).parameters.get(name)
    return None if parameter is None or parameter.default is inspect.Parameter.empty else parameter.default


def attn_processor_2_0():
    """A fresh diffusers ``AttnProcessor2_0``."""
    return AttnProcessor2_0()


def posterior_sample(latent_dist, generator: torch.Generator | None = None, *, rank: int = 0, world_size: int = 1) -> torch.Tensor:
    """A VAE posterior sample whose noise is drawn for the global batch and sliced (rank ``r``, sample ``j``: ``j * world_size + r``).

    Same latents for the same global batch whatever the process count; one process: ``latent_dist.sample(generator)``.
    Non-Gaussian posteriors (:class:`~mhla_diffusers.PointLatentDistribution`) sample as they do.

    Returns:
        ``[B, ...]`` in the posterior's dtype.
    """
    from diffusers.models.autoencoders.vae import DiagonalGaussianDistribution

    if world_size == 1 or not isinstance(latent_dist, DiagonalGaussianDistribution):
        return latent_dist.sample(generator=generator)
    mean = latent_dist.mean
    b = mean.shape[0]
    noise = torch.randn((b * world_size,) + tuple(mean.shape[1:]), generator=generator, device=mean.device, dtype=mean.dtype)
    return mean + latent_dist.std * noise[torch.arange(b, device=mean.device) * world_size + rank]


def encode_latents(vae, pixels: torch.Tensor, generator: torch.Generator | None = None, *, rank: int = 0,
                   world_size: int = 1) -> torch.Tensor:
    """``vae.encode(pixels)`` -> fp32 latents times ``scaling_factor`` (KL: a posterior sample,
    :func:`posterior_sample`; DC-AE: ``.latent``)."""
    out = vae.encode(pixels.to(vae.dtype))
    if hasattr(out, "latent_dist"):
        z = posterior_sample(out.latent_dist, generator, rank=rank, world_size=world_size)
    elif hasattr(out, "latent"):
        z = out.latent
    else:
        z = out[0]
    return z.float() * vae.config.scaling_factor


# -- the registry ------------------------------------------------------------------------------------
FAMILIES: dict[str, Family] = {}  # name -> entry, in registration order (families/__init__.py)
_BY_CLASS: dict[str, Family] = {}
_BY_ATTENTION_CLASS: dict[str, Family] = {}
_BY_TYPE: dict[type, str | None] = {}
_STOCK_SIGNATURES: dict[str, StockSignature] = {}


def register_family(family: Family) -> Family:
    """Add ``family`` to the registry (what a family module does with its entry); returns it.

    Raises:
        ValueError: a family of that name, or one claiming one of its model / attention classes, is registered.
    """
    taken = [c for c in family.model_classes if c in _BY_CLASS] + [c for c in family.attention_classes if c in _BY_ATTENTION_CLASS]
    if family.name in FAMILIES or taken:
        raise ValueError(f"cannot register the family {family.name!r}: its name or classes {taken} are registered already")
    _STOCK_SIGNATURES[family.name] = StockSignature(family.stock_self_processor())
    FAMILIES[family.name] = family
    _BY_CLASS.update({cls: family for cls in family.model_classes})
    _BY_ATTENTION_CLASS.update({cls: family for cls in family.attention_classes})
    _BY_TYPE.clear()
    return family


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


def canonical_model_class(name):
    """The model class a ``config.json``'s ``_class_name`` ``name`` stands for (:attr:`Family.class_aliases`:
    ``Transformer2DModel`` -> ``DiTTransformer2DModel``); any other value is returned as is."""
    for family in FAMILIES.values():
        for alias, cls in family.class_aliases:
            if name == alias:
                return cls
    return name


def family_of_class_name(name) -> Family | None:
    """The family whose :attr:`Family.model_classes` hold the class name ``name``, or ``None``."""
    return _BY_CLASS.get(name) if isinstance(name, str) else None


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
    """``[(name, attention module)]`` of the self-attention layers in layer order: by index, and by kind first where
    :attr:`Family.self_attention` has one group per kind (Wan VACE: every main block, then every VACE block).
    A layer's position in this list is its layer number (``apply_mhla(layers=...)``, selections, checkpoints)."""
    family = family or family_of(model)
    pattern = re.compile(family.self_attention)
    found = []
    for name, module in model.named_modules():
        match = pattern.match(name)
        if match:
            kind, index = next((k, int(g)) for k, g in enumerate(match.groups()) if g is not None)
            found.append(((kind, index), name, module))
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


# Attention modules called alone, outside any supported transformer (with token_grid): diffusers'
# generic AttnProcessor2_0 behaviour. Not a registered family.
GENERIC = Family(
    name="",
    model_classes=(),
    self_attention=r"(?!)",
    patch_embed="",
    grid_from_latent=grid_2d,
    reference_grid=reference_grid_2d,
    stock_self_processor=attn_processor_2_0,
)
_STOCK_SIGNATURES[GENERIC.name] = StockSignature(GENERIC.stock_self_processor())


# -- pipelines ---------------------------------------------------------------------------------------
def pipeline_quirks() -> list[PipelineQuirks]:
    """The :attr:`Family.pipeline_quirks` of every registered family, in registration order."""
    return [f.pipeline_quirks for f in FAMILIES.values() if f.pipeline_quirks is not None]


def transformer_components() -> tuple[str, ...]:
    """The pipeline components that are transformers MHLA may be installed on: ``transformer``, then those of
    every family's :attr:`Family.experts` (Wan 2.2 A14B: ``transformer_2``)."""
    names = ["transformer"]
    for family in FAMILIES.values():
        names += [n for n in (family.experts.components if family.experts else ()) if n not in names]
    return tuple(names)


def pipeline_transformers(pipe) -> dict[str, nn.Module]:
    """``{component name: transformer}`` of a pipeline, in :func:`transformer_components` order, those present
    only (Wan 2.2 A14B: ``transformer`` and ``transformer_2``; a Wan 2.2 pipeline saved with ``transformer``
    set to ``None`` has the second only)."""
    return {name: t for name in transformer_components() if (t := getattr(pipe, name, None)) is not None}


def expert_timestep_range(pipe, expert: str) -> tuple[float, float] | None:
    """The timesteps ``[low, high)`` (0..num_train_timesteps) on which ``pipe`` runs transformer ``expert``; ``None``: every one.

    The one source of these ranges (training, calibration); asks :attr:`Family.experts`.
    """
    present = pipeline_transformers(pipe)
    for family in FAMILIES.values():
        if family.experts is not None and sum(name in present for name in family.experts.components) >= 2:
            return family.experts.timestep_range(pipe, expert)
    return None
