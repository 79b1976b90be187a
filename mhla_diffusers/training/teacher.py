"""Data-free training data: the teacher's own samples (``data.kind: teacher``).

The teacher (``distill.teacher``: the original transformer) runs its pipeline from noise, with the
pipeline's own scheduler and classifier-free guidance, on conditions drawn from what the model takes
(DiT: its class labels; SANA, SANA-Video, Wan: prompts from a file, or the list shipped with the
package, :data:`PROMPTS`). A forward hook on the teacher records every call of its transformer: the
noisy latent, the timestep and the prediction, for the conditional rows and for the null-condition
rows of the guidance. What it stores (:mod:`mhla_diffusers.data.store`): per trajectory the clean
latent it generated, its condition, and its ``K`` steps as training pairs. Distillation trains on the
pairs (:class:`~mhla_diffusers.data.store.TeacherPairs`: the stored noisy latent, the teacher's
prediction as the output-matching target), fine-tuning on the clean latents with fresh noise
(:class:`~mhla_diffusers.data.store.TeacherSamples`), as on a dataset's. See ``docs/training.md``,
"Data-free retrofit".
"""

from __future__ import annotations

import contextlib
import hashlib
import inspect
import time
from pathlib import Path
from typing import Callable, Mapping

import torch
from tqdm.auto import tqdm

from mhla_diffusers.checkpoint.format import pipeline_transformers
from mhla_diffusers.checkpoint.io import atomic_write_json
from mhla_diffusers.data.store import (
    COST_DIR,
    TeacherPairs,
    TeacherSamples,
    missing_shards,
    num_shards,
    open_store,
    write_shard,
)
from mhla_diffusers.families.base import call_default
from mhla_diffusers.training.cache import cache_key, module_fingerprint

__all__ = ["PROMPTS", "USES", "read_prompts", "teacher_pipeline", "store_settings", "build_teacher_store", "teacher_dataset",
           "uses_pairs", "kept_steps"]

#: the prompt list shipped with the package (64 everyday scenes), used when ``data.teacher.prompts`` is null
PROMPTS = Path(__file__).resolve().parents[1] / "data" / "prompts.txt"
#: ``data.teacher.use``: ``auto`` (pairs when ``distill.data_weight`` is 0, else samples), ``pairs``, ``samples``
USES = ("auto", "pairs", "samples")


def read_prompts(path: str | Path | None = None) -> list[str]:
    """The prompts of a text file, one per non-blank line (``None``: :data:`PROMPTS`).

    Raises:
        FileNotFoundError: no such file. ValueError: no prompt in it.
    """
    path = Path(path) if path is not None else PROMPTS
    if not path.is_file():
        raise FileNotFoundError(f"data.teacher.prompts: {path} does not exist (a text file, one prompt per line)")
    prompts = [line.strip() for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    if not prompts:
        raise ValueError(f"data.teacher.prompts: {path} holds no prompt (one per non-blank line)")
    return prompts


def uses_pairs(config: Mapping) -> bool:
    """Whether the run trains on the stored trajectory pairs (else on the clean samples with fresh noise)."""
    use = config["data"]["teacher"]["use"]
    return use == "pairs" or (use == "auto" and float(config["distill"]["data_weight"]) == 0.0)


# -- the teacher's pipeline and what keys its samples ---------------------------------------------
def teacher_pipeline(parts, config: Mapping):
    """The pipeline that samples: the run's pipeline with the teacher in place of the trained transformer (DiT: the
    pipeline a run exports, ``export.sampler``'s scheduler); its progress bar off.

    Raises:
        ValueError: no teacher (``distill.teacher``), or another transformer of the pipeline has MHLA (Wan 2.2's
            other expert: it would not be the original's trajectory).
    """
    if parts.teacher is None:
        raise ValueError(
            "data.kind=teacher samples from the original model: set distill.teacher (original or the original pipeline folder)"
        )
    if parts.recipe.text_conditioned:
        components = dict(parts.pipeline.components)
        others = [n for n, t in pipeline_transformers(parts.pipeline).items() if n != parts.expert and _has_mhla(t)]
        if others:
            raise ValueError(f"data.kind=teacher: the pipeline's {others[0]} has MHLA; the teacher's samples need the original "
                             f"{others[0]}: fine-tune a pipeline whose other expert is the original one")
        components[parts.expert] = parts.teacher
        extra = {k: parts.pipeline.config[k] for k in ("boundary_ratio", "expand_timesteps") if k in parts.pipeline.config}
        pipe = type(parts.pipeline)(**components, **extra)
    else:
        pipe = parts.recipe.spec.pipeline(parts.teacher, parts.vae, parts.noise_scheduler, sampler=config["export"]["sampler"],
                                          id2label=parts.id2label)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _has_mhla(module) -> bool:
    return any(getattr(m, "mhla", None) is not None for m in module.modules())


def _conditions(parts, config: Mapping) -> dict:
    """What the trajectories are conditioned on: ``{"classes": [...]}`` or ``{"prompts": [...]}`` (in order, cycled)."""
    t_cfg = config["data"]["teacher"]
    if parts.recipe.text_conditioned:
        return {"prompts": read_prompts(t_cfg["prompts"])}
    classes = t_cfg["classes"]
    if classes is None:
        classes = sorted(parts.id2label) if parts.id2label else list(range(parts.recipe.spec.null_class(parts.transformer)))
    null = parts.recipe.spec.null_class(parts.transformer)
    bad = [c for c in classes if not 0 <= int(c) < null]
    if bad:
        raise ValueError(f"data.teacher.classes: {bad[:3]} outside the model's classes 0..{null - 1}")
    return {"classes": [int(c) for c in classes]}


def _size(parts, config: Mapping, pipe) -> dict:
    """The sample size: DiT its native one; text families ``data.resolution`` (and ``data.num_frames`` for videos)."""
    if not parts.recipe.text_conditioned:
        return {}
    r = config["data"]["resolution"]
    height, width = (r, r) if isinstance(r, int) else r
    size = {"height": int(height), "width": int(width)}
    if any(n in _parameters(pipe) for n in ("num_frames", "frames")):
        size["frames"] = int(config["data"]["num_frames"])
    return size


def _parameters(pipe) -> Mapping:
    return inspect.signature(type(pipe).__call__).parameters


def store_settings(parts, config: Mapping, pipe, *, seed: int) -> dict:
    """The settings a store's samples are a function of (its key is their digest): the teacher's and the other
    components' weights, the scheduler, guidance, steps, seed, conditions, size and dtype."""
    t_cfg = config["data"]["teacher"]
    conditions = _conditions(parts, config)
    if "prompts" in conditions:
        joined = "\n".join(conditions["prompts"]).encode()
        conditions = {"prompts_sha256": hashlib.sha256(joined).hexdigest(), "prompt_count": len(conditions["prompts"])}
    others = {n: module_fingerprint(t)["weights"] for n, t in pipeline_transformers(pipe).items() if t is not parts.teacher}
    return {
        "family": parts.family, "expert": parts.expert, "pipeline": type(pipe).__name__,
        "teacher": module_fingerprint(parts.teacher), "vae": module_fingerprint(parts.vae)["weights"],
        "text_encoder": module_fingerprint(getattr(pipe, "text_encoder", None)).get("weights"),
        "text": {k: v for k, v in parts.text.items() if k != "template"} if parts.recipe.text_conditioned else None,
        "other_transformers": others,
        "scheduler": {"class": type(pipe.scheduler).__name__, "config": dict(pipe.scheduler.config)},
        "guidance_scale": _guidance(t_cfg, pipe), "steps": _steps(t_cfg, pipe), "seed": int(seed),
        "pairs_per_trajectory": t_cfg["pairs_per_trajectory"],
        "conditions": conditions, "size": _size(parts, config, pipe),
        "dtype": str(next(parts.teacher.parameters()).dtype),
    }


def _guidance(t_cfg: Mapping, pipe) -> float:
    g = t_cfg["guidance_scale"]
    return float(call_default(pipe, "guidance_scale") if g is None else g)


def _steps(t_cfg: Mapping, pipe) -> int:
    k = t_cfg["steps"]
    return int(call_default(pipe, "num_inference_steps") if k is None else k)


# -- recording the teacher's calls ----------------------------------------------------------------
class _CallRecorder:
    """A forward hook on the teacher transformer keeping each call's ``(noisy, timesteps, prediction, null rows)``
    on the CPU; ``null_rows(kwargs)`` marks the rows of the null condition; a context manager."""

    def __init__(self, module: torch.nn.Module, prediction: Callable, null_rows: Callable):
        self.module, self.prediction, self.null_rows = module, prediction, null_rows
        self.calls: list = []
        self._handle = None

    def _hook(self, module, args, kwargs, output):
        noisy = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
        out = output.sample if hasattr(output, "sample") else output[0]
        t = kwargs["timestep"]
        t = t.expand(noisy.shape[0]) if t.ndim == 0 else t
        pred = self.prediction(out, noisy)
        self.calls.append(tuple(x.detach().to("cpu") for x in (noisy, t, pred, self.null_rows(kwargs))))

    def __enter__(self) -> "_CallRecorder":
        self.calls = []
        self._handle = self.module.register_forward_hook(self._hook, with_kwargs=True)
        return self

    def __exit__(self, *exc) -> bool:
        self._handle.remove()
        return False


def kept_steps(steps: int, keep: int | None) -> list[int]:
    """The steps of a ``steps``-call trajectory that are stored: all (``keep`` None or >= steps), else ``keep`` evenly
    spaced ones, the first and the last included."""
    if keep is None or keep >= steps:
        return list(range(steps))
    return sorted({round(i * (steps - 1) / max(keep - 1, 1)) for i in range(keep)}) if keep > 1 else [steps - 1]


def _trajectories(calls: list, n: int, keep: int | None = None) -> dict[str, torch.Tensor]:
    """The recorded calls of ``n`` trajectories as ``[n, K, ...]`` tensors (the j-th conditional row of a call is
    trajectory j; the null-condition rows pair with the conditional ones of the same step); ``keep``: the number of
    steps stored (:func:`kept_steps`).

    Raises:
        RuntimeError: calls that do not split into ``n`` conditional (and ``n`` null) rows, or null rows whose
            latents are not the conditional rows' (a pipeline whose guidance this does not read).
    """
    cond, null = [], []
    for noisy, t, pred, is_null in calls:
        for group, rows in ((cond, ~is_null), (null, is_null)):
            if int(rows.sum()) not in (0, n):
                raise RuntimeError(f"a teacher call had {int(rows.sum())} rows of one condition kind, not 0 or {n}")
            if rows.any():
                group.append((noisy[rows], t[rows], pred[rows]))
    if not cond:
        raise RuntimeError("the teacher's transformer ran no conditional row: the pipeline did not call the teacher")
    if null and (len(null) != len(cond) or any(not torch.equal(a[0], b[0]) for a, b in zip(cond, null))):
        raise RuntimeError("the teacher's null-condition calls do not pair with its conditional ones (step by step)")
    steps = kept_steps(len(cond), keep)
    out = {name: torch.stack([cond[k][i] for k in steps], 1) for i, name in enumerate(("noisy", "timesteps", "teacher_pred"))}
    if null:
        out["teacher_null_pred"] = torch.stack([null[k][2] for k in steps], 1)
    return out


# -- one shard ----------------------------------------------------------------------------------------
def _shard_conditions(parts, conditions: dict, indices: range, device) -> tuple[dict, dict, Callable]:
    """``(pipeline keyword arguments, stored tensors, null_rows)`` of the trajectories ``indices``."""
    if "classes" in conditions:
        classes = conditions["classes"]
        labels = [classes[i % len(classes)] for i in indices]
        null_class = parts.recipe.spec.null_class(parts.transformer)
        stored = {"class_labels": torch.tensor(labels, dtype=torch.long)}
        return {"class_labels": labels}, stored, lambda kw: kw["class_labels"] == null_class
    prompts = conditions["prompts"]
    encoded = parts.recipe.encode_text(parts, [prompts[i % len(prompts)] for i in indices], device)
    null = parts.null_condition
    call = {**encoded, **{f"negative_{k}": null[k].to(device).repeat(len(indices), *([1] * (null[k].ndim - 1))) for k in encoded}}
    key = parts.recipe.condition_keys["prompt_embeds"]

    def null_rows(kwargs):
        rows = kwargs[key]
        return (rows == null["prompt_embeds"].to(rows.device, rows.dtype)).flatten(1).all(1)

    return call, {k: v.to("cpu") for k, v in encoded.items()}, null_rows


@contextlib.contextmanager
def _decoded_latents(vae):
    """Keep the latents a pipeline decodes (``vae.decode``'s input): DiTPipeline has no latent output."""
    seen: list = []
    original = vae.decode

    def decode(z, *args, **kwargs):
        seen.append(z.detach())
        return original(z, *args, **kwargs)

    vae.decode = decode
    try:
        yield seen
    finally:
        del vae.decode


def _sample(parts, pipe, call: dict, generators: list, settings: Mapping) -> torch.Tensor:
    """Clean latents of one batch, in the training latent space (the pipeline's latent output)."""
    kwargs = dict(call, generator=generators, guidance_scale=settings["guidance_scale"], num_inference_steps=settings["steps"])
    if not parts.recipe.text_conditioned:
        with _decoded_latents(pipe.vae) as seen:
            pipe(**kwargs, output_type="pt")
        return seen[-1].float() * float(pipe.vae.config.scaling_factor)
    size = dict(settings["size"])
    frames = size.pop("frames", None)
    # the prompts come as embeddings: the pipeline's default negative prompt ("") would be a second source
    wanted = {**size, "num_frames": frames, "frames": frames, "use_resolution_binning": False, "negative_prompt": None}
    accepted = _parameters(pipe)
    kwargs.update({k: v for k, v in wanted.items() if k in accepted and (v is not None or k == "negative_prompt")})
    try:
        return pipe(**kwargs, output_type="latent", return_dict=False)[0].float()
    except ValueError as err:  # the pipeline's own checks of the size
        raise ValueError(f"the teacher's {type(pipe).__name__} refused the sampling call, size {settings['size']} (from "
                         f"data.resolution, data.num_frames): {err}") from err


def _seed(seed: int, index: int, salt: int) -> int:
    return (int(seed) * 1_000_003 + int(index) * 7_919 + salt) % (1 << 63)


def _generate_shard(parts, pipe, settings: Mapping, conditions: dict, index: int, shard_size: int, device) -> tuple[dict, int]:
    """The tensors of shard ``index`` and the teacher calls it took; a function of the settings and ``index`` alone."""
    indices = range(index * shard_size, (index + 1) * shard_size)
    call, stored, null_rows = _shard_conditions(parts, conditions, indices, device)
    generators = [torch.Generator("cpu").manual_seed(_seed(settings["seed"], i, 1)) for i in indices]
    devices = [device] if torch.device(device).type == "cuda" else []
    recorder = _CallRecorder(parts.teacher, parts.recipe.spec.prediction, null_rows)
    with torch.random.fork_rng(devices=devices), recorder, torch.no_grad():
        torch.manual_seed(_seed(settings["seed"], index, 2))  # a scheduler drawing from the global generator
        latents = _sample(parts, pipe, call, generators, settings)
    pairs = _trajectories(recorder.calls, shard_size, settings["pairs_per_trajectory"])
    return {"latents": latents, **stored, **pairs}, len(recorder.calls)


# -- the store ---------------------------------------------------------------------------------------
def build_teacher_store(parts, config: Mapping, folder: str | Path, *, trajectories: int, seed: int, rank: int = 0,
                        world_size: int = 1, barrier: Callable[[], None] | None = None, progress: bool = False) -> Path:
    """Generate the missing shards of the store at ``folder`` holding the first ``trajectories`` (this process: shards
    ``j`` with ``j % world_size == rank``), after checking the store's key; returns ``folder``.

    Shard ``j`` is a pure function of the settings and ``j`` (per-trajectory noise generators, the global generator
    seeded per shard), so a resumed build or any number of processes writes the same shards.

    Raises:
        ValueError: the folder holds another teacher's or setting's samples (naming what differs); settings errors.
        RuntimeError: the pipeline's calls of the teacher cannot be read as trajectories.
    """
    pipe = teacher_pipeline(parts, config)
    settings = store_settings(parts, config, pipe, seed=seed)
    shard_size = int(config["data"]["teacher"]["shard_size"])
    key = cache_key(settings)
    if rank == 0:
        open_store(folder, key, settings, shard_size)
    if barrier is not None:
        barrier()
    open_store(folder, key, settings, shard_size, create=False)
    conditions = _conditions(parts, config)
    mine = [j for j in missing_shards(folder, num_shards(trajectories, shard_size)) if j % world_size == rank]
    device = next(parts.teacher.parameters()).device
    bar = tqdm(mine, desc="teacher samples", unit="shard", disable=not progress, dynamic_ncols=True)
    for j in bar:
        wall, cpu = time.perf_counter(), time.process_time()
        tensors, calls = _generate_shard(parts, pipe, settings, conditions, j, shard_size, device)
        cost = {"wall_s": time.perf_counter() - wall, "cpu_s": time.process_time() - cpu, "calls": calls,
                "trajectories": shard_size, "steps": settings["steps"]}
        atomic_write_json(Path(folder) / COST_DIR / f"{j:05d}.json", cost, sort_keys=True)
        write_shard(folder, j, tensors, key)
        bar.set_postfix(s_per_trajectory=f"{cost['wall_s'] / shard_size:.2f}", calls=calls)
    if barrier is not None:
        barrier()
    return Path(folder)


def teacher_dataset(parts, config: Mapping, accelerator, *, heldout: bool = False):
    """The training (or held-out) view of the run's teacher store, built first where shards are missing.

    Training: ``data.teacher.samples`` trajectories of seed ``data.teacher.seed`` in ``data.teacher.store_dir``
    (null: ``<output_dir>/teacher_store``), as pairs or samples (:func:`uses_pairs`). Held-out: ``eval.samples``
    trajectories of seed ``eval.seed`` in ``<store_dir>/heldout``, as samples.
    """
    t_cfg = config["data"]["teacher"]
    folder = Path(t_cfg["store_dir"]) if t_cfg["store_dir"] else Path(config["output_dir"]) / "teacher_store"
    trajectories, seed = int(t_cfg["samples"]), int(t_cfg["seed"])
    if heldout:
        folder, trajectories, seed = folder / "heldout", int(config["eval"]["samples"]), int(config["eval"]["seed"])
    build_teacher_store(parts, config, folder, trajectories=trajectories, seed=seed, rank=accelerator.process_index,
                        world_size=accelerator.num_processes, barrier=accelerator.wait_for_everyone,
                        progress=accelerator.is_local_main_process)
    view = TeacherPairs if uses_pairs(config) and not heldout else TeacherSamples
    return view(folder, trajectories)
