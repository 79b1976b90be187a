"""PNG pictures: a mixing matrix on its block grid, rank / entropy bars per layer (matplotlib, Agg canvas)."""

from __future__ import annotations

import io
import math
import os
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np
import torch

from mhla_diffusers.checkpoint.io import atomic_write_bytes
from mhla_diffusers.diagnostics.attention import KINDS
from mhla_diffusers.ops.layout import normalize_grid


# -- pictures -------------------------------------------------------------------------------------
def _figure(width: float, height: float):
    try:  # function-level import: matplotlib is optional (the dev / demo extras), needed only for pictures
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as err:  # pragma: no cover - depends on the environment
        raise ImportError("the diagnostics pictures need matplotlib: pip install matplotlib") from err
    fig = Figure(figsize=(width, height), dpi=100)
    FigureCanvasAgg(fig)
    return fig


def _save_png(fig, path: str | os.PathLike) -> Path:
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    return atomic_write_bytes(path, buf.getvalue())


def plot_mixing_matrix(
    mixing: torch.Tensor,
    block_grid: Sequence[int],
    path: str | os.PathLike,
    *,
    title: str | None = None,
    time_slice: int | None = None,
) -> Path:
    """Draw ``mixing`` ``[M, M]`` as one panel per query block on the block grid (3D: one ``time_slice``); ``Path(path)``.

    Raises:
        ValueError: ``mixing`` not ``[M, M]`` for the block grid, or ``time_slice`` out of range.
        ImportError: matplotlib missing.
    """
    bt, bh, bw = normalize_grid(tuple(block_grid), "block_grid")
    m = bt * bh * bw
    if tuple(mixing.shape) != (m, m):
        raise ValueError(f"mixing must be [{m}, {m}] for block grid {(bt, bh, bw)}; got {tuple(mixing.shape)}")
    ts = bt // 2 if time_slice is None else int(time_slice)
    if not 0 <= ts < bt:
        raise ValueError(f"time_slice must be in [0, {bt}); got {time_slice}")
    mc = mixing.detach().to("cpu", torch.float64)
    vmax = float(mc.max()) if float(mc.max()) > 0 else 1.0
    vmin = min(0.0, float(mc.min()))
    strip_w = bt * bw + (bt - 1)
    # panel sizes in inches: each panel shows bh x strip_w cells; the whole grid at most ~10 in wide
    pw = min(1.5 * max(1.0, strip_w / max(bh, bw)), 10.0 / bw)
    ph = pw * bh / strip_w
    gap, top, right = 0.08, (0.45 if title else 0.1), 1.0
    width, height = bw * pw * (1 + gap) + 0.2 + right, bh * ph * (1 + gap) + 0.2 + top
    fig = _figure(width, height)
    grid = fig.add_gridspec(
        bh, bw, left=0.1 / width, right=1 - right / width, bottom=0.1 / height, top=1 - top / height, wspace=gap, hspace=gap
    )
    image = None
    for ih in range(bh):
        for iw in range(bw):
            i = (ts * bh + ih) * bw + iw
            row = mc[i].reshape(bt, bh, bw).numpy()
            strip = np.full((bh, strip_w), np.nan)
            for t in range(bt):
                strip[:, t * (bw + 1) : t * (bw + 1) + bw] = row[t]
            ax = fig.add_subplot(grid[ih, iw])
            image = ax.imshow(strip, vmin=vmin, vmax=vmax, cmap="viridis", interpolation="nearest")
            x0 = ts * (bw + 1) + iw
            ax.add_patch(_rectangle((x0 - 0.5, ih - 0.5), 1, 1))
            ax.set_xticks([])
            ax.set_yticks([])
    if title:
        fig.suptitle(title, fontsize=9)
    cax = fig.add_axes([1 - (right - 0.15) / width, 0.1 / height, 0.15 / width, 1 - (top + 0.1) / height])
    fig.colorbar(image, cax=cax)
    return _save_png(fig, path)


def _rectangle(xy, w, h):
    from matplotlib.patches import Rectangle  # optional dependency (see _figure), loaded once _figure succeeded

    return Rectangle(xy, w, h, fill=False, edgecolor="red", linewidth=1.0)


def plot_rank_entropy(stats: Mapping[str, Any] | Sequence[Mapping[str, Any]], path: str | os.PathLike) -> Path:
    """Bar charts of rank and entropy per attention kind and layer, like paper Fig. 3; returns ``Path(path)``.

    Raises:
        ValueError: empty ``stats``.
        ImportError: matplotlib missing.
    """
    layers = [stats] if isinstance(stats, Mapping) else list(stats)
    if not layers:
        raise ValueError("stats is empty: nothing to plot")
    colours = {"softmax": "tab:blue", "linear": "tab:orange", "mhla": "tab:green"}
    n_layers = len(layers)
    fig = _figure(min(16.0, 4.0 + 1.1 * n_layers) * 1.6, 3.6)
    axes = [fig.add_subplot(1, 2, j + 1) for j in range(2)]
    width = 0.8 / len(KINDS)
    x = np.arange(n_layers)
    names = [str(s.get("index", s.get("layer", i))) for i, s in enumerate(layers)]
    for ax, metric, label in ((axes[0], "rank", "numerical rank"), (axes[1], "entropy", "row entropy (nats)")):
        for j, kind in enumerate(KINDS):
            mean = np.array([s["kinds"][kind][metric]["mean"] for s in layers])
            lo = np.array([s["kinds"][kind][metric]["min"] for s in layers])
            hi = np.array([s["kinds"][kind][metric]["max"] for s in layers])
            pos = x + (j - 1) * width
            ax.bar(pos, mean, width, color=colours[kind], label=kind)
            for p, m, a, b in zip(pos, mean, lo, hi):  # min-max over heads
                ax.errorbar([float(p)], [float(m)], yerr=[[float(m - a)], [float(b - m)]], color="black", capsize=2, linewidth=1)
        ax.set_xticks(x)
        ax.set_xticklabels(names if n_layers > 1 else [layers[0].get("layer", "")], fontsize=8)
        ax.set_xlabel("layer" if n_layers > 1 else "")
        ax.set_ylabel(label)
    first = layers[0]
    axes[0].axhline(first["rank_bound"]["linear"], color="tab:orange", linestyle="--", linewidth=1, label=f"d = {first['head_dim']}")
    axes[0].axhline(first["num_tokens"], color="grey", linestyle="--", linewidth=1, label=f"N = {first['num_tokens']}")
    if first["rank_bound"]["mhla"] < first["num_tokens"]:
        axes[0].axhline(first["rank_bound"]["mhla"], color="tab:green", linestyle="--", linewidth=1, label="MHLA bound")
    axes[1].axhline(math.log(first["num_tokens"]), color="grey", linestyle="--", linewidth=1, label="log N (uniform)")
    for ax in axes:  # room above the bars for the legend
        ax.set_ylim(0, ax.get_ylim()[1] * 1.25)
        ax.legend(fontsize=7, loc="upper center", ncol=3, frameon=False)
    axes[0].set_title("rank of the attention matrix", fontsize=9)
    axes[1].set_title("attention entropy", fontsize=9)
    fig.tight_layout()
    return _save_png(fig, path)
