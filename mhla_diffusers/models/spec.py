"""What an :class:`~mhla_diffusers.MHLAProcessor` asks of a layer: its settings, checked at construction,
and the block grid, output norm, output gate and LePE they give a layer of a model whose native token
grid is known.

Install-time only: nothing here runs on a forward once the layer's state exists and is checked.
"""

from __future__ import annotations

import math
import warnings
from typing import Sequence

import torch

from mhla_diffusers.models.families import FAMILIES, block_grid_preset_names
from mhla_diffusers.ops import available_backends
from mhla_diffusers.ops.layout import choose_block_grid, normalize_grid
from mhla_diffusers.ops.mixing import MixingMatrix
from mhla_diffusers.ops.positional import DENOMINATORS

__all__ = [
    "GATE_FORMS", "ROPE_MODES", "LEPE_INITS", "AUTHORS_CONSTANT", "AUTHORS_CONSTANT_VALUE",
    "check_settings", "check_mixing_init", "check_lepe_init", "check_family_settings", "resolve_block_grid",
    "explicit_block_grid", "resolve_output_norm", "resolve_gate", "resolve_lepe", "resolve_input_norm", "check_layer",
    "DENOMINATORS", "SETTINGS_OFF",
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


def _check_power(feature_power) -> float:
    if (
        isinstance(feature_power, bool) or not isinstance(feature_power, (int, float))
        or not 0 < feature_power < math.inf
    ):
        raise ValueError(f"feature_power must be a finite number > 0 (phi = ReLU(x) ** p; 1 = ReLU); got {feature_power!r}")
    return float(feature_power)


def check_settings(
    num_blocks, block_grid, normalize: bool, eps, backend: str, feature_eps, *, feature_power=1.0, rope=None,
    gate=None, lepe=None, input_norm=None, denominator="paper",
) -> dict:
    """The processor's settings, checked and normalised: ``num_blocks``, ``block_grid`` (a tuple or
    ``None``), ``block_grid_preset`` (a name or ``None``), ``normalize``, ``eps``, ``backend``,
    ``feature_eps``, ``feature_power``, ``rope`` (``None`` or one of :data:`ROPE_MODES`), ``gate`` (``None``,
    ``False`` or one of :data:`GATE_FORMS`), ``lepe`` and ``input_norm`` (``None`` or a bool), ``denominator``
    (one of :data:`DENOMINATORS`); see :class:`~mhla_diffusers.MHLAProcessor` for their meaning.

    Raises:
        ValueError: bad ``num_blocks``, ``block_grid``, ``eps``, ``feature_eps``, ``feature_power``, ``rope``,
            ``gate``, ``lepe``, ``input_norm``, ``denominator`` (or ``"authors_dit"`` without the normaliser) or
            ``backend``; an unknown preset name; ``num_blocks`` contradicting
            ``block_grid``; ``eps=0`` with the normaliser.
    """
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
    if eps is not None and (isinstance(eps, bool) or not isinstance(eps, (int, float)) or not 0 <= eps < math.inf):
        raise ValueError(f"eps must be a finite number >= 0 (or None: the family default); got {eps!r}")
    if eps is not None and eps == 0 and normalize:
        raise ValueError(
            "eps=0 with the normaliser gives 0 / 0 = NaN for every query or block whose ReLU features are all "
            "zero (any negative q or key block); use a small positive eps (the family default: eps=None)"
        )
    if backend != "auto" and backend not in available_backends():
        raise ValueError(f"unknown backend {backend!r}; choose 'auto' or one of {available_backends()}")
    if isinstance(feature_eps, bool) or not isinstance(feature_eps, (int, float)) or not 0 <= feature_eps < math.inf:
        raise ValueError(f"feature_eps must be a finite number >= 0; got {feature_eps!r}")
    if rope is not None and not (isinstance(rope, str) and rope in ROPE_MODES):
        raise ValueError(
            f"rope must be one of {list(ROPE_MODES)} or None (the family's: 'after' where it has RoPE); got {rope!r}"
        )
    for name, value in (("lepe", lepe), ("input_norm", input_norm)):
        if value is not None and not isinstance(value, bool):
            raise ValueError(f"{name} must be True, False or None (the layer's: none at a fresh install); got {value!r}")
    if not (isinstance(denominator, str) and denominator in DENOMINATORS):
        raise ValueError(f"denominator must be one of {list(DENOMINATORS)} ('authors_dit': the authors' DiT layer's); "
                         f"got {denominator!r}")
    if denominator != "paper" and not normalize:
        raise ValueError(f"denominator={denominator!r} is a normaliser: it needs normalize=True")
    return dict(
        num_blocks=None if num_blocks is None else int(num_blocks), block_grid=block_grid, block_grid_preset=preset,
        normalize=bool(normalize), eps=eps, backend=backend, feature_eps=float(feature_eps),
        feature_power=_check_power(feature_power), rope=rope, gate=_check_gate(gate), lepe=lepe, input_norm=input_norm,
        denominator=denominator,
    )


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


def resolve_output_norm(processor, family=None) -> bool:
    """Whether layers installed by ``processor`` get a per-head output RMSNorm (its ``output_norm``; ``None``:
    the family's default, on for Wan exactly when ``normalize=False``)."""
    if processor.output_norm is not None:
        return processor.output_norm
    family = family or processor.family
    return bool(family is not None and family.output_norm_without_normalize and not processor.normalize)


def resolve_gate(processor) -> str | None:
    """The gate form layers installed by ``processor`` get (:data:`GATE_FORMS`), or ``None`` for no gate."""
    return processor.gate or None


def resolve_lepe(processor) -> bool:
    """Whether layers installed by ``processor`` get a LePE convolution (``lepe=None``: no, as a fresh install)."""
    return bool(processor.lepe)


def resolve_input_norm(processor) -> bool:
    """Whether layers installed by ``processor`` get an input LayerNorm (``input_norm=None``: no, as a fresh install)."""
    return bool(getattr(processor, "input_norm", None))


def check_layer(processor, attn, reference_grid: Sequence[int] | None = None, family=None) -> None:
    """Refuse a layer whose MHLA state (block grid, output norm, gate, LePE) contradicts ``processor``'s
    explicit settings, or settings its family cannot run (:func:`check_family_settings`).

    Raises:
        ValueError: naming both settings and the fix, ``mhla_diffusers.remove_mhla(model)`` first.
    """
    family = family or processor.family
    check_family_settings(processor, family)
    mixing = getattr(attn, "mhla_mixing", None)
    if mixing is None:
        return
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
    has_norm = getattr(attn, "mhla_output_norm", None) is not None
    if processor.output_norm is not None and has_norm != processor.output_norm:
        raise ValueError(
            f"this layer {'has' if has_norm else 'has no'} MHLA output norm but the processor asks for "
            f"output_norm={processor.output_norm}; call mhla_diffusers.remove_mhla(model) first to change it"
        )
    gate = getattr(attn, "mhla_gate", None)
    has_gate = None if gate is None else gate.form
    if processor.gate is not None and has_gate != (processor.gate or None):
        now = f"an output gate of the form {has_gate!r}" if has_gate else "no output gate"
        raise ValueError(
            f"this layer has {now} but the processor asks for gate={processor.gate!r}; call "
            "mhla_diffusers.remove_mhla(model) first to change it (or use an MHLAProcessor without gate= to run the layer's)"
        )
    has_norm_in = getattr(attn, "mhla_input_norm", None) is not None
    if getattr(processor, "input_norm", None) is not None and has_norm_in != processor.input_norm:
        raise ValueError(
            f"this layer {'has' if has_norm_in else 'has no'} MHLA input LayerNorm but the processor asks for "
            f"input_norm={processor.input_norm}; call mhla_diffusers.remove_mhla(model) first to change it (or use an "
            "MHLAProcessor without input_norm= to run the layer's)"
        )
    has_lepe = getattr(attn, "mhla_lepe", None) is not None
    if processor.lepe is not None and has_lepe != processor.lepe:
        raise ValueError(
            f"this layer {'has' if has_lepe else 'has no'} LePE convolution but the processor asks for lepe={processor.lepe}; "
            "call mhla_diffusers.remove_mhla(model) first to change it (or use an MHLAProcessor without lepe= to run the layer's)"
        )


def _spec_text(processor, wanted) -> str:
    if processor.block_grid is not None:
        return f"block_grid={processor.block_grid}"
    preset = processor.block_grid_preset
    spec = f"block_grid={preset!r}" if preset is not None else f"num_blocks={processor.num_blocks}"
    return spec if wanted is None else f"{spec} (block grid {wanted})"
