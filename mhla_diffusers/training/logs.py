"""The loss log (``loss.csv``: step, loss, lr, loss terms, gradient norms per group) and its plot."""

from __future__ import annotations

import csv
import io
import os
from typing import Mapping, Sequence

from mhla_diffusers.checkpoint.io import atomic_write_bytes, atomic_write_text

__all__ = ["LOSS_CSV", "LOSS_PNG", "write_loss_csv", "read_loss_csv", "read_loss_terms", "read_grad_norms", "plot_loss_curves"]

LOSS_CSV = "loss.csv"
LOSS_PNG = "loss.png"
LOSS_TERMS = ("data", "output", "attention")
GRADIENT_GROUPS = ("model", "lora", "mhla_mixing")  # see optim.gradient_groups
GRAD_NORM_PREFIX = "grad_norm_"


def write_loss_csv(path: str | os.PathLike, rows: Sequence[tuple]) -> None:
    """Write ``step,loss,lr[,<term>...][,grad_norm_<group>...]`` rows (atomic). ``step`` counts optimizer steps from 1.

    A row is ``(step, loss, lr)``, ``(step, loss, lr, {term: value})`` or
    ``(step, loss, lr, {term: value}, {group: gradient norm})``: the loss terms (``data``,
    ``output``, ``attention``) and the gradient norms of the parameter groups before clipping
    (``grad_norm_model``, ``grad_norm_lora``, ``grad_norm_mhla_mixing``: see
    :func:`gradient_groups`) become extra columns (empty where a row lacks one).
    """
    def extra(r, i):
        return r[i] if len(r) > i and r[i] else {}

    names = sorted({k for r in rows for k in extra(r, 3)}, key=lambda k: (LOSS_TERMS + (k,)).index(k))
    groups = sorted({k for r in rows for k in extra(r, 4)}, key=lambda k: (GRADIENT_GROUPS + (k,)).index(k))
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    w.writerow(["step", "loss", "lr", *names, *(GRAD_NORM_PREFIX + g for g in groups)])
    for r in rows:
        terms, norms = extra(r, 3), extra(r, 4)
        w.writerow([int(r[0]), f"{float(r[1]):.6g}", f"{float(r[2]):.6g}", *(f"{float(terms[k]):.6g}" if k in terms else "" for k in names),
                    *(f"{float(norms[g]):.6g}" if g in norms else "" for g in groups)])
    atomic_write_text(path, buf.getvalue())


def read_rows(path: str | os.PathLike) -> list[tuple[int, float, float, dict[str, float], dict[str, float]]]:
    """``(step, loss, lr, {term: value}, {group: gradient norm})`` rows of a loss CSV."""
    with open(path, newline="") as f:
        reader = csv.DictReader(f)
        if reader.fieldnames is None or not {"step", "loss", "lr"} <= set(reader.fieldnames):
            raise ValueError(f"{path} is not a loss CSV (expected columns step, loss, lr)")
        extra = [c for c in reader.fieldnames if c not in ("step", "loss", "lr")]
        terms = [c for c in extra if not c.startswith(GRAD_NORM_PREFIX)]
        norms = [c for c in extra if c.startswith(GRAD_NORM_PREFIX)]

        def values(r, columns, strip=0):
            return {k[strip:]: float(r[k]) for k in columns if r.get(k) not in (None, "")}

        return [
            (int(r["step"]), float(r["loss"]), float(r["lr"]), values(r, terms), values(r, norms, len(GRAD_NORM_PREFIX)))
            for r in reader
        ]


def read_loss_csv(path: str | os.PathLike) -> list[tuple[int, float, float]]:
    """Rows ``(step, loss, lr)`` of a loss CSV written by :func:`write_loss_csv`.

    Raises:
        FileNotFoundError: no such file. ValueError: not a loss CSV.
    """
    return [r[:3] for r in read_rows(path)]


def read_grad_norms(path: str | os.PathLike) -> dict[str, tuple[list[int], list[float]]]:
    """The gradient norms of a loss CSV, per parameter group before clipping: ``{group: (steps, norms)}``
    (``model``, ``lora``, ``mhla_mixing``; see :func:`gradient_groups`). A non-finite norm marks a
    skipped step."""
    out: dict[str, tuple[list[int], list[float]]] = {}
    for step, _, _, _, norms in read_rows(path):
        for k, v in norms.items():
            out.setdefault(k, ([], []))
            out[k][0].append(step)
            out[k][1].append(v)
    return out


def read_loss_terms(path: str | os.PathLike) -> dict[str, tuple[list[int], list[float]]]:
    """The loss terms of a loss CSV: ``{term: (steps, values)}`` (``data``, ``output``, ``attention``)."""
    out: dict[str, tuple[list[int], list[float]]] = {}
    for step, _, _, terms, _ in read_rows(path):
        for k, v in terms.items():
            out.setdefault(k, ([], []))
            out[k][0].append(step)
            out[k][1].append(v)
    return out


def _smooth(values: Sequence[float], window: int) -> list[float]:
    out, acc, q = [], 0.0, []
    for v in values:
        q.append(v)
        acc += v
        if len(q) > window:
            acc -= q.pop(0)
        out.append(acc / len(q))
    return out


def plot_loss_curves(
    curves: Mapping[str, tuple[Sequence[int], Sequence[float]]],
    path: str | os.PathLike,
    *,
    title: str = "training loss",
    smooth: int | None = None,
    log_y: bool = True,
    ylabel: str = "loss",
) -> None:
    """Plot loss-vs-step curves (one per name) to a PNG (matplotlib Agg backend; atomic write).

    Args:
        curves: ``{label: (steps, losses)}``.
        path: the ``.png`` to write.
        smooth: moving-average window in steps (default: about 1/20 of the longest curve, >= 1);
            the raw curve is drawn faintly behind the smoothed one.
        log_y: logarithmic loss axis.
        ylabel: the y-axis label.

    Raises:
        ValueError: no curves, or a curve whose step and loss lists differ in length.
        ImportError: matplotlib is not installed.
    """
    import matplotlib  # optional: only the plot needs it (the caller reports a missing matplotlib)

    matplotlib.use("Agg", force=False)
    from matplotlib.figure import Figure

    if not curves:
        raise ValueError("no loss curves to plot")
    longest = max(len(s) for s, _ in curves.values())
    window = smooth or max(1, longest // 20)
    fig = Figure(figsize=(7, 4.2), dpi=110)
    ax = fig.add_subplot(1, 1, 1)
    for i, (label, (steps, losses)) in enumerate(curves.items()):
        if len(steps) != len(losses):
            raise ValueError(f"curve {label!r}: {len(steps)} steps but {len(losses)} losses")
        if not steps:
            continue
        color = f"C{i % 10}"
        if window > 1:
            ax.plot(steps, losses, color=color, alpha=0.2, linewidth=0.8)
        ax.plot(steps, _smooth(losses, window), color=color, linewidth=1.6, label=label)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel(ylabel + (" (log)" if log_y else ""))
    if log_y:
        ax.set_yscale("log")
    ax.set_title(title + (f" (moving average over {window} steps)" if window > 1 else ""), fontsize=10)
    ax.grid(True, alpha=0.3, which="both")
    ax.legend(fontsize=8)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    atomic_write_bytes(path, buf.getvalue())
