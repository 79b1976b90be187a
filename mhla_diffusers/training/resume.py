"""Checkpoints and resuming: complete checkpoints, whether ``train.resume`` fits the output folder,
config changes a resume refuses, optimizer settings after loading, EMA weights.

See ``docs/training.md``, "Resuming".
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Mapping, Sequence

import torch
import yaml
from safetensors import safe_open
from safetensors.torch import save_file

from mhla_diffusers.checkpoint.safetensors_file import read_safetensors_header

TRAIN_STATE = "train_state.json"
EMA_WEIGHTS = "ema.safetensors"
SUMMARY = "train_summary.json"


def find_checkpoints(ckpt_root: Path) -> tuple[list[tuple[int, Path]], list[Path]]:
    """``([(step, folder)] complete, by step; [incomplete folders])``; complete once ``train_state.json`` exists."""
    complete, incomplete = [], []
    if ckpt_root.is_dir():
        for folder in ckpt_root.iterdir():
            if not (folder.is_dir() and folder.name.startswith("checkpoint_")):
                continue
            try:
                complete.append((int(json.loads((folder / TRAIN_STATE).read_text())["step"]), folder))
            except (OSError, ValueError, KeyError, json.JSONDecodeError):
                incomplete.append(folder)
    return sorted(complete), incomplete


def _complete_checkpoints(ckpt_root: Path) -> list[tuple[int, Path]]:
    return find_checkpoints(ckpt_root)[0]


def check_resume(out: Path, final_dir: Path, resume: bool, complete: list[tuple[int, Path]], max_steps: int) -> dict | None:
    """Check ``train.resume`` against ``out`` before anything is written; the stored summary if the run finished at ``max_steps``.

    Raises:
        ValueError: ``resume`` without a complete checkpoint, checkpoints without ``resume``, or a
            checkpoint or finished run past ``max_steps``.
    """
    ckpt_root = out / "checkpoints"
    if resume and not complete:
        raise ValueError(f"train.resume is set but {ckpt_root} holds no complete checkpoint; run without --resume")
    if not resume and complete:
        raise ValueError(f"{ckpt_root} already holds checkpoints: pass --resume to continue, or use a new output_dir")
    if not resume:
        return None
    latest, folder = complete[-1]
    if latest > max_steps:
        raise ValueError(
            f"the latest checkpoint ({folder}) is at step {latest}, past train.max_steps = {max_steps}: nothing to "
            f"resume (it would export the step-{latest} weights as the final model); raise train.max_steps above "
            f"{latest} to continue the run. Nothing was written."
        )
    try:
        summary = json.loads((out / SUMMARY).read_text())
        done = summary["steps"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if not isinstance(done, int):
        return None
    if done > max_steps:
        raise ValueError(
            f"{out / SUMMARY}: this run already went to step {done}, past train.max_steps = {max_steps}; resuming "
            f"would replace its final model ({summary.get('final_dir')}), loss.csv and summary with those of step "
            f"{max_steps}. Raise train.max_steps to {done} or more to continue the run, or train into a new output_dir. "
            "Nothing was written."
        )
    exported = summary.get("final_dir")
    if done == max_steps and exported and Path(exported).resolve() == final_dir.resolve() and final_dir.is_dir():
        return summary
    return None


def save_ema(ema, folder: Path) -> None:
    """Write an ``EMAModel``'s shadow parameters and step to ``folder/ema.safetensors``."""
    tensors = {f"shadow.{i:05d}": p.detach().to("cpu").contiguous() for i, p in enumerate(ema.shadow_params)}
    save_file(tensors, str(folder / EMA_WEIGHTS), metadata={"optimization_step": str(ema.optimization_step)})


def load_ema(ema, folder: Path) -> None:
    """Read :func:`save_ema`'s file back into ``ema`` in place; ``ValueError`` if missing, damaged or mismatched."""
    path = folder / EMA_WEIGHTS
    if not path.is_file():
        raise ValueError(f"{path} is missing: the checkpoint was written without EMA; set ema.enabled=false or start a new run")
    read_safetensors_header(path)  # a damaged file: one line naming it
    with safe_open(str(path), framework="pt") as f:
        keys = sorted(f.keys())
        if len(keys) != len(ema.shadow_params):
            raise ValueError(f"{path} holds {len(keys)} EMA tensors; the model has {len(ema.shadow_params)} trainable parameters")
        for key, p in zip(keys, ema.shadow_params):
            p.data.copy_(f.get_tensor(key))
        ema.optimization_step = int(f.metadata()["optimization_step"])


# Settings that shape the trained parameters, hence a checkpoint's tensors and optimizer groups:
# a resume that changes one is refused by name (keys and every key below them).
_SHAPE_KEYS = ("model.family", "model.init", "train.trainable", "train.train_mixing")
_SHAPE_KEYS_MHLA = ("mhla.layers", "mhla.num_blocks", "mhla.block_grid", "mhla.output_norm")
_SHAPE_KEYS_LORA = ("lora.rank", "lora.target_modules")  # when the run trains LoRA
_UNSET = "<unset>"


def _dotted(config: Mapping, prefix: str = "") -> dict[str, Any]:
    out = {}
    for k, v in config.items():
        key = f"{prefix}{k}"
        if isinstance(v, Mapping) and v:
            out.update(_dotted(v, key + "."))
        else:
            out[key] = v
    return out


def _config_changes(recorded: Mapping, config: Mapping) -> dict[str, tuple[Any, Any]]:
    """``{dotted key: (recorded, new)}`` of every differing key (``"<unset>"`` where missing; a key the recorded
    config lacks, written before the key existed, is no change while this run keeps its default)."""
    from mhla_diffusers.training.config import DEFAULT_CONFIG

    old, new, defaults = _dotted(recorded), _dotted(config), _dotted(DEFAULT_CONFIG)
    changes = {}
    for key in sorted(set(old) | set(new)):
        a, b = old.get(key, _UNSET), new.get(key, _UNSET)
        if a == _UNSET and key in defaults and b == defaults[key]:
            continue
        if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
            a, b = list(a), list(b)
        if a != b and key != "train.resume":
            changes[key] = (old.get(key, _UNSET), new.get(key, _UNSET))
    return changes


def _recorded_config(out: Path, folder: Path) -> tuple[dict | None, Path | None]:
    """``(config, source)`` a checkpoint was trained with (``train_state.json``, else ``config.yaml``)."""
    try:
        recorded = json.loads((folder / TRAIN_STATE).read_text()).get("config")
        if isinstance(recorded, Mapping):
            return dict(recorded), folder / TRAIN_STATE
    except (OSError, ValueError, AttributeError):
        pass
    try:
        recorded = yaml.safe_load((out / "config.yaml").read_text())
        if isinstance(recorded, Mapping):
            return dict(recorded), out / "config.yaml"
    except (OSError, yaml.YAMLError):
        pass
    return None, None


def _shape_changes(changes: Mapping[str, tuple[Any, Any]], config: Mapping, recorded: Mapping) -> list[str]:
    """The changed keys that shape the trained parameters."""
    lora = "lora" in (config["train"]["trainable"], (recorded.get("train") or {}).get("trainable"))
    shaping = _SHAPE_KEYS_MHLA + (_SHAPE_KEYS_LORA if lora else ())
    # "mhla" itself changes when MHLA is turned on or off (a null section against a mapping)
    # model.expert: which of Wan 2.2's experts is trained (null and unset: the only transformer)
    expert = changes.get("model.expert", (None, None))
    other_expert = all(v not in (None, _UNSET) for v in expert)
    return [key for key in changes
            if key in shaping or key == "mhla" or any(key == k or key.startswith(k + ".") for k in _SHAPE_KEYS)
            or (key == "model.expert" and other_expert)]


def check_resume_config(out: Path, folder: Path, config: Mapping) -> dict[str, tuple[Any, Any]]:
    """The settings changed since checkpoint ``folder``'s recorded config.

    ``ValueError`` naming each changed setting that shapes the trained parameters, old and new value.
    """
    recorded, source = _recorded_config(out, folder)
    if recorded is None:
        return {}
    changes = _config_changes(recorded, config)
    shaping = _shape_changes(changes, config, recorded)
    if "mhla" in changes:  # MHLA turned on or off: name the section once, with both values
        changes["mhla"] = (recorded.get("mhla"), config["mhla"])
        shaping = ["mhla"] + [k for k in shaping if not k.startswith("mhla")]
    if shaping:
        listed = "; ".join(f"{k} changed since the checkpoint ({changes[k][0]!r} -> {changes[k][1]!r})" for k in shaping)
        raise ValueError(
            f"cannot resume from {folder}: {listed}. {'This setting shapes' if len(shaping) == 1 else 'These settings shape'} "
            f"the trained parameters, so the checkpoint's weights and optimizer state do not fit (the run's settings are "
            f"recorded in {source}). Set {'it' if len(shaping) == 1 else 'them'} back to resume, or train into a new "
            "output_dir. Nothing was written."
        )
    return changes


def check_resume_layout(folder: Path, processes: int, data_world: int) -> None:
    """``ValueError`` if checkpoint ``folder`` was written by another number of processes or data-parallel ranks
    (``train_state.json``'s ``processes`` / ``data_world``; a checkpoint without them is not checked).

    The learning-rate schedule's position counts steps of every process (accelerate steps a prepared scheduler once
    per process), and the sampler's order and the global batch follow the data ranks: resumed on another layout, the
    run would silently follow another schedule and other samples.
    """
    try:
        state = json.loads((folder / TRAIN_STATE).read_text())
    except (OSError, ValueError):
        return
    if not isinstance(state, Mapping):
        return
    was = (state.get("processes"), state.get("data_world"))
    if None in was or was == (processes, data_world):
        return
    raise ValueError(
        f"cannot resume from {folder}: it was trained by {was[0]} process(es) in {was[1]} data-parallel rank(s), and this "
        f"launch has {processes} in {data_world}. The learning-rate schedule's position and the samples each step draws "
        f"depend on both: launch {was[0]} processes with a parallel.context that gives {was[1]} data ranks, or train into "
        "a new output_dir. Nothing was written."
    )


def apply_optimizer_settings(optimizer, lr_scheduler, fresh: Sequence[Mapping[str, Any]]) -> list[str]:
    """After ``load_state``: put this config's optimizer settings (``fresh``) back; returns what changed.

    ``ValueError`` for a changed learning rate under a schedule that is not a ``LambdaLR``.
    """
    sched = getattr(lr_scheduler, "scheduler", lr_scheduler)
    lambdas = getattr(sched, "lr_lambdas", None) if isinstance(sched, torch.optim.lr_scheduler.LambdaLR) else None
    notes = []
    for i, (group, want) in enumerate(zip(optimizer.param_groups, fresh)):
        name = want.get("name", f"group {i}")
        for key, value in want.items():
            have = group.get(key)
            same = list(have) == list(value) if isinstance(value, (list, tuple)) and isinstance(have, (list, tuple)) else have == value
            if key not in ("lr", "initial_lr") and not same:
                notes.append(f"{name}: {key} {have!r} -> {value!r}")
                group[key] = value
        base = want["initial_lr"]
        if sched.base_lrs[i] != base:
            if lambdas is None:
                raise ValueError(f"the learning rate of {name} changed since the checkpoint ({sched.base_lrs[i]:g} -> {base:g}), "
                                 f"but the {type(sched).__name__} schedule cannot take a new base rate: set it back to resume")
            notes.append(f"{name}: lr {sched.base_lrs[i]:g} -> {base:g}")
            sched.base_lrs[i] = group["initial_lr"] = base
        if lambdas is not None:
            lr = base * lambdas[i](sched.last_epoch)
            if group["lr"] != lr:
                group["lr"] = lr
    return notes
