"""A DiT pipeline end to end: real photo inputs, every layer's statistics, the markdown / JSON / PNG report."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Mapping, Sequence

import torch
from diffusers import DDPMScheduler

from mhla_diffusers.autoencoder import vae_scale_factor
from mhla_diffusers.checkpoint.io import atomic_write_json, atomic_write_text
from mhla_diffusers.data.photos import PHOTO_NAMES, PhotoCrops
from mhla_diffusers.diagnostics.attention import KINDS
from mhla_diffusers.diagnostics.capture import capture_query_key, layer_mixing, qk_statistics
from mhla_diffusers.diagnostics.plots import plot_mixing_matrix, plot_rank_entropy
from mhla_diffusers.families import family_of, self_attention_modules
from mhla_diffusers.ops.mixing import mixing_init


# -- a pipeline, end to end -----------------------------------------------------------------------
@torch.no_grad()
def diagnostic_inputs(
    pipe,
    *,
    num_samples: int = 4,
    timesteps: Sequence[int] = (100, 500, 900),
    seed: int = 1234,
    short_side: int | None = None,
) -> dict[str, Any]:
    """Real inputs for a class-conditional DiT pipeline: shipped-photo crops, VAE-encoded, noised at each timestep.

    ``B = num_samples * len(timesteps)`` rows (sample ``(i, j)`` at row ``i * len(timesteps) + j``) in
    ``"model_inputs"``, plus ``"timesteps"``, ``"labels"``, ``"resolution"`` (pixels).

    Raises:
        ValueError: ``num_samples < 1``, empty or out-of-range ``timesteps``, no ``sample_size``.
    """
    if int(num_samples) != num_samples or num_samples < 1:
        raise ValueError(f"num_samples must be a positive integer; got {num_samples!r}")
    timesteps = [int(t) for t in timesteps]
    scheduler = DDPMScheduler.from_config(pipe.scheduler.config)
    total = scheduler.config.num_train_timesteps
    if not timesteps or any(not 0 <= t < total for t in timesteps):
        raise ValueError(f"timesteps must be a non-empty list in [0, {total}); got {timesteps}")
    transformer, vae = pipe.transformer, pipe.vae
    size = transformer.config.get("sample_size")
    if size is None:
        raise ValueError("the transformer's config has no sample_size: cannot tell the checkpoint's resolution")
    resolution = int(size if isinstance(size, int) else size[0]) * vae_scale_factor(vae)
    raw = dict(pipe.config.get("id2label") or {}) if hasattr(pipe, "config") else {}
    id2label = {int(key): str(v) for key, v in raw.items()}
    if id2label and sorted(id2label) == list(range(len(id2label))) and all(v in PHOTO_NAMES for v in id2label.values()):
        photos = [id2label[i] for i in range(len(id2label))]
    else:
        photos = list(PHOTO_NAMES)
    classes = int(transformer.config.get("num_embeds_ada_norm") or 1000)
    per_photo = max(1, -(-num_samples // len(photos)))
    data = PhotoCrops(resolution=resolution, short_side=short_side, crops_per_photo=per_photo, seed=seed, hflip=False, photos=photos)
    items = [data[i] for i in range(num_samples)]
    device = next(transformer.parameters()).device
    dtype = next(transformer.parameters()).dtype
    pixels = torch.stack([it["pixel_values"] for it in items]).to(device, vae.dtype)
    labels = torch.stack([it["class_labels"] for it in items]) % classes
    latents = vae.encode(pixels).latent_dist.mode() * vae.config.scaling_factor
    reps = len(timesteps)
    latents = latents.repeat_interleave(reps, dim=0)
    t = torch.tensor(timesteps * num_samples, dtype=torch.long)
    generator = torch.Generator("cpu").manual_seed(seed)
    noise = torch.randn(latents.shape, generator=generator, dtype=torch.float32).to(device, latents.dtype)
    noisy = scheduler.add_noise(latents, noise, t.to(device))
    labels = labels.repeat_interleave(reps)
    return {
        "model_inputs": {"hidden_states": noisy.to(dtype), "timestep": t.to(device), "class_labels": labels.to(device)},
        "timesteps": t.tolist(),
        "labels": [photos[int(i)] if int(i) < len(photos) else str(int(i)) for i in labels],
        "resolution": resolution,
    }


def diagnose_pipeline(
    pipe,
    *,
    layers: Sequence[int] | None = None,
    num_samples: int = 4,
    timesteps: Sequence[int] = (100, 500, 900),
    num_blocks: int = 16,
    rtol: float | None = None,
    seed: int = 1234,
    short_side: int | None = None,
) -> dict[str, Any]:
    """Per-layer rank / entropy of the three kinds on a DiT pipeline's self-attention layers (all, or ``layers``).

    One forward; ``ValueError`` for a layer index out of range.
    """
    transformer = pipe.transformer
    modules = self_attention_modules(transformer, family_of(transformer))
    chosen = list(range(len(modules))) if layers is None else [int(i) for i in layers]
    bad = [i for i in chosen if not 0 <= i < len(modules)]
    if bad or not chosen:
        raise ValueError(
            f"layer indices {bad or chosen} out of range: the model has {len(modules)} self-attention layers (0..{len(modules) - 1})"
        )
    inputs = diagnostic_inputs(pipe, num_samples=num_samples, timesteps=timesteps, seed=seed, short_side=short_side)
    was_training = transformer.training
    transformer.eval()
    try:
        captured = capture_query_key(transformer, [modules[i][0] for i in chosen], inputs["model_inputs"])
    finally:
        transformer.train(was_training)
    results = []
    for i in chosen:
        name, attn = modules[i]
        mixing, grid = layer_mixing(attn)
        stats = qk_statistics(captured[name], mixing=mixing, block_grid=grid, num_blocks=num_blocks, rtol=rtol)
        results.append({"layer": name, "index": i, "layer_kind": "mhla" if mixing is not None else "stock", **stats})
    return {
        "model": type(transformer).__name__,
        "resolution": inputs["resolution"],
        "timesteps": inputs["timesteps"],
        "labels": inputs["labels"],
        "layers": results,
    }


def _fmt(summary: Mapping[str, Any], digits: int) -> str:
    return f"{summary['mean']:.{digits}f} ({summary['min']:.{digits}f}-{summary['max']:.{digits}f})"


def markdown_report(result: Mapping[str, Any]) -> str:
    """A markdown summary of :func:`diagnose_pipeline`'s result: per layer and kind, then per timestep."""
    layers = result["layers"]
    lines = [
        "# Attention rank and entropy (MHLA paper, Fig. 3)",
        "",
        f"{result['model']}, {result['resolution']} px inputs, {len(result['timesteps'])} samples "
        f"(timesteps {sorted(set(result['timesteps']))}). Per head: mean over samples; table: mean over "
        "heads (min-max over heads). Rank: numerical rank of the row-normalised N x N matrix "
        f"(rtol = {layers[0]['rtol']:.2g}); bound: softmax N, linear min(N, d), MHLA min(N, sum_b min(N_b, d)). "
        "Entropy: mean row entropy in nats (log N = uniform rows).",
        "",
        "| layer | runs | N | d | blocks (mixing) | kind | rank | bound | entropy (nats) | entropy / log N | empty rows |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for s in layers:
        blocks = f"{'x'.join(str(x) for x in s['block_grid'])} ({s['mixing_source'].replace('_', ' ')})"
        for kind in KINDS:
            k = s["kinds"][kind]
            lines.append(
                f"| {s.get('index', s['layer'])} | {s.get('layer_kind', '')} | {s['num_tokens']} | {s['head_dim']} | {blocks} | {kind} | "
                f"{_fmt(k['rank'], 1)} | {s['rank_bound'][kind]} | {_fmt(k['entropy'], 3)} | "
                f"{k['normalized_entropy']['mean']:.3f} | {k['empty_rows']:.3f} |"
            )
    timesteps = result["timesteps"]
    unique = sorted(set(timesteps))
    if len(unique) > 1:
        lines += ["", "Means over layers, heads and samples, per timestep:", "",
                  "| timestep | " + " | ".join(f"rank {k}" for k in KINDS) + " | " + " | ".join(f"entropy {k}" for k in KINDS) + " |",
                  "|---|" + "---|" * (2 * len(KINDS))]
        for t in unique:
            rows = [i for i, x in enumerate(timesteps) if x == t]
            cells = []
            for metric in ("rank", "entropy"):
                for kind in KINDS:
                    vals = torch.tensor([s["per_sample"][kind][metric][i] for s in layers for i in rows], dtype=torch.float64)
                    cells.append(f"{float(vals.nanmean()):.{1 if metric == 'rank' else 3}f}")
            lines.append(f"| {t} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def write_report(result: Mapping[str, Any], out_dir: str | os.PathLike, pipe=None) -> dict[str, Path]:
    """Write :func:`diagnose_pipeline`'s result into ``out_dir`` (JSON, markdown, PNGs; each atomically).

    Returns:
        ``{name: path}`` of the written files.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    files = {
        "json": atomic_write_json(out / "diagnostics.json", result, indent=1),
        "markdown": atomic_write_text(out / "diagnostics.md", markdown_report(result)),
        "rank_entropy": plot_rank_entropy(result["layers"], out / "rank_entropy.png"),
    }
    init_done = False
    for s in result["layers"]:
        if s["mixing_source"] == "layer" and pipe is not None:
            mixing, grid = layer_mixing(pipe.transformer.get_submodule(s["layer"]))
            files[f"mixing_layer{s['index']}"] = plot_mixing_matrix(
                mixing, grid, out / f"mixing_layer{s['index']}.png", title=f"{s['layer']}: mixing matrix (clamped)"
            )
        elif s["mixing_source"] == "locality_init" and not init_done:
            grid = tuple(s["block_grid"])
            files["mixing_locality_init"] = plot_mixing_matrix(
                mixing_init(grid), grid, out / "mixing_locality_init.png", title=f"locality init, block grid {grid}"
            )
            init_done = True
    return files
