"""Fine-tuning DiT (class-conditional, epsilon prediction) with or without MHLA, on accelerate.

The pieces, each usable alone, then :func:`train` which strings them together as one flat loop
(``finetune/train.py`` only parses arguments and calls it):

- :func:`load_config` — defaults + a YAML file + ``key.path=value`` overrides, validated.
- :func:`build_models` — the transformer (from a pipeline folder through
  :func:`mhla_diffusers.load_mhla_pipeline`, or from scratch from a config dict), the
  autoencoder, the DDPM noise scheduler; MHLA applied if asked and not present yet.
- :func:`build_dataset` — :class:`~mhla_diffusers.data.PhotoCrops` or
  :class:`~mhla_diffusers.data.ImageFolderCrops`.
- :func:`build_optimizer` — AdamW, the mixing matrices in their own group (own lr, no decay).
- :func:`diffusion_loss` — the DDPM epsilon-prediction loss of one batch (Ho et al. 2020, Eq. 14;
  DiT, Peebles & Xie 2023), label dropout for classifier-free guidance included.
- :func:`write_loss_csv`, :func:`read_loss_csv`, :func:`plot_loss_curves` — the loss log and plot.
- :func:`export_pipeline` — a complete ``DiTPipeline`` folder (sampling scheduler, id2label),
  written with :func:`mhla_diffusers.save_mhla_pipeline` (atomic).

After every optimizer step :func:`mhla_diffusers.clamp_mixing_` keeps the mixing matrices in
``[0, 1]`` (MHLA paper, Sec. 3.3).
"""

from __future__ import annotations

import copy
import csv
import io
import json
import math
import os
import time
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

import torch
import torch.nn.functional as F
import yaml

__all__ = [
    "DEFAULT_CONFIG",
    "load_config",
    "apply_overrides",
    "build_models",
    "build_dataset",
    "check_resolution",
    "vae_scale_factor",
    "build_optimizer",
    "diffusion_loss",
    "evaluate_loss",
    "disable_internal_label_dropout",
    "write_loss_csv",
    "read_loss_csv",
    "plot_loss_curves",
    "export_pipeline",
    "train",
]

# Every key a config may have. Sections whose value is a free dict (passed to a constructor) are
# listed in _FREE_SECTIONS; "mhla" may be null (no MHLA) or a dict of apply_mhla arguments.
DEFAULT_CONFIG: dict[str, Any] = {
    "output_dir": None,
    "model": {
        # A pipeline folder (plain or MHLA checkpoint, loaded with load_mhla_pipeline) ...
        "pretrained": None,
        # ... or a DiTTransformer2DModel config dict to train from scratch.
        "init": None,
        # From scratch only: the SpaceToDepthAutoencoder and DDPMScheduler configs. With
        # `pretrained`, the pipeline's own vae and scheduler config are used.
        "vae": {"factor": 2, "in_channels": 3, "scaling_factor": 1.8},
        "noise_scheduler": {
            "num_train_timesteps": 1000,
            "beta_schedule": "scaled_linear",
            "beta_start": 0.00085,
            "beta_end": 0.012,
            "clip_sample": False,
            "prediction_type": "epsilon",
        },
    },
    # null: no MHLA (the base softmax model, or fine-tune a checkpoint as it is). A dict:
    # arguments of mhla_diffusers.apply_mhla, applied when the loaded model has no MHLA yet.
    "mhla": None,
    "data": {
        "kind": "photos",  # photos | folder
        "root": None,  # kind=folder: root/<class name>/<images>
        "resolution": 64,  # crop side, pixels
        "short_side": None,  # resize short side to this before cropping (None: dataset default)
        "crops_per_image": 64,  # crops of each image per epoch
        "photos": None,  # kind=photos: subset of PHOTO_NAMES (None: all)
        "hflip": True,
        "seed": 0,  # crop positions / flips / shuffling
        "batch_size": 16,  # per process
        "num_workers": 0,
    },
    "train": {
        "max_steps": 1000,  # optimizer steps
        "lr": 1e-4,
        "mixing_lr": None,  # lr of the MHLA mixing matrices (None: lr)
        "weight_decay": 0.0,  # not applied to the mixing matrices
        "adam_beta1": 0.9,
        "adam_beta2": 0.999,
        "adam_eps": 1e-8,
        "lr_scheduler": "constant_with_warmup",  # any name of diffusers.optimization.get_scheduler
        "warmup_steps": 0,
        "grad_clip": 1.0,  # max global grad norm; 0 or null: off
        "mixed_precision": "no",  # no | fp16 | bf16 (accelerate autocast; parameters stay fp32)
        "gradient_accumulation_steps": 1,
        "gradient_checkpointing": False,
        "class_dropout": 0.1,  # label -> null class (classifier-free guidance)
        "checkpointing_steps": 0,  # accelerate save_state every N steps (0: never)
        "checkpoints_total_limit": 2,
        "resume": False,  # resume from the latest complete state in output_dir/checkpoints
        "seed": 0,  # model init, noise, timesteps, label dropout
        "log_every": 10,  # tqdm postfix and loss CSV flush, in steps
    },
    "eval": {
        "samples": 0,  # > 0: held-out epsilon MSE on this many fixed crops, before and after training
        "seed": 12345,  # crops, noise; timesteps are evenly spaced over [0, T - 1]
        "batch_size": 16,
    },
    "export": {
        "sampler": "dpm",  # dpm | ddim | ddpm : the scheduler of the exported pipeline
        "dir": None,  # the final pipeline folder (null: output_dir/final; else a path as given)
    },
}
_FREE_SECTIONS = {("model", "init"), ("model", "vae"), ("model", "noise_scheduler"), ("mhla",)}
_FLOAT_KEYS = ("lr", "mixing_lr", "weight_decay", "adam_beta1", "adam_beta2", "adam_eps", "grad_clip", "class_dropout")
_MHLA_KEYS = {"layers", "num_blocks", "block_grid", "normalize", "eps", "backend", "init"}
LOSS_CSV = "loss.csv"
LOSS_PNG = "loss.png"
TRAIN_STATE = "train_state.json"
SUMMARY = "train_summary.json"


# -- configuration --------------------------------------------------------------------------------
def _merge(base: dict, update: Mapping, path: tuple[str, ...] = ()) -> dict:
    out = copy.deepcopy(base)
    for key, value in update.items():
        here = path + (str(key),)
        if key not in base:
            where = ".".join(path) or "the top level"
            raise ValueError(f"unknown config key {'.'.join(here)!r}; valid keys at {where}: {sorted(base)}")
        if here in _FREE_SECTIONS or not isinstance(base[key], dict):
            out[key] = copy.deepcopy(value)
        elif value is None:
            raise ValueError(f"config section {'.'.join(here)!r} cannot be null")
        elif not isinstance(value, Mapping):
            raise ValueError(f"config section {'.'.join(here)!r} must be a mapping; got {value!r}")
        else:
            out[key] = _merge(base[key], value, here)
    return out


def apply_overrides(config: dict, overrides: Iterable[str]) -> dict:
    """Apply ``"dotted.key=value"`` overrides (value parsed as YAML: ``10``, ``1e-4``, ``null``, ``[1, 2]``).

    Setting a key inside a null section creates it (``mhla.layers=hybrid`` turns MHLA on).

    Raises:
        ValueError: malformed override or unknown key.
    """
    config = copy.deepcopy(config)
    for item in overrides:
        if "=" not in item:
            raise ValueError(f"override {item!r} must look like section.key=value (e.g. train.max_steps=10)")
        key, raw = item.split("=", 1)
        parts = [p for p in key.strip().split(".")]
        if not all(parts):
            raise ValueError(f"override {item!r}: empty key component")
        node = config
        for i, part in enumerate(parts[:-1]):
            child = node.get(part)
            if child is None:  # a null section (mhla: null) or a new sub-dict of a free section
                child = node[part] = {}
            elif not isinstance(child, dict):
                raise ValueError(f"override {item!r}: {'.'.join(parts[: i + 1])} is not a section")
            node = child
        node[parts[-1]] = yaml.safe_load(raw) if raw.strip() else None
        config = _merge(DEFAULT_CONFIG, config)  # rejects unknown keys
    return config


def load_config(path: str | os.PathLike | None = None, overrides: Iterable[str] = ()) -> dict:
    """Defaults (:data:`DEFAULT_CONFIG`) <- the YAML file at ``path`` <- ``overrides``; validated.

    Returns:
        The complete config dict (every key present).

    Raises:
        FileNotFoundError: ``path`` does not exist.
        ValueError: unknown keys, a missing ``output_dir``, neither or both of ``model.pretrained``
            and ``model.init``, bad values (the message names the key and what to do).
    """
    config = copy.deepcopy(DEFAULT_CONFIG)
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"config file {path} does not exist")
        loaded = yaml.safe_load(path.read_text()) or {}
        if not isinstance(loaded, Mapping):
            raise ValueError(f"{path} must hold a YAML mapping (sections model, mhla, data, train, export, output_dir)")
        config = _merge(config, loaded)
    config = apply_overrides(config, overrides)
    validate_config(config)
    return config


def validate_config(config: dict) -> None:
    """Check a merged config; raise ``ValueError`` naming the offending key."""
    if not config.get("output_dir"):
        raise ValueError("output_dir is not set: add `output_dir: <folder>` to the YAML or pass --set output_dir=<folder>")
    m = config["model"]
    if (m["pretrained"] is None) == (m["init"] is None):
        raise ValueError(
            "set exactly one of model.pretrained (a pipeline folder) and model.init "
            "(a DiTTransformer2DModel config dict to train from scratch)"
        )
    if m["init"] is not None and not isinstance(m["init"], Mapping):
        raise ValueError(f"model.init must be a mapping of DiTTransformer2DModel arguments; got {m['init']!r}")
    mh = config["mhla"]
    if mh is not None:
        if not isinstance(mh, Mapping):
            raise ValueError(f"mhla must be null or a mapping with keys {sorted(_MHLA_KEYS)}; got {mh!r}")
        unknown = set(mh) - _MHLA_KEYS
        if unknown:
            raise ValueError(f"unknown mhla keys {sorted(unknown)}; valid: {sorted(_MHLA_KEYS)}")
    d, t = config["data"], config["train"]
    if d["kind"] not in ("photos", "folder"):
        raise ValueError(f"data.kind must be 'photos' or 'folder'; got {d['kind']!r}")
    if d["kind"] == "folder" and not d["root"]:
        raise ValueError("data.kind=folder needs data.root (a folder with one sub-folder of images per class)")
    for section, key in [("data", "batch_size"), ("train", "max_steps"), ("train", "gradient_accumulation_steps"), ("train", "log_every")]:
        v = config[section][key]
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise ValueError(f"{section}.{key} must be a positive integer; got {v!r}")
    for key in ("warmup_steps", "checkpointing_steps"):
        v = t[key]
        if not isinstance(v, int) or isinstance(v, bool) or v < 0:
            raise ValueError(f"train.{key} must be an integer >= 0; got {v!r}")
    # PyYAML (YAML 1.1) reads "1e-4" (no dot) as a string: accept numeric strings for float keys.
    for key in _FLOAT_KEYS:
        v = t[key]
        if v is None and key in ("mixing_lr", "grad_clip"):
            continue
        try:
            t[key] = float(v)
        except (TypeError, ValueError):
            raise ValueError(f"train.{key} must be a number; got {v!r}") from None
    if t["lr"] <= 0:
        raise ValueError(f"train.lr must be > 0; got {t['lr']!r}")
    if t["mixing_lr"] is not None and t["mixing_lr"] < 0:
        raise ValueError(f"train.mixing_lr must be null or >= 0; got {t['mixing_lr']!r}")
    if not 0.0 <= t["class_dropout"] < 1.0:
        raise ValueError(f"train.class_dropout must be in [0, 1); got {t['class_dropout']!r}")
    if t["mixed_precision"] not in ("no", "fp16", "bf16"):
        raise ValueError(f"train.mixed_precision must be no, fp16 or bf16; got {t['mixed_precision']!r}")
    if config["export"]["sampler"] not in ("dpm", "ddim", "ddpm"):
        raise ValueError(f"export.sampler must be dpm, ddim or ddpm; got {config['export']['sampler']!r}")




# -- models, data, optimizer -----------------------------------------------------------------------
def build_models(config: dict) -> dict[str, Any]:
    """Build what training needs from ``config["model"]`` and ``config["mhla"]``.

    Returns:
        ``{"transformer", "vae", "noise_scheduler", "id2label", "mhla_applied"}``: the transformer
        in fp32 and train mode; the autoencoder frozen in eval mode; a ``DDPMScheduler``;
        ``id2label`` from the pretrained pipeline (or ``None``); the converted module names (or ``[]``).

    Raises:
        ValueError: a bad ``model.init`` / ``model.vae`` / ``model.noise_scheduler`` dict, a model
            that is not class-conditional with ``num_embeds_ada_norm`` classes, or an ``mhla``
            section for a checkpoint that already has MHLA with a different layout.
        FileNotFoundError, MHLACheckpointError: from :func:`mhla_diffusers.load_mhla_pipeline`.
    """
    from diffusers import DDPMScheduler, DiTTransformer2DModel

    from .apply import apply_mhla, is_mhla_model
    from .autoencoder import SpaceToDepthAutoencoder
    from .checkpoint import load_mhla_pipeline

    m = config["model"]
    id2label = None
    if m["pretrained"] is not None:
        pipe = load_mhla_pipeline(m["pretrained"], torch_dtype=torch.float32)
        transformer, vae = pipe.transformer, pipe.vae
        noise_scheduler = DDPMScheduler.from_config(pipe.scheduler.config)
        raw = pipe.config.get("id2label") if hasattr(pipe, "config") else None
        if raw:
            id2label = {int(k): str(v) for k, v in dict(raw).items()}
    else:
        try:
            transformer = DiTTransformer2DModel(**dict(m["init"]))
        except TypeError as e:
            raise ValueError(f"model.init is not a valid DiTTransformer2DModel config: {e}") from e
        try:
            vae = SpaceToDepthAutoencoder(**dict(m["vae"]))
        except TypeError as e:
            raise ValueError(f"model.vae is not a valid SpaceToDepthAutoencoder config: {e}") from e
        try:
            noise_scheduler = DDPMScheduler(**dict(m["noise_scheduler"]))
        except TypeError as e:
            raise ValueError(f"model.noise_scheduler is not a valid DDPMScheduler config: {e}") from e
    if getattr(noise_scheduler.config, "prediction_type", "epsilon") != "epsilon":
        raise ValueError(f"only epsilon prediction is supported; the scheduler says {noise_scheduler.config.prediction_type!r}")
    if transformer.config.get("num_embeds_ada_norm") is None:
        raise ValueError("the transformer must be class-conditional (num_embeds_ada_norm set; DiTPipeline needs 1000)")
    applied: list[str] = []
    if config["mhla"] is not None:
        spec = dict(config["mhla"])
        if is_mhla_model(transformer):
            pass  # the checkpoint already carries MHLA (loaded with its mixing matrices); keep it
        else:
            applied = apply_mhla(transformer, **spec)
    if any(p.dtype != torch.float32 for p in transformer.parameters()):
        transformer.to(torch.float32)  # trainable parameters in fp32 (autocast does the rest)
    transformer.train()
    vae.requires_grad_(False).eval()
    return {"transformer": transformer, "vae": vae, "noise_scheduler": noise_scheduler, "id2label": id2label, "mhla_applied": applied}


def vae_scale_factor(vae) -> int:
    """Pixels per latent pixel: ``config.factor`` (SpaceToDepthAutoencoder) or ``2 ** (levels - 1)`` (AutoencoderKL)."""
    if "factor" in vae.config:
        return int(vae.config.factor)
    return 2 ** (len(vae.config.block_out_channels) - 1)


def check_resolution(transformer, vae, resolution: int) -> None:
    """Raise ``ValueError`` unless ``resolution / vae_scale_factor == transformer.config.sample_size``.

    DiT's positional embedding and ``DiTPipeline`` are fixed to ``sample_size`` latent pixels.
    """
    f = vae_scale_factor(vae)
    size = transformer.config.sample_size
    if resolution % f or resolution // f != size:
        raise ValueError(
            f"data.resolution={resolution} px gives {resolution / f:g} latent pixels (vae factor {f}), but the "
            f"transformer's sample_size is {size}: set data.resolution to {size * f}"
        )


def build_dataset(data: Mapping[str, Any]):
    """The dataset of ``config["data"]``: :class:`PhotoCrops` (``kind: photos``) or :class:`ImageFolderCrops`.

    Raises:
        ValueError / FileNotFoundError: from the dataset constructors (bad sizes, empty folder, ...).
    """
    from .data import ImageFolderCrops, PhotoCrops

    common = dict(resolution=data["resolution"], short_side=data["short_side"], seed=data["seed"], hflip=data["hflip"])
    if data["kind"] == "photos":
        return PhotoCrops(crops_per_photo=data["crops_per_image"], photos=data["photos"], **common)
    return ImageFolderCrops(data["root"], crops_per_image=data["crops_per_image"], **common)


def build_optimizer(
    model: torch.nn.Module,
    lr: float,
    *,
    mixing_lr: float | None = None,
    weight_decay: float = 0.0,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-8,
) -> torch.optim.AdamW:
    """AdamW over the trainable parameters of ``model``; MHLA mixing matrices in a second group.

    Group 0: every other trainable parameter (``lr``, ``weight_decay``). Group 1 (if the model has
    mixing matrices): the mixing matrices (``mixing_lr`` or ``lr``, no weight decay).

    Raises:
        ValueError: no trainable parameters.
    """
    from .mixing import mixing_parameters

    mixing = [p for p in mixing_parameters(model) if p.requires_grad]
    ids = {id(p) for p in mixing}
    rest = [p for p in model.parameters() if p.requires_grad and id(p) not in ids]
    if not rest and not mixing:
        raise ValueError("the model has no trainable parameters")
    groups = []
    if rest:
        groups.append({"params": rest, "lr": lr, "weight_decay": weight_decay, "name": "model"})
    if mixing:
        groups.append({"params": mixing, "lr": lr if mixing_lr is None else mixing_lr, "weight_decay": 0.0, "name": "mhla_mixing"})
    return torch.optim.AdamW(groups, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)


def disable_internal_label_dropout(transformer: torch.nn.Module) -> list[tuple[torch.nn.Module, float]]:
    """Turn off diffusers' own label dropout inside DiT (each block draws its own, from the global RNG).

    :func:`diffusion_loss` drops labels itself, once per sample, from a seeded generator. Returns
    ``[(module, old_prob)]`` so the caller can restore them (the probability is not in the config
    or the state dict, so saving is unaffected either way).
    """
    from diffusers.models.embeddings import LabelEmbedding

    changed = []
    for module in transformer.modules():
        if isinstance(module, LabelEmbedding) and module.dropout_prob > 0:
            changed.append((module, module.dropout_prob))
            module.dropout_prob = 0.0
    return changed


def diffusion_loss(
    transformer: torch.nn.Module,
    vae: torch.nn.Module,
    noise_scheduler,
    batch: Mapping[str, torch.Tensor],
    *,
    generator: torch.Generator | None = None,
    class_dropout: float = 0.1,
    null_class: int = 1000,
) -> torch.Tensor:
    """DDPM epsilon-prediction loss of one batch: ``mean ||eps - eps_theta(x_t, t, y)||^2``.

    ``x_0 = vae.encode(pixels).latent_dist.sample() * scaling_factor``; ``t ~ U{0..T-1}``;
    ``x_t = noise_scheduler.add_noise(x_0, eps, t)``; with probability ``class_dropout`` a label is
    replaced by ``null_class`` (classifier-free guidance, as DiT trains). For a transformer with
    learned sigma (``out_channels == 2 * in_channels``) only the epsilon half is trained.

    Args:
        transformer: ``DiTTransformer2DModel`` (possibly wrapped by accelerate / DDP).
        vae: any diffusers-style autoencoder (frozen; encoded without grad).
        noise_scheduler: a ``DDPMScheduler`` (``add_noise``, ``config.num_train_timesteps``).
        batch: ``pixel_values`` float ``[B, 3, H, W]`` in ``[-1, 1]``, ``class_labels`` long ``[B]``;
            on the training device.
        generator: draws ``t``, ``eps`` and the dropout (on the batch's device); ``None``: global RNG.
        class_dropout: probability of dropping a label.
        null_class: the unconditional label (``num_embeds_ada_norm``; 1000 for DiT).

    Returns:
        Scalar fp32 loss.
    """
    pixels = batch["pixel_values"]
    labels = batch["class_labels"]
    device = pixels.device
    with torch.no_grad():
        latents = vae.encode(pixels.to(vae.dtype)).latent_dist.sample() * vae.config.scaling_factor
    latents = latents.float()
    b = latents.shape[0]
    noise = torch.randn(latents.shape, generator=generator, device=device, dtype=latents.dtype)
    t = torch.randint(0, noise_scheduler.config.num_train_timesteps, (b,), generator=generator, device=device)
    drop = torch.rand(b, generator=generator, device=device) < class_dropout
    labels = torch.where(drop, torch.full_like(labels, null_class), labels)
    noisy = noise_scheduler.add_noise(latents, noise, t)
    pred = transformer(noisy, timestep=t, class_labels=labels).sample
    channels = latents.shape[1]
    if pred.shape[1] == 2 * channels:
        pred = pred[:, :channels]
    return F.mse_loss(pred.float(), noise, reduction="mean")


@torch.no_grad()
def evaluate_loss(
    transformer: torch.nn.Module,
    vae: torch.nn.Module,
    noise_scheduler,
    dataset,
    *,
    num_samples: int = 160,
    batch_size: int = 16,
    seed: int = 12345,
) -> float:
    """Held-out epsilon MSE on a fixed set: the same number for every model given the same arguments.

    Item ``i`` of ``dataset`` (its current epoch; ``i`` wraps around ``len(dataset)``) is noised at
    timestep ``round(i * (T - 1) / (num_samples - 1))`` (evenly spaced over ``[0, T - 1]``) with
    noise drawn from ``torch.Generator().manual_seed(seed)`` on the CPU; labels are kept (no
    dropout). The model runs in eval mode (restored after).

    Returns:
        Mean squared error per element, a Python float.

    Raises:
        ValueError: ``num_samples < 1`` or an empty dataset.
    """
    if num_samples < 1 or len(dataset) == 0:
        raise ValueError(f"need num_samples >= 1 and a non-empty dataset; got {num_samples}, {len(dataset)} items")
    was_training = transformer.training
    transformer.eval()
    device = next(transformer.parameters()).device
    g = torch.Generator().manual_seed(int(seed))
    T = noise_scheduler.config.num_train_timesteps
    total, count = 0.0, 0
    try:
        for start in range(0, num_samples, batch_size):
            idx = list(range(start, min(start + batch_size, num_samples)))
            items = [dataset[i % len(dataset)] for i in idx]
            pixels = torch.stack([it["pixel_values"] for it in items]).to(device)
            labels = torch.stack([it["class_labels"] for it in items]).to(device)
            latents = vae.encode(pixels.to(vae.dtype)).latent_dist.sample().float() * vae.config.scaling_factor
            noise = torch.randn(latents.shape, generator=g).to(device)
            t = torch.tensor([round(i * (T - 1) / max(num_samples - 1, 1)) for i in idx], device=device)
            pred = transformer(noise_scheduler.add_noise(latents, noise, t), timestep=t, class_labels=labels).sample
            pred = pred[:, : latents.shape[1]].float()
            total += F.mse_loss(pred, noise, reduction="sum").item()
            count += noise.numel()
    finally:
        transformer.train(was_training)
    return total / count


# -- logs and plots --------------------------------------------------------------------------------
def _atomic_write_bytes(path: str | os.PathLike, data: bytes) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def write_loss_csv(path: str | os.PathLike, rows: Sequence[tuple[int, float, float]]) -> None:
    """Write ``step,loss,lr`` rows (atomic). ``step`` counts optimizer steps from 1."""
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    w.writerow(["step", "loss", "lr"])
    for step, loss, lr in rows:
        w.writerow([int(step), f"{float(loss):.6g}", f"{float(lr):.6g}"])
    _atomic_write_bytes(path, buf.getvalue().encode())


def read_loss_csv(path: str | os.PathLike) -> list[tuple[int, float, float]]:
    """Rows ``(step, loss, lr)`` of a loss CSV written by :func:`write_loss_csv`.

    Raises:
        FileNotFoundError: no such file. ValueError: not a loss CSV.
    """
    with open(path, newline="") as f:
        reader = csv.DictReader(f)
        if reader.fieldnames is None or not {"step", "loss", "lr"} <= set(reader.fieldnames):
            raise ValueError(f"{path} is not a loss CSV (expected columns step, loss, lr)")
        return [(int(r["step"]), float(r["loss"]), float(r["lr"])) for r in reader]


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
) -> None:
    """Plot loss-vs-step curves (one per name) to a PNG (matplotlib Agg backend; atomic write).

    Args:
        curves: ``{label: (steps, losses)}``.
        path: the ``.png`` to write.
        smooth: moving-average window in steps (default: about 1/20 of the longest curve, >= 1);
            the raw curve is drawn faintly behind the smoothed one.
        log_y: logarithmic loss axis.

    Raises:
        ValueError: no curves, or a curve whose step and loss lists differ in length.
    """
    import matplotlib

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
    ax.set_ylabel("epsilon MSE" + (" (log)" if log_y else ""))
    if log_y:
        ax.set_yscale("log")
    ax.set_title(title + (f" (moving average over {window} steps)" if window > 1 else ""), fontsize=10)
    ax.grid(True, alpha=0.3, which="both")
    ax.legend(fontsize=8)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    _atomic_write_bytes(path, buf.getvalue())


def _atomic_write_json(path: str | os.PathLike, obj: Any) -> None:
    _atomic_write_bytes(path, (json.dumps(obj, indent=2, sort_keys=True) + "\n").encode())


# -- export ----------------------------------------------------------------------------------------
def export_pipeline(
    transformer: torch.nn.Module,
    vae: torch.nn.Module,
    noise_scheduler,
    out_dir: str | os.PathLike,
    *,
    sampler: str = "dpm",
    id2label: Mapping[int, str] | None = None,
    overwrite: bool = True,
) -> Path:
    """Write a complete ``DiTPipeline`` folder (atomic, via :func:`mhla_diffusers.save_mhla_pipeline`).

    The sampling scheduler is built from the training ``noise_scheduler``'s config:
    ``DPMSolverMultistepScheduler`` (``sampler="dpm"``), ``DDIMScheduler`` (``"ddim"``) or the
    ``DDPMScheduler`` itself. ``id2label`` is stored in ``model_index.json``, from where
    ``DiTPipeline.from_pretrained`` restores ``pipe.labels``. A transformer with MHLA is written as
    a converted checkpoint (base weights + ``mhla_config.json`` + ``mhla.safetensors``).

    Raises:
        ValueError: unknown ``sampler``. FileExistsError: ``out_dir`` not empty and not ``overwrite``.
    """
    from diffusers import DDIMScheduler, DDPMScheduler, DiTPipeline, DPMSolverMultistepScheduler

    from .checkpoint import save_mhla_pipeline

    classes = {"dpm": DPMSolverMultistepScheduler, "ddim": DDIMScheduler, "ddpm": DDPMScheduler}
    if sampler not in classes:
        raise ValueError(f"sampler must be one of {sorted(classes)}; got {sampler!r}")
    scheduler = classes[sampler].from_config(noise_scheduler.config)
    labels = {int(k): str(v) for k, v in id2label.items()} if id2label else None
    pipe = DiTPipeline(transformer=transformer, vae=vae, scheduler=scheduler, id2label=labels)
    if labels:
        pipe.register_to_config(id2label={str(k): v for k, v in sorted(labels.items())})
    return save_mhla_pipeline(pipe, out_dir, overwrite=overwrite)


# -- the training loop -----------------------------------------------------------------------------
def _step_seed(seed: int, step: int, micro: int, rank: int) -> int:
    return (seed * 1_000_003 + step * 7_919 + micro * 104_729 + rank * 15_485_863 + 1) % (1 << 63)


def _complete_checkpoints(ckpt_root: Path) -> list[tuple[int, Path]]:
    """``[(step, folder)]`` of checkpoints whose ``train_state.json`` was written (i.e. complete), by step."""
    found = []
    if ckpt_root.is_dir():
        for folder in ckpt_root.iterdir():
            state = folder / TRAIN_STATE
            if folder.is_dir() and folder.name.startswith("checkpoint_") and state.is_file():
                try:
                    found.append((int(json.loads(state.read_text())["step"]), folder))
                except (ValueError, KeyError, json.JSONDecodeError):
                    continue
    return sorted(found)


def train(config: dict) -> dict[str, Any]:
    """Train / fine-tune a DiT as ``config`` says (see :data:`DEFAULT_CONFIG`); run it under accelerate.

    Writes into ``output_dir``: ``config.yaml`` (the resolved config), ``loss.csv`` (step, loss, lr),
    ``loss.png``, ``checkpoints/checkpoint_<i>/`` (accelerate states, every
    ``train.checkpointing_steps``), ``final/`` (the final ``DiTPipeline``; or ``export.dir``) and
    ``train_summary.json``. With ``train.resume`` it continues from the latest complete checkpoint
    (same data order, noise and final weights as an uninterrupted run on the same hardware).

    Returns:
        The summary dict (also written to ``train_summary.json``): ``final_dir``, ``steps``,
        ``final_loss`` (mean of the last ``log_every`` steps), ``wall_time_s``, ``step_time_s``
        (mean wall seconds per optimizer step in this run), ``step_cpu_time_s`` (CPU seconds of this
        process per step), ``num_parameters``, ``mhla``, ``mhla_layers``, ``mixing_range``,
        ``eval_loss_start`` / ``eval_loss`` (held-out epsilon MSE before / after, see
        :func:`evaluate_loss`; ``None`` unless ``eval.samples > 0``).

    Raises:
        ValueError: invalid config (see :func:`load_config`), a dataset smaller than one batch,
            ``resume`` without a complete checkpoint, a non-finite loss.
    """
    from accelerate import Accelerator
    from accelerate.utils import ProjectConfiguration, set_seed
    from diffusers.optimization import get_scheduler
    from torch.utils.data import DataLoader, DistributedSampler
    from tqdm.auto import tqdm

    from .apply import is_mhla_model
    from .mixing import clamp_mixing_, mixing_parameters

    validate_config(config)
    t_cfg, d_cfg = config["train"], config["data"]
    out = Path(config["output_dir"])
    accelerator = Accelerator(
        mixed_precision=t_cfg["mixed_precision"],
        gradient_accumulation_steps=t_cfg["gradient_accumulation_steps"],
        project_config=ProjectConfiguration(
            project_dir=str(out),
            automatic_checkpoint_naming=True,
            total_limit=t_cfg["checkpoints_total_limit"],
        ),
    )
    if accelerator.is_main_process:
        out.mkdir(parents=True, exist_ok=True)
        _atomic_write_bytes(out / "config.yaml", yaml.safe_dump(config, sort_keys=False).encode())
    set_seed(int(t_cfg["seed"]))  # model init (from scratch) and anything else seeded globally

    # Models, data, optimizer.
    parts = build_models(config)
    transformer, vae, noise_scheduler = parts["transformer"], parts["vae"], parts["noise_scheduler"]
    if t_cfg["gradient_checkpointing"]:
        transformer.enable_gradient_checkpointing()
    if config["mhla"] is not None and not parts["mhla_applied"]:
        accelerator.print("the pretrained checkpoint already has MHLA: the mhla section is not applied again")
    label_dropout_backup = disable_internal_label_dropout(transformer)
    null_class = int(transformer.config.num_embeds_ada_norm)
    vae.to(accelerator.device)
    check_resolution(transformer, vae, int(d_cfg["resolution"]))
    dataset = build_dataset(d_cfg)
    id2label = dataset.id2label  # the training data defines the classes
    if len(id2label) > null_class:
        raise ValueError(f"{len(id2label)} classes but the model has {null_class} (num_embeds_ada_norm)")
    sampler = DistributedSampler(
        dataset, num_replicas=accelerator.num_processes, rank=accelerator.process_index,
        shuffle=True, seed=int(d_cfg["seed"]), drop_last=True,
    )
    batch_size = int(d_cfg["batch_size"])
    accum = int(t_cfg["gradient_accumulation_steps"])
    # An epoch = a whole number of optimizer steps (drop the remainder): keeps resume arithmetic exact.
    steps_per_epoch = len(sampler) // (batch_size * accum)
    if steps_per_epoch < 1:
        raise ValueError(
            f"the dataset has {len(dataset)} crops, fewer than one optimizer step of {batch_size} x {accum} "
            f"(batch_size x gradient_accumulation_steps) per process: raise data.crops_per_image or lower data.batch_size"
        )
    optimizer = build_optimizer(
        transformer, float(t_cfg["lr"]), mixing_lr=t_cfg["mixing_lr"],
        weight_decay=float(t_cfg["weight_decay"]), betas=(float(t_cfg["adam_beta1"]), float(t_cfg["adam_beta2"])),
        eps=float(t_cfg["adam_eps"]),
    )
    max_steps = int(t_cfg["max_steps"])
    # accelerate steps a prepared lr scheduler once per process per optimizer step.
    lr_scheduler = get_scheduler(
        t_cfg["lr_scheduler"], optimizer=optimizer,
        num_warmup_steps=int(t_cfg["warmup_steps"]) * accelerator.num_processes,
        num_training_steps=max_steps * accelerator.num_processes,
    )
    transformer, optimizer, lr_scheduler = accelerator.prepare(transformer, optimizer, lr_scheduler)

    # Resume.
    step, rows = 0, []
    ckpt_root = out / "checkpoints"
    if t_cfg["resume"]:
        complete = _complete_checkpoints(ckpt_root)
        if not complete:
            raise ValueError(f"train.resume is set but {ckpt_root} holds no complete checkpoint; run without --resume")
        step, folder = complete[-1]
        accelerator.load_state(str(folder))
        accelerator.project_configuration.iteration = int(folder.name.split("_")[-1]) + 1
        if (out / LOSS_CSV).is_file():
            rows = [r for r in read_loss_csv(out / LOSS_CSV) if r[0] <= step]
        accelerator.print(f"resumed from {folder} at step {step}")
    elif _complete_checkpoints(ckpt_root):
        raise ValueError(f"{ckpt_root} already holds checkpoints: pass --resume to continue, or use a new output_dir")

    # Held-out loss before training (for a converted checkpoint: the cost of the conversion).
    e_cfg = config["eval"]
    eval_set = None
    if int(e_cfg["samples"]) > 0:
        eval_set = build_dataset({**d_cfg, "seed": int(e_cfg["seed"])})
    eval_kwargs = dict(num_samples=int(e_cfg["samples"]), batch_size=int(e_cfg["batch_size"]), seed=int(e_cfg["seed"]))
    eval_start = None
    if eval_set is not None and accelerator.is_main_process and step == 0:
        eval_start = evaluate_loss(accelerator.unwrap_model(transformer), vae, noise_scheduler, eval_set, **eval_kwargs)
        accelerator.print(f"held-out loss before training: {eval_start:.5f}")

    # The loop.
    num_params = sum(p.numel() for p in accelerator.unwrap_model(transformer).parameters())
    progress = tqdm(total=max_steps, initial=step, desc="train", disable=not accelerator.is_local_main_process, dynamic_ncols=True)
    log_every = int(t_cfg["log_every"])
    grad_clip = t_cfg["grad_clip"]
    class_dropout = float(t_cfg["class_dropout"])
    seed = int(t_cfg["seed"])
    t_start, cpu_start = time.perf_counter(), time.process_time()
    steps_this_run = 0
    transformer.train()
    while step < max_steps:
        epoch, offset = divmod(step, steps_per_epoch)  # resume mid-epoch: skip the steps already taken
        dataset.set_epoch(epoch)
        sampler.set_epoch(epoch)
        per_step = batch_size * accum
        indices = list(sampler)[offset * per_step : steps_per_epoch * per_step]
        loader = DataLoader(dataset, batch_size=batch_size, sampler=indices, num_workers=int(d_cfg["num_workers"]), drop_last=True)
        micro, step_losses = 0, []
        for batch in loader:
            batch = {k: v.to(accelerator.device, non_blocking=True) for k, v in batch.items()}
            g = torch.Generator(device=accelerator.device).manual_seed(_step_seed(seed, step, micro, accelerator.process_index))
            with accelerator.accumulate(transformer):
                loss = diffusion_loss(
                    transformer, vae, noise_scheduler, batch,
                    generator=g, class_dropout=class_dropout, null_class=null_class,
                )
                if not torch.isfinite(loss):
                    raise ValueError(f"non-finite loss {loss.item()} at step {step + 1}; lower train.lr or use mixed_precision=no")
                accelerator.backward(loss)
                if accelerator.sync_gradients and grad_clip:
                    accelerator.clip_grad_norm_(transformer.parameters(), grad_clip)
                optimizer.step()
                lr_scheduler.step()
                optimizer.zero_grad(set_to_none=True)
            step_losses.append(loss.detach())
            micro += 1
            if not accelerator.sync_gradients:
                continue
            # One optimizer step done.
            clamp_mixing_(transformer)  # MHLA paper Sec. 3.3: mixing coefficients kept in [0, 1]
            step += 1
            steps_this_run += 1
            mean_loss = accelerator.reduce(torch.stack(step_losses).mean(), reduction="mean").item()
            rows.append((step, mean_loss, lr_scheduler.get_last_lr()[0]))
            micro, step_losses = 0, []
            progress.update(1)
            if step % log_every == 0 or step == max_steps:
                recent = [r[1] for r in rows[-log_every:]]
                progress.set_postfix(loss=f"{sum(recent) / len(recent):.4f}", lr=f"{rows[-1][2]:.2e}")
                if accelerator.is_main_process:
                    write_loss_csv(out / LOSS_CSV, rows)
            ckpt_every = int(t_cfg["checkpointing_steps"])
            if ckpt_every and step % ckpt_every == 0:
                accelerator.wait_for_everyone()
                if accelerator.is_main_process:
                    write_loss_csv(out / LOSS_CSV, rows)
                folder = Path(accelerator.save_state())
                if accelerator.is_main_process:
                    # Written last: marks the checkpoint complete (resume ignores folders without it).
                    _atomic_write_json(folder / TRAIN_STATE, {"step": step, "epoch": epoch})
            if step >= max_steps:
                break
    progress.close()
    wall, cpu = time.perf_counter() - t_start, time.process_time() - cpu_start

    # Export.
    accelerator.wait_for_everyone()
    summary: dict[str, Any] = {}
    if accelerator.is_main_process:
        model = accelerator.unwrap_model(transformer)
        for module, prob in label_dropout_backup:
            module.dropout_prob = prob
        model.eval()
        final_dir = Path(config["export"]["dir"]) if config["export"]["dir"] else out / "final"
        export_pipeline(model, vae, noise_scheduler, final_dir, sampler=config["export"]["sampler"], id2label=id2label)
        write_loss_csv(out / LOSS_CSV, rows)
        if rows:
            try:
                plot_loss_curves({Path(out).name: ([r[0] for r in rows], [r[1] for r in rows])}, out / LOSS_PNG)
            except ImportError:
                accelerator.print(f"matplotlib is not installed: {LOSS_PNG} skipped (pip install matplotlib)")
        recent = [r[1] for r in rows[-log_every:]]
        mixing = mixing_parameters(model)
        eval_end = evaluate_loss(model, vae, noise_scheduler, eval_set, **eval_kwargs) if eval_set is not None else None
        summary = {
            "final_dir": str(final_dir),
            "steps": step,
            "final_loss": sum(recent) / len(recent) if recent else math.nan,
            "wall_time_s": round(wall, 2),
            "step_time_s": round(wall / steps_this_run, 4) if steps_this_run else None,
            # CPU seconds of this process per step: robust to other processes sharing the cores.
            "step_cpu_time_s": round(cpu / steps_this_run, 4) if steps_this_run else None,
            "num_parameters": num_params,
            "mhla": is_mhla_model(model),
            "mhla_layers": len(mixing),
            "mixing_range": [min(float(p.detach().min()) for p in mixing), max(float(p.detach().max()) for p in mixing)] if mixing else None,
            "batch_size": batch_size * accelerator.num_processes * accum,
            "eval_loss_start": eval_start,  # None when eval.samples = 0 or when resumed
            "eval_loss": eval_end,
        }
        _atomic_write_json(out / SUMMARY, summary)
    accelerator.wait_for_everyone()
    accelerator.end_training()
    return summary
