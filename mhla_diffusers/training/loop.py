"""The training loop, :func:`train`, under accelerate; after every optimizer step
:func:`mhla_diffusers.clamp_mixing_` keeps the mixing matrices in ``[0, 1]`` (MHLA paper, Sec. 3.3).

Outputs, resuming and the summary: ``docs/training.md``, "The loop".
"""

from __future__ import annotations

import json
import math
import os
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

import torch
import yaml
from accelerate import Accelerator
from accelerate.state import AcceleratorState, GradientState
from accelerate.utils import DistributedDataParallelKwargs, DistributedType, ProjectConfiguration, set_seed
from diffusers.optimization import get_scheduler
from diffusers.training_utils import EMAModel
from torch.utils.data import DataLoader, DistributedSampler
from tqdm.auto import tqdm

from mhla_diffusers.checkpoint.io import atomic_write_json, atomic_write_text
from mhla_diffusers.models.installer import is_mhla_model

# clamp_mixing_ is looked up in the module at each step (tests patch it there)
from mhla_diffusers.ops import mixing as mixing_ops
from mhla_diffusers.ops.mixing import mixing_parameters
from mhla_diffusers.training.config import validate_config
from mhla_diffusers.training.context import DataLayout, context_loss_scale, data_layout, enable_training_context
from mhla_diffusers.training.datasets import heldout_data, training_data
from mhla_diffusers.training.distill import AttentionRecorder, transfer_modules
from mhla_diffusers.training.evaluation import evaluate_heldout
from mhla_diffusers.training.export import export_model
from mhla_diffusers.training.fsdp import check_fsdp_setup, set_fsdp_wrap
from mhla_diffusers.training.logs import LOSS_CSV, LOSS_PNG, plot_loss_curves, read_loss_terms, read_rows, write_loss_csv
from mhla_diffusers.training.losses import training_loss
from mhla_diffusers.training.optim import build_optimizer, clip_step_gradients, gradient_groups, prepare_parameter_dtypes
from mhla_diffusers.training.processes import end_trackers
from mhla_diffusers.training.recipes import TrainingParts, build_models
from mhla_diffusers.training.resume import (
    SUMMARY,
    TRAIN_STATE,
    apply_optimizer_settings,
    check_resume,
    check_resume_config,
    check_resume_layout,
    find_checkpoints,
    load_ema,
    save_ema,
)

__all__ = ["train"]


# -- the training loop -----------------------------------------------------------------------------
def _step_seed(seed: int, step: int, micro: int, rank: int = 0) -> int:
    return (seed * 1_000_003 + step * 7_919 + micro * 104_729 + rank * 15_485_863 + 1) % (1 << 63)


def _flat_config(config: Mapping, prefix: str = "") -> dict[str, Any]:
    out = {}
    for k, v in config.items():
        key = f"{prefix}{k}"
        if isinstance(v, Mapping):
            out.update(_flat_config(v, key + "/"))
        else:
            out[key] = v if isinstance(v, (int, float, str, bool)) else str(v)
    return out


def train(config: dict) -> dict[str, Any]:
    """Train / fine-tune as ``config`` says (:data:`DEFAULT_CONFIG`), under accelerate; the run's summary.

    Writes ``config.yaml``, ``loss.csv``, ``loss.png``, ``checkpoints/``, the final pipeline and
    ``train_summary.json`` into ``output_dir`` (``docs/training.md``, "The loop"). Every process returns the
    summary the main process wrote. The launch's process group stays up for a next call: a script ends with
    :func:`~mhla_diffusers.training.processes.end_processes`.

    Raises:
        ValueError: invalid config, an FSDP launch that would not shard, a dataset smaller than one
            batch, a resume that does not fit the output folder, changes a setting that shapes the
            trained parameters or the number of processes / data-parallel ranks (raised before anything
            is written), a non-finite loss.
    """
    validate_config(config)
    t_cfg = config["train"]
    run = _Run(config=config, accelerator=_accelerator(t_cfg, Path(config["output_dir"])))
    accelerator, out = run.accelerator, run.out
    run.layout = data_layout(config["parallel"]["context"], accelerator.process_index, accelerator.num_processes)
    # Resume (or refuse to start over a run that has checkpoints, or to go back behind a later step):
    # checked before anything is written or loaded.
    complete, incomplete = find_checkpoints(out / "checkpoints")
    finished = check_resume(out, run.final_dir, bool(t_cfg["resume"]), complete, run.max_steps)
    if finished is not None:
        accelerator.print(
            f"{out} holds a finished run: step {finished['steps']} = train.max_steps, final model in {run.final_dir}; "
            "nothing to resume (raise train.max_steps to train further)"
        )
        return finished  # every process read it
    # A resume with settings that shape the trained parameters changed is refused here, by name.
    changes = check_resume_config(out, complete[-1][1], config) if t_cfg["resume"] else {}
    if t_cfg["resume"]:
        check_resume_layout(complete[-1][1], accelerator.num_processes, run.layout.data_world)
    if accelerator.is_main_process:
        out.mkdir(parents=True, exist_ok=True)
    set_seed(int(t_cfg["seed"]))  # model init (from scratch) and anything else seeded globally

    _build_parts(run)
    _build_data(run)
    _build_optimization(run)
    _remove_incomplete(run, incomplete)
    if t_cfg["resume"]:
        _resume(run, complete[-1], changes)
    if accelerator.is_main_process:  # the settings this run trains with (after a resume: the applied ones)
        atomic_write_text(out / "config.yaml", yaml.safe_dump(config, sort_keys=False))
    if t_cfg["report_to"]:
        accelerator.init_trackers("mhla_finetune", config=_flat_config(config))
    _evaluate_start(run)  # held-out losses before training (for a converted checkpoint: the cost of the conversion)
    _run_steps(run, _loss_options(run))
    return _finish(run)


@dataclass
class _Run:

    config: dict
    accelerator: Accelerator
    layout: DataLayout | None = None  # data ranks x context ranks (parallel.context)
    parts: TrainingParts | None = None
    frozen_fp32: dict = field(default_factory=dict)  # processes that evaluate: the frozen weights at full precision
    restore: list = field(default_factory=list)  # [(module, attribute, value)] to put back before export
    dataset: Any = None
    sampler: Any = None
    steps_per_epoch: int = 0
    model: Any = None  # the transformer as accelerate prepared it
    optimizer: Any = None
    lr_scheduler: Any = None
    trainable_params: list = field(default_factory=list)
    clip_groups: dict = field(default_factory=dict)
    per_group_clip: bool = True
    ema: EMAModel | None = None
    eval_set: Any = None
    eval_start: dict = field(default_factory=dict)
    step: int = 0
    rows: list = field(default_factory=list)  # loss.csv rows: (step, loss, lr, terms, grad norms)
    steps_this_run: int = 0
    num_parameters: int = 0  # counted before the export (which merges LoRA adapters into the weights)
    wall_s: float = 0.0
    cpu_s: float = 0.0

    @property
    def out(self) -> Path:
        return Path(self.config["output_dir"])

    @property
    def final_dir(self) -> Path:
        return Path(self.config["export"]["dir"]) if self.config["export"]["dir"] else self.out / "final"

    @property
    def max_steps(self) -> int:
        return int(self.config["train"]["max_steps"])

    @property
    def batch_size(self) -> int:
        return int(self.config["data"]["batch_size"])

    @property
    def accum(self) -> int:
        return int(self.config["train"]["gradient_accumulation_steps"])

    @property
    def fsdp(self) -> bool:
        """Whether parameters are FSDP2-sharded (the main process alone cannot evaluate or export them)."""
        return self.accelerator.distributed_type == DistributedType.FSDP

    @property
    def context(self) -> bool:
        """Whether the transformer runs under context parallelism (its forward is a collective of a context group)."""
        return self.layout.context_degree > 1

    @property
    def evaluates(self) -> bool:
        """Whether this process evaluates the trained model: the main one; under context parallelism with DDP every one
        (the transformer's forward takes its whole context group). Under FSDP the main process evaluates a fresh,
        unsharded copy, without context parallelism."""
        return self.accelerator.is_main_process or (self.context and not self.fsdp)

    @property
    def eval_kwargs(self) -> dict:
        ev = self.config["eval"]
        return dict(num_samples=int(ev["samples"]), batch_size=int(ev["batch_size"]), seed=int(ev["seed"]), teacher=self.parts.teacher)


def _accelerator(t_cfg: Mapping, out: Path) -> Accelerator:
    """A fresh ``Accelerator``; ``RuntimeError`` if it misses launched processes, ``ValueError`` for a bad FSDP launch."""
    world = int(os.environ.get("WORLD_SIZE", "1") or 1)
    # Several train() calls in one process (the demo, tests) may differ in mixed precision or
    # accumulation: forget the previous call's accelerate settings (the process group is kept).
    AcceleratorState._reset_state()
    GradientState._reset_state()
    accelerator = Accelerator(
        # Several processes without CUDA: data-parallel over gloo on the CPU (accelerate's MULTI_CPU);
        # without cpu=True accelerate would start each process as an independent single-process run.
        cpu=world > 1 and not torch.cuda.is_available(),
        mixed_precision=t_cfg["mixed_precision"],
        gradient_accumulation_steps=t_cfg["gradient_accumulation_steps"],
        log_with=t_cfg["report_to"],
        project_config=ProjectConfiguration(
            project_dir=str(out),
            logging_dir=str(out / "logs"),
            automatic_checkpoint_naming=True,
            total_limit=t_cfg["checkpoints_total_limit"],
        ),
        kwargs_handlers=[DistributedDataParallelKwargs(find_unused_parameters=bool(t_cfg["find_unused_parameters"]))],
    )
    if accelerator.num_processes != world:
        raise RuntimeError(
            f"{world} processes were launched but accelerate set up {accelerator.num_processes}: they would train "
            "independently over the same output_dir. Check the accelerate config (finetune/accelerate/*.yaml)"
        )
    check_fsdp_setup(accelerator)  # an FSDP config that would run as DDP / one process / FSDP1: refused
    return accelerator


def _build_parts(run: _Run) -> None:
    """The models on the device: frozen weights in the mixed-precision dtype, trainable ones in fp32."""
    config, accelerator = run.config, run.accelerator
    t_cfg = config["train"]
    run.parts = parts = build_models(config)
    transformer = parts.transformer
    if config["mhla"] is not None and not parts.mhla_applied:
        accelerator.print("the pretrained checkpoint already has MHLA: the mhla section is not applied again")
    weight_dtype = {"no": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}[t_cfg["mixed_precision"]]
    if weight_dtype == torch.float16 and accelerator.device.type == "cpu":
        # accelerate runs fp16 "mixed precision" on the CPU without autocast and without a GradScaler:
        # fp16 weights would meet fp32 activations. Keep fp32 there (bf16 autocast does work on the CPU).
        accelerator.print("mixed_precision=fp16 has no autocast on the CPU: weights stay fp32 (use bf16 on the CPU)")
        weight_dtype = torch.float32
    if t_cfg["gradient_checkpointing"]:
        transformer.enable_gradient_checkpointing()
    # Frozen weights are about to be cast down: the processes that evaluate (run.evaluates) keep their fp32 values (CPU) so that
    # the export (LoRA merged into them) is written at full precision, not from the bf16 / fp16 copies.
    if weight_dtype != torch.float32 and run.evaluates:
        run.frozen_fp32 = {n: p.detach().to("cpu", copy=True) for n, p in transformer.named_parameters() if not p.requires_grad}
    prepare_parameter_dtypes(transformer, weight_dtype)  # frozen -> weight_dtype, trainable -> fp32 (GradScaler)
    frozen = [parts.teacher, getattr(parts.pipeline, "text_encoder", None)]
    for module in [m for m in frozen if m is not None]:  # teacher, text encoder: in the weight dtype
        module.to(accelerator.device)
        if weight_dtype != torch.float32:
            prepare_parameter_dtypes(module, weight_dtype)
    parts.vae.to(accelerator.device)  # the autoencoder stays fp32 (as diffusers' SANA / SD3 recipes keep it)
    enable_training_context(transformer, run.layout, accelerator.device)  # parallel.context: before prepare


def _build_data(run: _Run) -> None:
    """The dataset (:func:`training_data`), the sampler; ``ValueError`` if under one step."""
    dataset, run.restore = training_data(run.parts, run.config, run.accelerator)
    run.dataset = dataset
    run.sampler = DistributedSampler(
        dataset, num_replicas=run.layout.data_world, rank=run.layout.data_rank,  # a context group: the same samples
        shuffle=True, seed=int(run.config["data"]["seed"]), drop_last=True,
    )
    # An epoch = a whole number of optimizer steps (drop the remainder): keeps resume arithmetic exact.
    run.steps_per_epoch = len(run.sampler) // (run.batch_size * run.accum)
    if run.steps_per_epoch < 1:
        raise ValueError(
            f"the dataset has {len(dataset)} crops, fewer than one optimizer step of {run.batch_size} x {run.accum} "
            f"(batch_size x gradient_accumulation_steps) per data-parallel rank: raise data.crops_per_image or lower data.batch_size"
        )


def _build_optimization(run: _Run) -> None:
    """Optimizer, lr schedule and model prepared by accelerate, clipping groups, EMA (``ValueError`` with FSDP)."""
    config, accelerator, transformer = run.config, run.accelerator, run.parts.transformer
    t_cfg, e_cfg = config["train"], config["ema"]
    optimizer = build_optimizer(
        transformer, float(t_cfg["lr"]), mixing_lr=t_cfg["mixing_lr"],
        weight_decay=float(t_cfg["weight_decay"]), betas=(float(t_cfg["adam_beta1"]), float(t_cfg["adam_beta2"])),
        eps=float(t_cfg["adam_eps"]),
    )
    run.trainable_params = [p for p in transformer.parameters() if p.requires_grad]
    # accelerate steps a prepared lr scheduler once per process per optimizer step.
    lr_scheduler = get_scheduler(
        t_cfg["lr_scheduler"], optimizer=optimizer,
        num_warmup_steps=int(t_cfg["warmup_steps"]) * accelerator.num_processes,
        num_training_steps=run.max_steps * accelerator.num_processes,
    )
    wrap = set_fsdp_wrap(accelerator, transformer)  # FSDP: one unit per transformer block unless the config names one
    if wrap:
        accelerator.print(wrap)
    run.model, run.optimizer, run.lr_scheduler = accelerator.prepare(transformer, optimizer, lr_scheduler)
    run.num_parameters = sum(p.numel() for p in transformer.parameters())
    # Clipped and logged one by one (clip_grad_norms_). Taken after prepare: FSDP replaces the parameters
    # by sharded ones (DTensors), and the groups must hold the parameters that receive the gradients.
    run.clip_groups = gradient_groups(accelerator.unwrap_model(run.model))
    # Per group everywhere (FSDP2 included: the norms of the gradient shards are reduced across processes),
    # except where DeepSpeed / XLA manage the gradients: there the global norm is clipped (logged as "all").
    run.per_group_clip = accelerator.distributed_type not in (DistributedType.DEEPSPEED, DistributedType.XLA)
    if run.fsdp and e_cfg["enabled"]:
        raise ValueError("ema.enabled with FSDP is not supported (the EMA would track parameter shards): use DDP or set ema.enabled=false")
    if e_cfg["enabled"]:
        run.ema = EMAModel(run.trainable_params, decay=float(e_cfg["decay"]), update_after_step=int(e_cfg["update_after_step"]),
                           use_ema_warmup=bool(e_cfg["use_warmup"]))
        run.ema.to(accelerator.device)


def _remove_incomplete(run: _Run, incomplete: list[Path]) -> None:
    run.accelerator.wait_for_everyone()
    if incomplete and run.accelerator.is_main_process:
        for folder in incomplete:
            shutil.rmtree(folder, ignore_errors=True)
    run.accelerator.wait_for_everyone()


def _resume(run: _Run, latest: tuple[int, Path], changes: Mapping[str, tuple[Any, Any]]) -> None:
    """Load the latest complete checkpoint with this config's optimizer settings; ``ValueError`` if it does not fit."""
    accelerator = run.accelerator
    step, folder = latest
    fresh = [{k: v for k, v in g.items() if k != "params"} for g in run.optimizer.param_groups]
    try:
        accelerator.load_state(str(folder))
    except (RuntimeError, ValueError, KeyError) as err:
        changed = "; ".join(f"{k}: {a!r} -> {b!r}" for k, (a, b) in changes.items())
        raise ValueError(
            f"checkpoint {folder} does not fit the model built from this config ({type(err).__name__}: "
            f"{' '.join(str(err).split())[:300]}). The settings that shape the trained parameters (model, mhla, "
            f"train.trainable, train.train_mixing, lora) must be the run's own; "
            + (f"changed since the checkpoint: {changed}" if changed else "the checkpoint records no config to compare with")
            + ". Set them back to resume, or train into a new output_dir."
        ) from err
    applied = apply_optimizer_settings(run.optimizer, run.lr_scheduler, fresh)
    if run.ema is not None:
        load_ema(run.ema, folder)
    accelerator.project_configuration.iteration = int(folder.name.split("_")[-1]) + 1
    run.step = step
    if (run.out / LOSS_CSV).is_file():
        run.rows = [r for r in read_rows(run.out / LOSS_CSV) if r[0] <= step]
    if step == run.max_steps:  # e.g. a run killed while exporting: only the evaluation and export are left
        accelerator.print(f"resumed from {folder} at step {step} = train.max_steps: nothing left to train, exporting")
    else:
        accelerator.print(f"resumed from {folder} at step {step}")
    if changes:
        accelerator.print("settings changed since the checkpoint, in effect from here: "
                          + "; ".join(f"{k}: {a!r} -> {b!r}" for k, (a, b) in changes.items()))
    if applied:
        accelerator.print("the optimizer takes this config's settings, not the checkpoint's: " + "; ".join(applied))


def _evaluate_start(run: _Run) -> None:
    """Build the held-out set and, on a fresh run, its losses before training."""
    config, accelerator = run.config, run.accelerator
    ev_cfg = config["eval"]
    if int(ev_cfg["samples"]) <= 0:
        return
    run.eval_set = heldout_data(run.parts, config, accelerator)
    if run.evaluates and run.step == 0 and not run.fsdp:
        with accelerator.autocast():
            run.eval_start = evaluate_heldout(run.parts, accelerator.unwrap_model(run.model), run.eval_set, **run.eval_kwargs)
        accelerator.print(f"held-out loss before training: {run.eval_start['loss']:.5f}")


def _loss_options(run: _Run) -> dict[str, Any]:
    """The fixed keyword arguments of :func:`training_loss` for this run."""
    parts, ds_cfg = run.parts, run.config["distill"]
    options = dict(
        data_weight=float(ds_cfg["data_weight"]) if parts.teacher is not None else 1.0,
        output_weight=float(ds_cfg["output_weight"]), attention_weight=float(ds_cfg["attention_weight"]),
        dropout=parts.recipe.dropout(run.config), condition=ds_cfg["condition"], recorders=None,
        num_classes=len(parts.id2label) if parts.id2label else None,
    )
    if options["attention_weight"] > 0:
        student_modules = transfer_modules(parts.transformer, ds_cfg["layers"])
        options["recorders"] = (AttentionRecorder(student_modules),
                                AttentionRecorder({n: parts.teacher.get_submodule(n) for n in student_modules}))
    if ds_cfg["condition"] == "random" and not options["num_classes"]:
        options["num_classes"] = int(parts.transformer.config.get("num_embeds_ada_norm") or 0) or None
        if options["num_classes"] is None:
            raise ValueError("distill.condition=random needs a class-conditional model")
    return options


def _run_steps(run: _Run, loss_options: Mapping[str, Any]) -> None:
    """Train from ``run.step`` to ``max_steps``, epoch by epoch, timing the steps."""
    accelerator, d_cfg = run.accelerator, run.config["data"]
    if not run.per_group_clip:
        accelerator.print(f"{accelerator.distributed_type}: train.grad_clip clips the global gradient norm, not each parameter group's")
    progress = tqdm(total=run.max_steps, initial=run.step, desc="train", disable=not accelerator.is_local_main_process, dynamic_ncols=True)
    t_start, cpu_start = time.perf_counter(), time.process_time()
    run.model.train()
    per_step = run.batch_size * run.accum
    while run.step < run.max_steps:
        epoch, offset = divmod(run.step, run.steps_per_epoch)  # resume mid-epoch: skip the steps already taken
        if hasattr(run.dataset, "set_epoch"):
            run.dataset.set_epoch(epoch)
        run.sampler.set_epoch(epoch)
        indices = list(run.sampler)[offset * per_step : run.steps_per_epoch * per_step]
        loader = DataLoader(run.dataset, batch_size=run.batch_size, sampler=indices, num_workers=int(d_cfg["num_workers"]), drop_last=True)
        micro, losses, terms = 0, [], []
        for batch in loader:
            loss, step_terms, norms, skip = _micro_step(run, batch, micro, loss_options)
            losses.append(loss)
            terms.append(step_terms)
            micro += 1
            if not accelerator.sync_gradients:
                continue
            _end_step(run, losses, terms, norms, skip, epoch, progress)
            micro, losses, terms = 0, [], []
            if run.step >= run.max_steps:
                break
    progress.close()
    run.wall_s, run.cpu_s = time.perf_counter() - t_start, time.process_time() - cpu_start


def _micro_step(run: _Run, batch: Mapping, micro: int, loss_options: Mapping[str, Any]):
    """One micro-batch's forward and backward (clip and step at an accumulation's end): ``(loss, terms, norms, skipped)``."""
    accelerator, model, optimizer = run.accelerator, run.model, run.optimizer
    batch = {k: v.to(accelerator.device, non_blocking=True) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
    g = torch.Generator(device=accelerator.device).manual_seed(_step_seed(int(run.config["train"]["seed"]), run.step, micro))
    with accelerator.accumulate(model):
        with accelerator.autocast():
            loss, terms = training_loss(run.parts, model, batch, generator=g, rank=run.layout.data_rank,
                                        world_size=run.layout.data_world, **loss_options)
        if not torch.isfinite(loss):
            raise ValueError(f"non-finite loss {loss.item()} at step {run.step + 1}; lower train.lr or use mixed_precision=no")
        accelerator.backward(loss * context_loss_scale(run.layout) if run.context else loss)
        norms, skip = {}, False
        if accelerator.sync_gradients:
            norms = clip_step_gradients(accelerator, model, run.clip_groups, run.config["train"]["grad_clip"], run.per_group_clip)
            # A non-finite gradient is not applied (with fp16, the GradScaler skips the update itself).
            skip = accelerator.scaler is None and not all(math.isfinite(v) for v in norms.values())
        if not skip:
            optimizer.step()
        run.lr_scheduler.step()
        optimizer.zero_grad(set_to_none=True)
    return loss.detach().float(), {k: v.detach().float() for k, v in terms.items()}, norms, skip


def _end_step(run: _Run, losses: list, terms: list, norms: Mapping[str, float], skip: bool, epoch: int, progress) -> None:
    """After an optimizer step (applied or skipped): clamp, EMA, log, ``loss.csv``, checkpoint."""
    accelerator, t_cfg = run.accelerator, run.config["train"]
    skipped = skip or accelerator.optimizer_step_was_skipped
    mixing_ops.clamp_mixing_(run.parts.transformer)  # MHLA paper Sec. 3.3: mixing coefficients kept in [0, 1]
    if run.ema is not None and not skipped:
        run.ema.step(run.trainable_params)
    run.step += 1
    run.steps_this_run += 1
    step = run.step
    if skipped and accelerator.is_main_process:
        bad = ", ".join(k for k, v in norms.items() if not math.isfinite(v)) or "a parameter group"
        tqdm.write(f"step {step} skipped: non-finite gradient norm in {bad}"
                   + (" (the fp16 GradScaler lowers its scale)" if accelerator.scaler is not None else " (the weights keep their values)"))
    names = sorted(terms[0])
    local = torch.stack([torch.stack(losses).mean()] + [torch.stack([t[k] for t in terms]).mean() for k in names])
    reduced = accelerator.reduce(local, reduction="mean").tolist()
    mean_loss, term_values = reduced[0], dict(zip(names, reduced[1:]))
    lr_now = run.lr_scheduler.get_last_lr()[0]
    run.rows.append((step, mean_loss, lr_now, term_values, norms))
    if t_cfg["report_to"]:
        accelerator.log({"loss": mean_loss, "lr": lr_now, **{f"loss_{k}": v for k, v in term_values.items()},
                         **{f"grad_norm/{k}": v for k, v in norms.items()}}, step=step)
    progress.update(1)
    log_every = int(t_cfg["log_every"])
    if step % log_every == 0 or step == run.max_steps:
        recent = [r[1] for r in run.rows[-log_every:]]
        progress.set_postfix(loss=f"{sum(recent) / len(recent):.4f}", lr=f"{run.rows[-1][2]:.2e}")
        if accelerator.is_main_process:
            write_loss_csv(run.out / LOSS_CSV, run.rows)
    ckpt_every = int(t_cfg["checkpointing_steps"])
    if ckpt_every and step % ckpt_every == 0:
        _save_checkpoint(run, epoch)


def _save_checkpoint(run: _Run, epoch: int) -> None:
    """accelerate's state, the EMA, then ``train_state.json`` (last: marks it complete)."""
    accelerator = run.accelerator
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        write_loss_csv(run.out / LOSS_CSV, run.rows)
    folder = Path(accelerator.save_state())
    if accelerator.is_main_process:
        if run.ema is not None:
            save_ema(run.ema, folder)
        # Written last: marks the checkpoint complete (resume ignores folders without it),
        # with the config it was trained with: a resume compares its own against it.
        atomic_write_json(folder / TRAIN_STATE, {"step": run.step, "epoch": epoch, "config": run.config, "processes":
                                                 accelerator.num_processes, "data_world": run.layout.data_world}, sort_keys=True)
    accelerator.wait_for_everyone()


def _finish(run: _Run) -> dict[str, Any]:
    """Evaluate and export the final model; write ``loss.csv``, ``loss.png`` and the summary."""
    accelerator = run.accelerator
    accelerator.wait_for_everyone()
    summary: dict[str, Any] = {}
    full_state = accelerator.get_state_dict(run.model) if run.fsdp else None  # a collective: every process takes part
    eval_end: dict = {}
    if run.evaluates:
        model = _final_model(run, full_state)
        if run.eval_set is not None:
            with accelerator.autocast():
                eval_end = evaluate_heldout(run.parts, model, run.eval_set, **run.eval_kwargs)
    if accelerator.is_main_process:
        export_model(run.parts, model, run.final_dir, sampler=run.config["export"]["sampler"], id2label=run.parts.id2label,
                     lora_export=run.config["lora"]["export"])
        write_loss_csv(run.out / LOSS_CSV, run.rows)
        _plot_losses(run)
        summary = _summary(run, model, eval_end)
        atomic_write_json(run.out / SUMMARY, summary, sort_keys=True)
    # Every process returns the main process's summary (retrofit() starts its next phase from its final_dir), read
    # from the file after a barrier (the output folder is shared, as for checkpoints), not broadcast: gloo's worker
    # thread frees a broadcast's Python tensors after the call returns, and a process that exits meanwhile aborts.
    accelerator.wait_for_everyone()
    if not accelerator.is_main_process:
        summary = json.loads((run.out / SUMMARY).read_text())
    end_trackers(accelerator)
    return summary


def _final_model(run: _Run, full_state: Mapping | None) -> torch.nn.Module:
    """The trained model ready for evaluation and export (unsharded, restored, EMA, full precision)."""
    model = run.accelerator.unwrap_model(run.model)
    restore = run.restore
    if run.fsdp:  # a fresh, unsharded copy of the model carrying the gathered weights
        fresh = build_models({**run.config, "distill": {**run.config["distill"], "teacher": None}})
        model = fresh.transformer
        model.load_state_dict(full_state)
        model.to(run.accelerator.device)
        restore = [(m, attr, v) for m, attr, v in restore if m in set(model.modules())]
    for module, attribute, value in restore:
        setattr(module, attribute, value)
    model.eval()
    if run.ema is not None and run.config["ema"]["export"]:
        run.ema.copy_to(run.trainable_params)
    if run.frozen_fp32:  # the frozen weights back at full precision for evaluation and export
        for name, p in model.named_parameters():
            if name in run.frozen_fp32:
                p.data = run.frozen_fp32[name].to(p.device)
    return model


def _plot_losses(run: _Run) -> None:
    rows = run.rows
    if not rows:
        return
    try:
        curves = {run.out.name: ([r[0] for r in rows], [r[1] for r in rows])}
        if any(len(r[3]) > 1 for r in rows):
            for name, (steps_, values) in read_loss_terms(run.out / LOSS_CSV).items():
                curves[f"{name} term"] = (steps_, values)
        plot_loss_curves(curves, run.out / LOSS_PNG)
    except ImportError:
        run.accelerator.print(f"matplotlib is not installed: {LOSS_PNG} skipped (pip install matplotlib)")


def _summary(run: _Run, model: torch.nn.Module, eval_end: Mapping) -> dict[str, Any]:
    t_cfg, rows, n = run.config["train"], run.rows, run.steps_this_run
    recent = [r[1] for r in rows[-int(t_cfg["log_every"]):]]
    mixing = mixing_parameters(model)
    return {
        "final_dir": str(run.final_dir),
        "steps": run.step,
        "final_loss": sum(recent) / len(recent) if recent else math.nan,
        "wall_time_s": round(run.wall_s, 2),
        "step_time_s": round(run.wall_s / n, 4) if n else None,
        # CPU seconds of this process per step: robust to other processes sharing the cores.
        "step_cpu_time_s": round(run.cpu_s / n, 4) if n else None,
        "num_parameters": run.num_parameters,
        "num_trainable_parameters": sum(p.numel() for p in run.trainable_params),
        "family": run.parts.family,
        "objective": run.parts.objective.kind,
        "trainable": t_cfg["trainable"],
        "mhla": is_mhla_model(model),
        "mhla_layers": len(mixing),
        "mixing_range": [min(float(p.detach().min()) for p in mixing), max(float(p.detach().max()) for p in mixing)] if mixing else None,
        "batch_size": run.batch_size * run.layout.data_world * run.accum,
        "context_degree": run.layout.context_degree,
        # steps whose update was not applied (a non-finite gradient norm; see loss.csv's grad_norm_* columns)
        "skipped_steps": [r[0] for r in rows if len(r) > 4 and any(not math.isfinite(v) for v in r[4].values())],
        "eval_loss_start": run.eval_start.get("loss"),  # None when eval.samples = 0 or when resumed
        "eval_loss": eval_end.get("loss"),
        "eval_distill_start": run.eval_start.get("distill_output"),
        "eval_distill": eval_end.get("distill_output"),
        "teacher_store": getattr(run.dataset, "cost", None),  # data.kind=teacher: what its samples cost the teacher
    }
