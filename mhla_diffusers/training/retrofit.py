"""The retrofit recipe: a converted checkpoint -> label-free distillation -> fine-tuning (issue 13).

Two runs of :func:`~mhla_diffusers.training.train` over one base config, each measuring the held-out
losses before and after (the config's ``eval`` section):

1. **distillation without labels**: attention transfer (per-layer MSE between the MHLA layers' and
   the original softmax layers' outputs, weight ``attention_weight``) plus output matching (MSE to
   the original model's output, ``output_weight``), no data loss, on the dataset's inputs with the
   condition ``distill_condition`` (DiT: random class labels). Skipped for a model without MHLA
   (the softmax control): there it is the identity, the original distilled into itself.
2. **fine-tuning**: the objective's data loss plus output matching against the original
   (``output_weight``), which anchors the model to what it was, so that the softmax control fine-tuned
   the same way does not drift away from its pretrained optimum (the "do no harm" control).

The optimiser settings (per-group learning rates, warm-up, decay) come from the base config; the
shipped demo configs hold the ones measured in ``docs/study/report.md``.
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
    distill_condition: str = "random",
    distill_lr: float | None = None,
    overrides: Iterable[str] = (),
) -> dict:
    """Distil then fine-tune ``pretrained`` (a converted or plain pipeline folder) against ``teacher``.

    Args:
        config: the fine-tuning YAML both phases start from (data, optimiser, ``eval``, ``export``).
        pretrained: the student's pipeline folder (``convert_checkpoint`` output, or the original for
            the control).
        teacher: the original pipeline folder (frozen; distillation and output-matching target).
        output_dir: runs go to ``<output_dir>/distill`` and ``<output_dir>/finetune``.
        distill_steps: optimizer steps of phase 1 (0, or a model without MHLA: skipped).
        finetune_steps: optimizer steps of phase 2 (>= 1).
        attention_weight, output_weight: weights of the attention-transfer and output-matching MSEs
            (``distill.attention_weight`` / ``distill.output_weight``); phase 2 uses ``output_weight``
            only.
        distill_condition: ``distill.condition`` of phase 1: ``"random"`` (DiT: random class labels),
            ``"null"`` or ``"dataset"``.
        distill_lr: phase 1's learning rate (constant after the config's warm-up); ``None``: the
            config's ``train.lr`` and schedule. Phase 1 repairs a converted model (a larger step
            helps); phase 2 runs the config's schedule, which must not harm the original.
        overrides: extra ``key=value`` overrides for both phases (e.g. ``eval.samples=64``).

    Returns:
        ``{"heldout_loss": {"conversion", "distill", "finetune"}, "heldout_teacher_mse": {...},
        "steps": {"distill", "finetune"}, "step_time_s": {...}, "wall_time_s": {...},
        "final_dir", "runs": {"distill": path | None, "finetune": path}}``; held-out values are
        ``None`` when the config has ``eval.samples: 0``; the ``distill`` entries equal the
        ``conversion`` ones when phase 1 was skipped.

    Raises:
        ValueError: ``finetune_steps`` / ``distill_steps`` not an integer (``True``, ``2.5``: never truncated),
            ``finetune_steps < 1``, ``distill_steps < 0``, ``distill_lr <= 0``; config errors (see
            :func:`~mhla_diffusers.training.load_config`).
    """
    if distill_lr is not None and not distill_lr > 0:
        raise ValueError(f"distill_lr must be > 0 or None; got {distill_lr!r}")
    whole = [isinstance(n, numbers.Integral) and not isinstance(n, bool) for n in (finetune_steps, distill_steps)]
    if not all(whole) or finetune_steps < 1 or distill_steps < 0:
        raise ValueError(
            f"retrofit needs integers finetune_steps >= 1 and distill_steps >= 0; got {finetune_steps!r}, {distill_steps!r}"
        )
    out, common = Path(output_dir), [*overrides, f"distill.teacher={teacher}", f"distill.output_weight={output_weight}"]
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
        f"train.max_steps={int(finetune_steps)}", "distill.data_weight=1", "distill.attention_weight=0", "distill.condition=dataset",
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
        "runs": {k: None if v is None else str(v) for k, v in runs.items()},
    }
