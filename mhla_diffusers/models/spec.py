"""What an MHLA layer computes, as one value (:class:`LayerSettings`), and what a processor asks of a layer.

An :class:`~mhla_diffusers.MHLAProcessor`'s settings are checked at its construction (:func:`check_settings`);
those given explicitly are defaults for a layer that has no MHLA yet (:func:`resolve_settings`) and, over a
layer that has, must agree with the layer's record (:func:`check_layer`). Install-time only: nothing here
runs on a forward once a layer exists and is checked.
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from typing import Sequence

import torch

from mhla_diffusers.families import FAMILIES, block_grid_preset_names
from mhla_diffusers.ops import available_backends
from mhla_diffusers.ops.layout import choose_block_grid, normalize_grid
from mhla_diffusers.ops.mixing import MixingMatrix
from mhla_diffusers.ops.positional import DENOMINATORS

__all__ = [
    "GATE_FORMS", "ROPE_MODES", "LEPE_INITS", "AUTHORS_CONSTANT", "AUTHORS_CONSTANT_VALUE", "DENOMINATORS", "SETTINGS_OFF",
    "LayerSettings", "check_settings", "check_mixing_init", "check_lepe_init", "check_family_settings",
    "resolve_block_grid", "explicit_block_grid", "resolve_settings", "check_layer",
]

# The output gate's forms: "neutral" multiplies by 2 sigmoid(W x + b) (W = 0, b = 0 at the start: exactly the
# output without gate), "authors" by SiLU(W x + b) (nn.Linear's default init: the authors' g_fn(g(x))).
GATE_FORMS = ("neutral", "authors")
# Where RoPE goes in a family with RoPE (Wan): "after" the feature map, numerator only (the default, the authors'
# rope_after), "before" it (q and k rotated, then phi; numerator and denominator on those features), or "none".
ROPE_MODES = ("after", "before", "none")
# LePE's start: "zeros" (weight and bias zero: the output without LePE) or "authors" (PyTorch's default conv init).
LEPE_INITS = ("zeros", "authors")
# The mixing init that starts as the authors' Wan run did (their MHLA_Video_Uni built with fixed_weight_value =
# 1e-6): the mixing matrix and, where the layer has one, the output RMSNorm's weight constant at 1e-6.
AUTHORS_CONSTANT = "authors_constant"
AUTHORS_CONSTANT_VALUE = 1e-6
# Each optional layer setting at its off value, in the order mhla_config.json writes them: a recorded spec
# (installer.mhla_spec) holds only those that are on; a checkpoint missing one reads it as off.
SETTINGS_OFF = {
    "output_norm": False, "feature_eps": 0.0, "feature_power": 1.0, "mixing_clamp": True, "rope": None, "gate": None,
    "lepe": False, "input_norm": False, "denominator": "paper",
}


@dataclasses.dataclass(frozen=True)
class LayerSettings:
    """Everything that defines what one MHLA layer computes (paper Sec. 3.2 and the authors' options).

    Attributes:
        block_grid: ``(bt, bh, bw)``, fixed per layer (stretched over the token grid of each call).
        normalize: divide by ``phi(q) . z~ + eps`` (the paper) or the numerator alone.
        eps: the denominator epsilon (resolved: the family's when the user gave none).
        feature_eps, feature_power: ``phi(x) = ReLU(x) ** feature_power + feature_eps``.
        mixing_clamp: the mixing matrix used clamped to ``[0, 1]`` (the paper) or as stored.
        rope: families with RoPE: ``"after"`` / ``"before"`` the feature map or ``"none"``; ``None`` without RoPE.
        denominator: ``"paper"`` or ``"authors_dit"`` (:mod:`~mhla_diffusers.ops.positional`).
        output_norm: a per-head RMSNorm on the attention output.
        gate: ``None`` or a form of :data:`GATE_FORMS`.
        lepe: a depthwise convolution of the values added to the output.
        input_norm: a LayerNorm on the tokens entering the layer (the authors' DiT layer).
    """

    block_grid: tuple[int, int, int]
    normalize: bool = True
    eps: float = 1e-6
    feature_eps: float = 0.0
    feature_power: float = 1.0
    mixing_clamp: bool = True
    rope: str | None = None
    denominator: str = "paper"
    output_norm: bool = False
    gate: str | None = None
    lepe: bool = False
    input_norm: bool = False


def check_mixing_init(init) -> str:
    """``init`` if it names a mixing-matrix start: one :class:`~mhla_diffusers.ops.mixing.MixingMatrix` knows
    (ops/mixing.py is the one list: asked by building a 2-block matrix) or :data:`AUTHORS_CONSTANT`.

    Raises:
        ValueError: another name, with MixingMatrix's own list of the names it knows.
    """
    if init == AUTHORS_CONSTANT:
        return init
    try:
        MixingMatrix((1, 1, 2), init=init)
    except ValueError as err:
        raise ValueError(
            f"unknown mixing-matrix init {init!r}: {err} (mhla_diffusers.ops.mixing.MixingMatrix); or "
            f"{AUTHORS_CONSTANT!r}, the authors' Wan start (mixing matrix and output-norm weight at "
            f"{AUTHORS_CONSTANT_VALUE:g})"
        ) from None
    return init


def check_lepe_init(lepe_init) -> str:
    """``lepe_init`` if it is one of :data:`LEPE_INITS`; else ``ValueError`` naming them."""
    if isinstance(lepe_init, str) and lepe_init in LEPE_INITS:
        return lepe_init
    raise ValueError(
        f"lepe_init must be one of {list(LEPE_INITS)} ('zeros': weight and bias 0, the output without LePE at the "
        f"start; 'authors': PyTorch's default conv init); got {lepe_init!r}"
    )


# -- a processor's settings, checked at its construction ---------------------------------------------
def _check_gate(gate):
    """``None`` (the layer's), ``False`` (none) or a form of :data:`GATE_FORMS` (``True``: ``"neutral"``)."""
    if gate is None or gate is False:
        return gate
    if gate is True:
        return "neutral"
    if isinstance(gate, str) and gate in GATE_FORMS:
        return gate
    raise ValueError(
        f"gate must be one of {list(GATE_FORMS)} ('neutral': out * 2 sigmoid(W x + b), W = b = 0 at the start; "
        f"'authors': out * SiLU(W x + b), nn.Linear's init), True ('neutral'), False or None (no gate); got {gate!r}"
    )


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _check_numbers(eps, feature_eps, feature_power, normalize) -> None:
    """``eps`` / ``feature_eps`` finite ``>= 0``, ``feature_power`` finite ``> 0`` (each ``None`` or given)."""
    if eps is not None and not (_is_number(eps) and 0 <= eps < math.inf):
        raise ValueError(f"eps must be a finite number >= 0 (or None: the layer's, the family default when fresh); got {eps!r}")
    if eps is not None and eps == 0 and normalize is not False:
        raise ValueError(
            "eps=0 with the normaliser gives 0 / 0 = NaN for every query or block whose ReLU features are all "
            "zero (any negative q or key block); use a small positive eps (or eps=None: the family default), or "
            "normalize=False"
        )
    if feature_eps is not None and not (_is_number(feature_eps) and 0 <= feature_eps < math.inf):
        raise ValueError(f"feature_eps must be a finite number >= 0; got {feature_eps!r}")
    if feature_power is not None and not (_is_number(feature_power) and 0 < feature_power < math.inf):
        raise ValueError(f"feature_power must be a finite number > 0 (phi = ReLU(x) ** p; 1 = ReLU); got {feature_power!r}")


def _check_block_spec(num_blocks, block_grid) -> tuple:
    """``(num_blocks, block grid tuple or None, preset name or None)``, checked."""
    if num_blocks is not None and (isinstance(num_blocks, bool) or int(num_blocks) != num_blocks or num_blocks < 1):
        raise ValueError(f"num_blocks must be a positive integer or None; got {num_blocks!r}")
    preset = None
    if isinstance(block_grid, str):
        if block_grid not in block_grid_preset_names():
            raise ValueError(
                f"unknown block-grid preset {block_grid!r}; known presets: {sorted(block_grid_preset_names())} "
                "(or give a tuple (bt, bh, bw))"
            )
        if num_blocks is not None:
            raise ValueError(f"give num_blocks or the preset block_grid={block_grid!r}, not both")
        preset, block_grid = block_grid, None
    block_grid = None if block_grid is None else normalize_grid(tuple(block_grid), "block_grid")
    if block_grid is not None and num_blocks is not None and math.prod(block_grid) != num_blocks:
        raise ValueError(
            f"num_blocks={num_blocks} contradicts block_grid={block_grid} ({math.prod(block_grid)} blocks); give one of them"
        )
    return None if num_blocks is None else int(num_blocks), block_grid, preset


def _check_choices(backend, rope, denominator, normalize, flags: dict) -> None:
    """``backend``, ``rope``, ``denominator`` among their names; ``flags`` (``lepe``, ``input_norm``, ...) booleans."""
    if backend != "auto" and backend not in available_backends():
        raise ValueError(f"unknown backend {backend!r}; choose 'auto' or one of {available_backends()}")
    if rope is not None and not (isinstance(rope, str) and rope in ROPE_MODES):
        raise ValueError(f"rope must be one of {list(ROPE_MODES)} or None (the layer's; 'after' where the family has RoPE); got {rope!r}")
    for name, value in flags.items():
        if value is not None and not isinstance(value, bool):
            raise ValueError(f"{name} must be True, False or None (the layer's; off at a fresh install); got {value!r}")
    if denominator is not None and not (isinstance(denominator, str) and denominator in DENOMINATORS):
        raise ValueError(f"denominator must be one of {list(DENOMINATORS)} ('authors_dit': the authors' DiT layer's); "
                         f"got {denominator!r}")
    if denominator not in (None, "paper") and normalize is False:
        raise ValueError(f"denominator={denominator!r} is a normaliser: it needs normalize=True")


def check_settings(
    num_blocks=None, block_grid=None, normalize=None, eps=None, backend: str = "auto", feature_eps=None, *,
    feature_power=None, rope=None, gate=None, lepe=None, input_norm=None, denominator=None, mixing_clamp=None,
    output_norm=None,
) -> dict:
    """The processor's settings, checked and normalised (``None``: not given, the layer's): ``num_blocks``,
    ``block_grid`` (a tuple), ``block_grid_preset`` (a name), ``normalize``, ``eps``, ``backend``, ``feature_eps``,
    ``feature_power`` (floats), ``rope`` (:data:`ROPE_MODES`), ``gate`` (``False`` or :data:`GATE_FORMS`), ``lepe``,
    ``input_norm``, ``mixing_clamp``, ``output_norm`` (bools), ``denominator`` (:data:`DENOMINATORS`); meanings:
    :class:`~mhla_diffusers.MHLAProcessor`.

    Raises:
        ValueError: a bad value of any of them; an unknown preset name; ``num_blocks`` contradicting
            ``block_grid``; ``eps=0`` with the normaliser; ``"authors_dit"`` with ``normalize=False``.
    """
    num_blocks, block_grid, preset = _check_block_spec(num_blocks, block_grid)
    _check_numbers(eps, feature_eps, feature_power, normalize)
    flags = dict(normalize=normalize, lepe=lepe, input_norm=input_norm, mixing_clamp=mixing_clamp, output_norm=output_norm)
    _check_choices(backend, rope, denominator, normalize, flags)
    as_float = {name: None if value is None else float(value)
                for name, value in (("eps", eps), ("feature_eps", feature_eps), ("feature_power", feature_power))}
    return dict(num_blocks=num_blocks, block_grid=block_grid, block_grid_preset=preset, backend=backend, rope=rope,
                gate=_check_gate(gate), denominator=denominator, **flags, **as_float)


def check_family_settings(processor, family) -> None:
    """Refuse settings the family cannot run: ``rope="after"`` / ``"before"`` given for a family without RoPE
    (``"none"`` is accepted there: nothing to rotate). ``family=None`` (unknown): nothing is checked.

    Raises:
        ValueError: naming the family and the fix.
    """
    rope = getattr(processor, "rope", None)
    if family is None or getattr(family, "rotary", None) is not None or rope not in ("after", "before"):
        return
    name = getattr(family, "title", "") or "this"
    with_rope = ", ".join(f.title for f in FAMILIES.values() if f.rotary is not None) or "none"
    raise ValueError(
        f"rope={rope!r} places RoPE in the attention, but the {name} family has no RoPE (families with RoPE: "
        f"{with_rope}); leave rope unset (or rope='none')"
    )


# -- the block grid ------------------------------------------------------------------------------------
def resolve_block_grid(processor, reference_grid: Sequence[int], family=None) -> tuple[int, int, int]:
    """The block grid ``processor`` gives a layer of a model whose native token grid is ``reference_grid``.

    Raises:
        ValueError: a preset name without a family, or one the family does not have.
    """
    if processor.block_grid is not None:
        return processor.block_grid
    family = family or processor.family
    if processor.block_grid_preset is not None:
        if family is None:
            raise ValueError(f"the block-grid preset {processor.block_grid_preset!r} needs the model family (pass family=)")
        return family.preset(processor.block_grid_preset)
    num_blocks = processor.num_blocks
    if num_blocks is None and family is not None:
        num_blocks = family.default_num_blocks
    grid = choose_block_grid(reference_grid, num_blocks)
    if processor.num_blocks is not None:
        _tell_chosen_grid(processor, reference_grid, grid)
    return grid


def _tell_chosen_grid(processor, reference_grid: Sequence[int], grid: tuple[int, int, int]) -> None:
    """Warn (once per processor and grid) when the block grid chosen for the user's ``num_blocks``
    does not have that many blocks: never a silently different ``M``."""
    reference = normalize_grid(tuple(reference_grid))
    blocks, wanted = math.prod(grid), processor.num_blocks
    told = processor._told_block_grids
    if blocks == wanted or (reference, grid) in told or torch.compiler.is_compiling():
        return
    told.add((reference, grid))
    tokens = math.prod(reference)
    shape = " x ".join(str(n) for n in reference if n > 1) or "1"
    if wanted > math.isqrt(tokens):
        why = (
            f"MHLA keeps M^2 <= N (the mixing then costs no more than the block summaries), so the native token grid "
            f"{shape} (N = {tokens}) allows at most M = {max(1, math.isqrt(tokens))}"
        )
    else:
        why = f"the native token grid {shape} (N = {tokens}) has no near-square split into exactly {wanted} blocks"
    warnings.warn(
        f"num_blocks={wanted}: {why}; using block grid {grid} (M = {blocks}). Give a num_blocks "
        "this grid allows, or an explicit block_grid, to silence this warning",
        UserWarning,
        stacklevel=4,
    )


def explicit_block_grid(processor, reference_grid: Sequence[int] | None, family) -> tuple[int, int, int] | None:
    """The block grid the processor's explicit spec gives on ``reference_grid`` (``None``: no spec, or a
    ``num_blocks`` / preset that cannot be resolved without the model)."""
    if processor.block_grid is not None:
        return processor.block_grid
    if processor.block_grid_preset is not None:
        return None if family is None else family.preset(processor.block_grid_preset)
    if processor.num_blocks is not None and reference_grid is not None:
        return resolve_block_grid(processor, reference_grid, family)
    return None


# -- a processor's settings against a layer --------------------------------------------------------------
def _rope_of(rope, family):
    """``rope`` as a layer of ``family`` records it: ``None`` for a family without RoPE, else a mode (default "after")."""
    if family is None or getattr(family, "rotary", None) is None:
        return None
    return rope or "after"


def requested_settings(processor, family) -> dict:
    """The :class:`LayerSettings` fields ``processor`` was given explicitly, as a layer of ``family`` would record
    them (the block grid apart: :func:`explicit_block_grid`)."""
    wanted = {name: getattr(processor, name, None) for name in (
        "normalize", "eps", "feature_eps", "feature_power", "mixing_clamp", "denominator", "output_norm", "lepe", "input_norm")}
    wanted = {name: value for name, value in wanted.items() if value is not None}
    if processor.gate is not None:
        wanted["gate"] = processor.gate or None
    if processor.rope is not None and family is not None:  # family unknown: checked once it is known
        wanted["rope"] = _rope_of(processor.rope, family)
    return wanted


def resolve_settings(processor, family, reference_grid: Sequence[int] | None, block_grid=None) -> LayerSettings:
    """The :class:`LayerSettings` ``processor`` gives a layer without MHLA of a ``family`` model whose native token
    grid is ``reference_grid``: its explicit settings, the defaults for the rest (``eps``: the family's;
    ``output_norm``: the family's rule, Wan with ``normalize=False``). ``block_grid``: given instead of resolved.

    Raises:
        ValueError: settings the family cannot run (:func:`check_family_settings`), a preset it lacks.
    """
    check_family_settings(processor, family)
    wanted = requested_settings(processor, family)
    normalize = wanted.get("normalize", True)
    defaults = dict(
        normalize=normalize,
        eps=getattr(family, "default_eps", 1e-6),
        rope=_rope_of(None, family),
        output_norm=bool(family is not None and family.output_norm_without_normalize and not normalize),
    )
    grid = block_grid if block_grid is not None else resolve_block_grid(processor, reference_grid, family)
    return LayerSettings(block_grid=tuple(normalize_grid(tuple(grid))), **{**defaults, **wanted})


def check_layer(processor, layer, reference_grid: Sequence[int] | None = None, family=None, *, partial=False) -> None:
    """Refuse a layer whose MHLA record (``layer``, an :class:`~mhla_diffusers.models.layer.MHLALayer`)
    contradicts a setting ``processor`` was given explicitly, or settings its family cannot run. ``partial``: the
    model is not known yet (a processor being set): a ``num_blocks`` without the native grid is left for later.

    Raises:
        ValueError: naming the setting, both values and the fixes (a processor without that setting runs the
            layer as recorded; ``mhla_diffusers.remove_mhla(model)`` first installs afresh).
    """
    family = family or processor.family
    check_family_settings(processor, family)
    if not (partial and reference_grid is None and processor.block_grid is None and processor.num_blocks is not None):
        _check_block_grid(processor, layer, reference_grid, family)
    have = layer.settings
    for name, value in requested_settings(processor, family).items():
        if getattr(have, name) != value:
            raise ValueError(
                f"this layer's MHLA was made with {name}={getattr(have, name)!r} but the processor asks for "
                f"{name}={getattr(processor, name)!r}. MHLA never changes what an existing layer computes: use an MHLAProcessor without "
                f"{name}= to run the layer as recorded, or call mhla_diffusers.remove_mhla(model) first to install MHLA "
                "afresh (new parameters)"
            )


def _check_block_grid(processor, layer, reference_grid, family) -> None:
    """The block-grid part of :func:`check_layer`."""
    mixing = layer.mixing
    wanted = explicit_block_grid(processor, reference_grid, family)
    if wanted is None and processor.num_blocks is not None and reference_grid is None:
        mismatch = mixing.num_blocks != processor.num_blocks
    else:
        mismatch = wanted is not None and tuple(mixing.block_grid) != tuple(wanted)
    if mismatch:
        raise ValueError(
            f"this layer already has a mixing matrix for block grid {mixing.block_grid}, but the processor asks "
            f"for {_spec_text(processor, wanted)}. MHLA neither keeps the old matrix under a new spec nor replaces it "
            "silently: call mhla_diffusers.remove_mhla(model) first to install the new block grid (fresh locality-init "
            "matrices), or use an MHLAProcessor without num_blocks / block_grid to keep the layer's matrix"
        )


def _spec_text(processor, wanted) -> str:
    if processor.block_grid is not None:
        return f"block_grid={processor.block_grid}"
    preset = processor.block_grid_preset
    spec = f"block_grid={preset!r}" if preset is not None else f"num_blocks={processor.num_blocks}"
    return spec if wanted is None else f"{spec} (block grid {wanted})"
