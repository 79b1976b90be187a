"""What an :class:`~mhla_diffusers.MHLAProcessor` asks of a layer: its settings, checked at construction,
and the block grid and output norm they give a layer of a model whose native token grid is known.

Install-time only: nothing here runs on a forward once the layer's state exists and is checked.
"""

from __future__ import annotations

import math
import warnings
from typing import Sequence

import torch

from mhla_diffusers.models.families import block_grid_preset_names
from mhla_diffusers.ops import available_backends
from mhla_diffusers.ops.layout import choose_block_grid, normalize_grid

__all__ = ["check_settings", "resolve_block_grid", "explicit_block_grid", "resolve_output_norm", "check_layer"]


def check_settings(num_blocks, block_grid, normalize: bool, eps, backend: str, feature_eps) -> dict:
    """The processor's settings, checked and normalised: ``num_blocks``, ``block_grid`` (a tuple or
    ``None``), ``block_grid_preset`` (a name or ``None``), ``normalize``, ``eps``, ``backend``,
    ``feature_eps`` (see :class:`~mhla_diffusers.MHLAProcessor` for their meaning).

    Raises:
        ValueError: bad ``num_blocks``, ``block_grid``, ``eps``, ``feature_eps`` or ``backend``; an
            unknown preset name; ``num_blocks`` contradicting ``block_grid``; ``eps=0`` with the normaliser.
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
    return dict(
        num_blocks=None if num_blocks is None else int(num_blocks), block_grid=block_grid, block_grid_preset=preset,
        normalize=bool(normalize), eps=eps, backend=backend, feature_eps=float(feature_eps),
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


def check_layer(processor, attn, reference_grid: Sequence[int] | None = None, family=None) -> None:
    """Refuse a layer whose MHLA state (block grid, output norm) contradicts ``processor``'s explicit settings.

    Raises:
        ValueError: naming both settings and the fix, ``mhla_diffusers.remove_mhla(model)`` first.
    """
    family = family or processor.family
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


def _spec_text(processor, wanted) -> str:
    if processor.block_grid is not None:
        return f"block_grid={processor.block_grid}"
    preset = processor.block_grid_preset
    spec = f"block_grid={preset!r}" if preset is not None else f"num_blocks={processor.num_blocks}"
    return spec if wanted is None else f"{spec} (block grid {wanted})"
