"""The retrofit recipe: a converted checkpoint, then label-free distillation, then fine-tuning.

Two :func:`~mhla_diffusers.training.train` runs (``docs/training.md``, "Retrofit"); the demo
configs hold the settings measured in ``docs/study/report.md``.
"""

from __future__ import annotations

import numbers
import os
from pathlib import Path
from typing import Iterable

from mhla_diffusers.checkpoint.format import read_mhla_config
from mhla_diffusers.training.config import load_config
from mhla_diffusers.training.loop import train

__all__ = ["retrofit"]


def retrofit(
    config: str | os.PathLike,
    pretrained: str | os.PathLike,
    teacher: str | os.PathLike,
    output_dir: str | os.PathLike,
    *,
    distill_steps: int,
    finetune_steps: int,
    attention_weight: float = 5.0,
    output_weight: float = 1.0,
    distill_condition: str | None = None,
    distill_lr: float | None = None,
    finetune_data_weight: float = 1.0,
    finetune_attention_weight: float = 0.0,
    overrides: Iterable[str] = (),
) -> dict:
    """Distil then fine-tune ``pretrained`` against ``teacher`` (pipeline folders), into ``<output_dir>/{distill,finetune}``.

    Phase 1 (``distill_steps``; skipped at 0 or without MHLA): attention transfer and output matching, no data
    loss, ``distill_lr`` a constant rate (``None``: the config's schedule), on ``distill_condition`` (``None``:
    ``"random"`` class labels, or the stored conditions of a teacher store). Phase 2 (``finetune_steps >= 1``):
    the data loss (weight ``finetune_data_weight``; 0: a distillation on the phase's samples) plus output
    matching and attention transfer (``finetune_attention_weight``, default 0). ``config`` is the YAML both
    start from; ``overrides`` apply to both. A data-free config (``data.kind: teacher``) trains both phases on
    one store of the teacher's samples (``data.teacher.store_dir``, default ``<output_dir>/teacher_store``).
    Returns held-out losses and teacher MSEs at ``conversion`` / ``distill`` / ``finetune``, steps, times,
    ``final_dir``, the run folders and the store's cost (``teacher_store``).

    Raises:
        ValueError: non-integer or out-of-range step counts, ``distill_lr <= 0``, config errors.
    """
    if not (finetune_data_weight >= 0 and finetune_attention_weight >= 0):
        raise ValueError(f"finetune_data_weight and finetune_attention_weight must be >= 0; got {finetune_data_weight!r}, "
                         f"{finetune_attention_weight!r}")
    if distill_lr is not None and not distill_lr > 0:
        raise ValueError(f"distill_lr must be > 0 or None; got {distill_lr!r}")
    whole = [isinstance(n, numbers.Integral) and not isinstance(n, bool) for n in (finetune_steps, distill_steps)]
    if not all(whole) or finetune_steps < 1 or distill_steps < 0:
        raise ValueError(
            f"retrofit needs integers finetune_steps >= 1 and distill_steps >= 0; got {finetune_steps!r}, {distill_steps!r}"
        )
    out, common = Path(output_dir), [*overrides, f"distill.teacher={teacher}", f"distill.output_weight={output_weight}"]
    data_free = load_config(config, common + [f"output_dir={out}", f"model.pretrained={pretrained}"])["data"]
    if data_free["kind"] == "teacher":  # one store for both phases
        common.append(f"data.teacher.store_dir={data_free['teacher']['store_dir'] or out / 'teacher_store'}")
    if distill_condition is None:
        distill_condition = "dataset" if data_free["kind"] == "teacher" else "random"
    runs, s1 = {"distill": None}, None
    if int(distill_steps) > 0 and read_mhla_config(pretrained) is not None:
        runs["distill"] = out / "distill"
        s1 = train(load_config(config, common + [
            f"model.pretrained={pretrained}", f"output_dir={runs['distill']}", f"train.max_steps={int(distill_steps)}",
            *([] if distill_lr is None else [f"train.lr={distill_lr}", "train.lr_scheduler=constant_with_warmup"]),
            "distill.data_weight=0", f"distill.attention_weight={attention_weight}", f"distill.condition={distill_condition}",
        ]))
    runs["finetune"] = out / "finetune"
    s2 = train(load_config(config, common + [
        f"model.pretrained={s1['final_dir'] if s1 else pretrained}", f"output_dir={runs['finetune']}",
        f"train.max_steps={int(finetune_steps)}", f"distill.data_weight={finetune_data_weight}",
        f"distill.attention_weight={finetune_attention_weight}",
        "distill.condition=dataset",
    ]))
    first = s1 or s2
    return {
        "heldout_loss": {"conversion": first["eval_loss_start"], "distill": first["eval_loss"] if s1 else s2["eval_loss_start"],
                         "finetune": s2["eval_loss"]},
        "heldout_teacher_mse": {"conversion": first.get("eval_distill_start"),
                                "distill": first.get("eval_distill") if s1 else s2.get("eval_distill_start"),
                                "finetune": s2.get("eval_distill")},
        "steps": {"distill": s1["steps"] if s1 else 0, "finetune": s2["steps"]},
        "step_time_s": {"distill": s1["step_time_s"] if s1 else None, "finetune": s2["step_time_s"]},
        "wall_time_s": {"distill": s1["wall_time_s"] if s1 else 0.0, "finetune": s2["wall_time_s"]},
        "final_dir": s2["final_dir"],
        "teacher_store": s2.get("teacher_store"),  # a data-free config: what the teacher's samples cost
        "runs": {k: None if v is None else str(v) for k, v in runs.items()},
    }
