"""Per-layer sensitivity to MHLA: the output error when ONE layer becomes MHLA after a short
attention-transfer fit to the stock layer; the layer is then restored exactly.

Method and rationale: ``docs/selection.md``, "Sensitivity".
"""

from __future__ import annotations

import copy
import math
import numbers
import time
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Iterable, Sequence

import torch
from torch import nn
from tqdm.auto import tqdm

from mhla_diffusers.families import attention_modules, family_of, self_attention_modules
from mhla_diffusers.models.grid import token_grid
from mhla_diffusers.models.installer import install_mhla, is_mhla_model, remove_mhla
from mhla_diffusers.models.processor import MHLAProcessor

__all__ = ["LayerSensitivity", "layer_sensitivity", "check_calibration"]


@dataclass(frozen=True)
class LayerSensitivity(Mapping):
    """What :func:`layer_sensitivity` measured; a read-only mapping ``{layer index: score}``.

    Per layer also ``fit_error``, ``init_error``, ``init``, ``converged``, ``late_share``; ``settings``:
    how it was measured (recorded in ``mhla_config.json``).
    """

    scores: dict[int, float]
    fit_error: dict[int, float] = field(default_factory=dict)
    init_error: dict[int, float] = field(default_factory=dict)
    init: dict[int, str] = field(default_factory=dict)
    converged: dict[int, bool] = field(default_factory=dict)
    late_share: dict[int, float] = field(default_factory=dict)
    settings: dict[str, Any] = field(default_factory=dict)

    def __getitem__(self, index: int) -> float:
        return self.scores[index]

    def __iter__(self):
        return iter(self.scores)

    def __len__(self) -> int:
        return len(self.scores)

    def ranking(self) -> list[int]:
        """Layer indices, most sensitive first (ties: lower index first)."""
        return sorted(self.scores, key=lambda i: (-self.scores[i], i))


def check_calibration(calibration: Iterable[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """The calibration inputs as a list of keyword-argument dicts.

    ``ValueError`` for ``None``, a string or mapping, an empty iterable, or an entry not a dict with string keys.
    """
    if calibration is None or isinstance(calibration, (str, bytes, Mapping)):
        raise ValueError(
            "calibration must be a list of dicts of keyword arguments for the transformer's forward, e.g. "
            "[{'hidden_states': latent, 'timestep': t, 'class_labels': y}, ...] (mhla_diffusers.calibration_inputs "
            f"builds one from a pipeline); got {type(calibration).__name__}"
        )
    entries = list(calibration)
    if not entries:
        raise ValueError("calibration is empty: give at least one dict of keyword arguments for the transformer's forward")
    for i, entry in enumerate(entries):
        if not isinstance(entry, Mapping) or not all(isinstance(k, str) for k in entry):
            raise ValueError(f"calibration entry {i} must be a dict of keyword arguments (string keys); got {type(entry).__name__}")
    return [dict(entry) for entry in entries]


class _Stop(Exception):
    """Ends a forward after the captured layer."""


def _sample(output) -> torch.Tensor:
    return output.sample if hasattr(output, "sample") else output[0]


def _to_device(entry: dict, device: torch.device) -> dict:
    return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in entry.items()}


@torch.no_grad()
def _model_outputs(transformer: nn.Module, calibration: list[dict]) -> list[torch.Tensor]:
    """The transformer's output on each calibration entry (fp32); ``ValueError`` naming an entry it rejects."""
    outputs = []
    for i, entry in enumerate(calibration):
        try:
            outputs.append(_sample(transformer(**entry)).float())
        except (TypeError, ValueError, RuntimeError, KeyError, IndexError, AttributeError) as err:
            raise ValueError(
                f"calibration entry {i} does not run through the {type(transformer).__name__}'s forward "
                f"({type(err).__name__}: {err}); each entry holds keyword arguments of transformer.forward"
            ) from err
    return outputs


def _detached(value):
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, (tuple, list)):
        return type(value)(_detached(v) for v in value)
    return value


@torch.no_grad()
def _capture_layer(transformer: nn.Module, family, attn: nn.Module, calibration: list[dict]) -> list[tuple]:
    """``[(args, kwargs, stock output, token grid)]`` of layer ``attn`` per entry, each forward stopped after it."""
    captured, grids, current = [], [], {}

    def grid_hook(module, args):
        grids.append(family.grid_from_latent(args[0], transformer.config))

    def pre_hook(module, args, kwargs):
        current["in"] = (_detached(args), _detached(kwargs))

    def post_hook(module, args, kwargs, output):
        current["out"] = output.detach().clone()
        raise _Stop

    handles = [
        transformer.get_submodule(family.patch_embed).register_forward_pre_hook(grid_hook),
        attn.register_forward_pre_hook(pre_hook, with_kwargs=True),
        attn.register_forward_hook(post_hook, with_kwargs=True),
    ]
    try:
        for entry in calibration:
            grids.clear()
            current.clear()
            try:
                transformer(**entry)
            except _Stop:
                pass
            if "out" not in current or not grids:
                raise RuntimeError("the self-attention layer (or the patch embedding) was not called during the forward")
            captured.append((*current["in"], current["out"], grids[0]))
    finally:
        for handle in handles:
            handle.remove()
    return captured


def _float_copy(value):
    if isinstance(value, torch.Tensor) and value.is_floating_point():
        return value.float()
    if isinstance(value, (tuple, list)):
        return type(value)(_float_copy(v) for v in value)
    return value


def _working_copy(attn: nn.Module, family) -> nn.Module:
    work = copy.deepcopy(attn).float()
    work.set_processor(MHLAProcessor(backend=attn.processor.backend, family=family.name))  # runs the copy's own MHLA
    return work


def _fit_pass(work: nn.Module, captured: list[tuple], energy: float, backward: bool) -> float:
    """Relative squared error of ``work`` over ``captured`` (gradients accumulated when ``backward``)."""
    total = 0.0
    for args, kwargs, target, grid in captured:
        with token_grid(grid), torch.set_grad_enabled(backward):
            out = work(*_float_copy(args), **_float_copy(kwargs))
            loss = (out - target.float()).square().sum() / energy
        if backward:
            loss.backward()
        total += loss.item()
    return total


def _start_mixing(work: nn.Module, captured: list[tuple], energy: float) -> tuple[str, float]:
    """Set the mixing matrix to the better of the locality init and all ones; ``(name, error)``."""
    weight = work.mhla.mixing.weight
    locality = weight.detach().clone()
    errors = {}
    for name, value in (("locality", locality), ("ones", torch.ones_like(locality))):
        with torch.no_grad():
            weight.copy_(value)
        errors[name] = _fit_pass(work, captured, energy, backward=False)
    best = min(errors, key=errors.get)
    with torch.no_grad():
        weight.copy_(locality if best == "locality" else torch.ones_like(locality))
    return best, errors[best]


def _fit_layer(work: nn.Module, captured: list[tuple], steps: int, lr: float, mixing_lr: float, fit_projections: bool) -> dict:
    """Attention transfer on the working copy, left at the best parameters seen; the fit's record."""
    energy = sum(t.float().square().sum().item() for _, _, t, _ in captured) or 1.0
    init, init_loss = _start_mixing(work, captured, energy)
    mixing = work.mhla.mixing.weight
    others = [p for name, p in work.named_parameters() if not name.startswith("mhla.mixing.")]
    for p in work.parameters():
        p.requires_grad_(False)
    groups = [{"params": [mixing.requires_grad_(True)], "lr": mixing_lr}]
    if fit_projections:
        groups.append({"params": [p.requires_grad_(True) for p in others], "lr": lr})
    optimizer = torch.optim.Adam(groups)
    history, best, best_state = [], math.inf, None
    for step in range(steps + 1):
        optimizer.zero_grad(set_to_none=True)
        loss = _fit_pass(work, captured, energy, backward=step < steps)
        history.append(loss)
        if loss < best:
            best, best_state = loss, {k: v.detach().clone() for k, v in work.state_dict().items()}
        if step == steps:
            break
        optimizer.step()
        if work.mhla.mixing.clamp:
            with torch.no_grad():
                mixing.clamp_(0.0, 1.0)
    work.load_state_dict(best_state)
    return {"init": init, "init_error": math.sqrt(init_loss), "fit_error": math.sqrt(best), "late_share": _late_share(history)}


def _late_share(history: list[float]) -> float:
    """The share of the fit's drop in log error made by its last 20% of steps."""
    best = min(history)
    if best <= 0 or history[0] <= best:
        return 0.0
    cut = max(1, int(0.8 * len(history)))
    return math.log(min(history[:cut]) / best) / math.log(history[0] / best)


@torch.no_grad()
def _damage(transformer: nn.Module, calibration: list[dict], reference: list[torch.Tensor]) -> float:
    """``sqrt(sum ||F(x) - F_stock(x)||^2 / sum ||F_stock(x)||^2)`` over the calibration inputs."""
    num = den = 0.0
    for entry, ref in zip(calibration, reference):
        out = _sample(transformer(**entry)).float()
        num += (out - ref).double().square().sum().item()
        den += ref.double().square().sum().item()
    return math.sqrt(num / den) if den > 0 else math.sqrt(num)


def _score_layer(transformer, family, index: int, calibration, reference, mhla: dict, fit: dict) -> dict:
    """Capture, fit and score one layer, then restore it."""
    attn = self_attention_modules(transformer, family)[index][1]
    captured = _capture_layer(transformer, family, attn, calibration)
    state = _LayerState(attn)
    try:
        install_mhla(transformer, [index], **mhla)
        block_grid = list(attn.mhla.mixing.block_grid)
        work = _working_copy(attn, family)
        record = _fit_layer(work, captured, **fit)
        with torch.no_grad():
            attn.load_state_dict(work.state_dict())
        score = _damage(transformer, calibration, reference)
    finally:
        remove_mhla(transformer)
        state.restore()
    return {**record, "score": score, "block_grid": block_grid}


class _LayerState:
    """What :func:`layer_sensitivity` may change on one layer, to put back exactly."""

    def __init__(self, attn: nn.Module):
        self.attn = attn
        self.tensors = {k: v.detach().clone() for k, v in attn.state_dict(keep_vars=True).items()}
        self.processor = attn.processor

    def restore(self) -> None:
        """Weights bitwise and the processor object back."""
        with torch.no_grad():
            current = self.attn.state_dict(keep_vars=True)
            for key, value in self.tensors.items():
                current[key].copy_(value)
        self.attn.set_processor(self.processor)


def layer_sensitivity(
    transformer: nn.Module,
    calibration: Iterable[Mapping[str, Any]],
    *,
    num_blocks: int | None = None,
    block_grid: Sequence[int] | str | None = None,
    normalize: bool = True,
    layers: Sequence[int] | None = None,
    fit_steps: int = 40,
    lr: float = 1e-3,
    mixing_lr: float = 3e-2,
    fit_projections: bool = True,
    convergence_tol: float = 0.2,
    seed: int = 0,
    progress: bool = True,
) -> LayerSensitivity:
    """Score each self-attention layer by the output damage when it alone becomes MHLA (``docs/selection.md``).

    ``transformer``: DiT, SANA or Wan without MHLA; ``calibration``: dicts of forward keyword arguments
    (:func:`~mhla_diffusers.calibration_inputs`); ``num_blocks``, ``block_grid``, ``normalize``: the
    MHLA settings scored; ``fit_steps``, ``lr``, ``mixing_lr``, ``fit_projections``: each layer's fit;
    ``convergence_tol``: the largest late share of a converged fit; ``seed``: the RNG seed inside.

    Raises:
        ValueError: unsupported model or one with MHLA; bad calibration; a layer out of range; bad fit settings.
    """

    family = family_of(transformer)
    if is_mhla_model(transformer):
        raise ValueError("layer_sensitivity measures a stock model; this one has MHLA layers: call mhla_diffusers.remove_mhla first")
    if (isinstance(fit_steps, bool) or not isinstance(fit_steps, numbers.Integral) or fit_steps < 0 or not lr > 0
            or not mixing_lr > 0 or not 0 <= convergence_tol <= 1):
        raise ValueError(
            f"fit_steps must be an integer >= 0, the learning rates > 0 and convergence_tol in [0, 1]; got fit_steps="
            f"{fit_steps!r}, lr={lr!r}, mixing_lr={mixing_lr!r}, convergence_tol={convergence_tol!r}"
        )
    modules = self_attention_modules(transformer, family)
    chosen = list(range(len(modules))) if layers is None else [int(i) for i in layers]
    if not chosen or any(not 0 <= i < len(modules) for i in chosen):
        raise ValueError(f"layers {chosen} out of range: the model has {len(modules)} self-attention layers")
    device = next(transformer.parameters()).device
    calibration = [_to_device(entry, device) for entry in check_calibration(calibration)]
    start, was_training = time.perf_counter(), transformer.training
    processors = {key: attn.processor for key, attn in attention_modules(transformer).items()}
    fits: dict[int, dict] = {}
    transformer.eval()
    try:
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
            torch.manual_seed(seed)
            reference = _model_outputs(transformer, calibration)
            for i in tqdm(chosen, desc="layer sensitivity", disable=not progress):
                mhla = dict(num_blocks=num_blocks, block_grid=block_grid, normalize=normalize)
                fit = dict(steps=int(fit_steps), lr=lr, mixing_lr=mixing_lr, fit_projections=fit_projections)
                fits[i] = _score_layer(transformer, family, i, calibration, reference, mhla, fit)
    finally:
        transformer.train(was_training)
        for key, attn in attention_modules(transformer).items():
            if attn.processor is not processors[key]:
                attn.set_processor(processors[key])
    record = {key: {i: f[key] for i, f in fits.items()} for key in ("score", "fit_error", "init_error", "init", "late_share")}
    record["scores"] = record.pop("score")
    record["converged"] = {i: share <= convergence_tol for i, share in record["late_share"].items()}
    slow = [i for i, ok in record["converged"].items() if not ok]
    if slow:
        warnings.warn(
            f"layer_sensitivity: the fit of layers {slow} had not slowed down after {fit_steps} steps (its last 20% made "
            f"more than {convergence_tol:.0%} of its drop in log error); their scores are upper bounds: raise fit_steps",
            UserWarning,
            stacklevel=2,
        )
    resolved_grid = next(iter(fits.values()))["block_grid"]
    settings = {
        "num_calibration": len(calibration), "fit_steps": int(fit_steps), "lr": lr, "mixing_lr": mixing_lr,
        "fit_projections": bool(fit_projections), "seed": int(seed), "block_grid": resolved_grid,
        "normalize": bool(normalize), "seconds": round(time.perf_counter() - start, 2),
    }
    return LayerSensitivity(**record, settings=settings)
