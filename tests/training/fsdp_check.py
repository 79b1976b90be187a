"""The trainer under FSDP2 on CPU processes, for tests/training/test_train_fsdp.py.

Run by the test as ``accelerate launch --config_file finetune/accelerate/fsdp.yaml --num_processes 2
tests/training/fsdp_check.py OUT BASE`` (accelerate's launcher reads the shipped config and starts
the processes through torchrun; gloo), and in the test's own process (:func:`run_case`) for the
one-process reference on the concatenated batch.

accelerate sets up FSDP only for GPU processes: on CPU processes it builds MULTI_CPU (DDP) from the
same launch environment. :func:`fsdp_on_cpu` switches the trainer's ``Accelerator``, right after it
is built, to what accelerate builds on GPUs: distributed type FSDP with the
``FullyShardedDataParallelPlugin`` read from the ``FSDP_*`` variables that the launcher set from
``fsdp.yaml``. From there on everything is accelerate's own FSDP2 path (``prepare`` ->
``fsdp2_prepare_model`` -> ``fully_shard`` per unit, the optimizer's parameters swapped for the
shards, ``get_state_dict``) and the trainer's (``train``: step, per-group clipping, the clamp of the
mixing matrices, the export).

:func:`probes` records, on the main process, every parameter's gradient when the trainer clips it
(after backward: the averaged gradient) and every parameter after the clamp that ends each step,
as whole tensors (FSDP shards are gathered), into ``<case dir>/probe.safetensors``; under FSDP also
``<case dir>/fsdp.json`` (the plugin's settings, the FSDP units, each rank's share of the parameters).
"""

from __future__ import annotations

import contextlib
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: the tiny-model helpers

from mhla_diffusers import training
from mhla_diffusers.training import loop

# name -> (family, overrides). Tiny models, 3 steps, clipping and the clamp both active: grad_clip is
# below the gradient norms, and mixing_lr moves mixing entries past 0 in one step.
COMMON = ["train.max_steps=3", "train.log_every=1", "train.lr=1e-3", "train.mixing_lr=0.3", "train.grad_clip=0.02",
          "train.warmup_steps=0", "data.crops_per_image=2"]
CASES = {
    # Wan, MHLA on every layer (the authors' video form: numerator + output norm), full fine-tuning
    "wan_all": ("wan", ["mhla.layers=all"]),
    # Wan hybrid (softmax kept on layer 0), LoRA on every attention projection + the MHLA parameters, merged at export
    "wan_lora": ("wan", ["mhla.layers=hybrid", "train.trainable=lora", "lora.rank=2", "lora.export=merge"]),
    # DiT hybrid (class-conditional, BasicTransformerBlock), full fine-tuning
    "dit_hybrid": ("dit", ["mhla.layers=hybrid", "mhla.num_blocks=4"]),
}


def case_config(name: str, out: str | Path, base: str | Path, batch_size: int, *extra: str) -> dict:
    """The training config of case ``name`` (``batch_size`` per process, then the ``extra`` overrides)
    writing into ``out``; ``base``: the tiny Wan pipeline folder the Wan cases fine-tune."""
    family, overrides = CASES[name]
    if family == "wan":
        model = [f"model.pretrained={base}", "model.text.max_sequence_length=16", "mhla.block_grid=[1,2,2]",
                 "mhla.normalize=false", "data.photos=[cat,coffee]", "data.resolution=64",
                 "data.caption_template=a photo of a {}"]
    else:
        model = ["model.init={num_attention_heads: 2, attention_head_dim: 8, in_channels: 12, out_channels: 12, "
                 "num_layers: 3, sample_size: 8, patch_size: 2, num_embeds_ada_norm: 1000}",
                 "model.vae={factor: 2, scaling_factor: 1.8}", "data.photos=[cat,coffee,flower]", "data.resolution=16"]
    return training.load_config(None, [f"output_dir={out}", f"data.batch_size={batch_size}", *COMMON, *model, *overrides, *extra])


def _whole(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor of an FSDP shard (a collective), a copy of a plain one; fp32 on the CPU."""
    t = t.detach()
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).float().cpu().clone()


def _fsdp_layout(model: torch.nn.Module) -> dict:
    """The FSDP units of ``model`` and the share of its parameter elements this process holds."""
    from torch.distributed.fsdp import FSDPModule

    params = list(model.parameters())
    local = sum(p.to_local().numel() if hasattr(p, "to_local") else p.numel() for p in params)
    shares = [None] * dist.get_world_size()
    dist.all_gather_object(shares, local)
    return {
        "units": [name or "<root>" for name, m in model.named_modules() if isinstance(m, FSDPModule)],
        "sharded": sum(hasattr(p, "to_local") for p in params),
        "parameters": len(params),
        "elements": sum(p.numel() for p in params),
        "elements_per_rank": shares,
    }


@contextlib.contextmanager
def probes(folder: str | Path):
    """Record gradients and clamped weights of every step of one :func:`~mhla_diffusers.training.train`
    call (see the module docstring); written when the call returns."""
    folder = Path(folder)
    tensors: dict[str, torch.Tensor] = {}
    layout: dict = {}
    clip, clamp = loop.clip_step_gradients, loop.mixing_ops.clamp_mixing_
    steps = {"grad": 0, "weight": 0}

    def record(kind: str, model) -> None:
        steps[kind] += 1
        for name, p in model.named_parameters():
            t = p.grad if kind == "grad" else p
            if t is not None:
                whole = _whole(t)  # every process takes part in the gather
                if not dist.is_initialized() or dist.get_rank() == 0:
                    tensors[f"{kind}.{steps[kind]}.{name}"] = whole

    def clip_probe(accelerator, model, groups, max_norm, per_group):
        record("grad", model)
        if not layout and accelerator.distributed_type.value == "FSDP":
            plugin = accelerator.state.fsdp_plugin
            layout.update(_fsdp_layout(model), rank=dist.get_rank(), fsdp_version=plugin.fsdp_version,
                          reshard_after_forward=plugin.reshard_after_forward,
                          state_dict_type=str(plugin.state_dict_type), wrap=plugin.transformer_cls_names_to_wrap,
                          per_group_clip=per_group)
        return clip(accelerator, model, groups, max_norm, per_group)

    def clamp_probe(model, *args, **kwargs):
        count = clamp(model, *args, **kwargs)
        record("weight", model)
        return count

    loop.clip_step_gradients, loop.mixing_ops.clamp_mixing_ = clip_probe, clamp_probe
    try:
        yield
    finally:
        loop.clip_step_gradients, loop.mixing_ops.clamp_mixing_ = clip, clamp
    if tensors:
        folder.mkdir(parents=True, exist_ok=True)
        save_file(tensors, str(folder / "probe.safetensors"))
    if layout.get("rank") == 0:
        (folder / "fsdp.json").write_text(json.dumps(layout, indent=1))


@contextlib.contextmanager
def fsdp_on_cpu():
    """Make the trainer's ``Accelerator`` take accelerate's FSDP path on CPU processes (see the module
    docstring): after accelerate has built it (MULTI_CPU over gloo), its shared state says FSDP and
    holds the plugin accelerate builds from the launch environment, as on GPUs."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, PartialState
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

    def build(*args, **kwargs):
        if PartialState._shared_state.get("distributed_type") == DistributedType.FSDP:
            PartialState._shared_state["distributed_type"] = DistributedType.MULTI_CPU  # as the last run found it
        AcceleratorState._reset_state()
        accelerator = Accelerator(*args, **kwargs)
        assert accelerator.distributed_type == DistributedType.MULTI_CPU, accelerator.distributed_type
        plugin = FullyShardedDataParallelPlugin()  # from the FSDP_* variables, as AcceleratorState reads them
        if accelerator.mixed_precision != "no":
            plugin.set_mixed_precision(accelerator.mixed_precision)  # as AcceleratorState does for FSDP
        for shared in (PartialState._shared_state, AcceleratorState._shared_state):
            shared["distributed_type"] = DistributedType.FSDP
        AcceleratorState._shared_state["fsdp_plugin"] = plugin
        return accelerator

    loop.Accelerator = build
    try:
        yield
    finally:
        loop.Accelerator = Accelerator


def sana_blocks(out: Path) -> None:
    """SANA (hybrid MHLA) with the units :func:`~mhla_diffusers.training.fsdp.set_fsdp_wrap` chooses (one per
    ``SanaTransformerBlock``), prepared by accelerate's FSDP2 path: output and gradients of one forward /
    backward against the unsharded model on the same inputs (every rank the same batch, so the averaged
    gradient is the one-process one). Rank 0 writes ``out/sana.json``: the units and the largest
    relative errors."""
    import copy

    from helpers_sana import sana_inputs, tiny_sana

    import mhla_diffusers
    from mhla_diffusers.ops.naive import relative_error
    from mhla_diffusers.training.fsdp import set_fsdp_wrap

    with fsdp_on_cpu():
        accelerator = loop.Accelerator(cpu=True)
    model = tiny_sana(num_layers=3).train()
    mhla_diffusers.apply_mhla(model, layers="hybrid", num_blocks=4)
    reference = copy.deepcopy(model)
    wrap = set_fsdp_wrap(accelerator, model)
    model, _ = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.0))
    latent, text, timestep, mask = sana_inputs(batch=2, size=8)
    results = {}
    for key, m in (("fsdp", model), ("one", reference)):
        sample = m(latent, encoder_hidden_states=text, timestep=timestep, encoder_attention_mask=mask).sample
        (sample * torch.linspace(-1, 1, sample.numel()).view_as(sample)).sum().backward()
        results[key] = (sample.detach(), {n: _whole(p.grad) for n, p in m.named_parameters() if p.grad is not None})
    (a, ga), (b, gb) = results["fsdp"], results["one"]
    layout = _fsdp_layout(model)
    if dist.get_rank() == 0:
        (out / "sana.json").write_text(json.dumps({
            "wrap": wrap, "units": layout["units"], "elements_per_rank": layout["elements_per_rank"],
            "output": relative_error(a, b), "grads": sorted(ga) == sorted(gb) and len(ga),
            "grad_error": max(relative_error(ga[n], gb[n]) for n in gb),
        }, indent=1))


def resumed(out: Path, base: str | Path) -> None:
    """``wan_all`` in two runs into ``out``: 2 steps with a checkpoint at step 2 (accelerate's FSDP2
    ``save_state``), then ``train.resume`` to step 3 (``load_state``)."""
    for steps, resume in ((2, "false"), (3, "true")):
        training.train(case_config("wan_all", out, base, 1, f"train.max_steps={steps}", "train.checkpointing_steps=2",
                                   f"train.resume={resume}"))


def run_case(name: str, out: str | Path, base: str | Path, batch_size: int) -> dict:
    """Train case ``name`` into ``out`` with the probes on; returns the summary."""
    with probes(out):
        return training.train(case_config(name, out, base, batch_size))


def main(argv: list[str]) -> int:
    """Every case of :data:`CASES` under FSDP2, batch 1 per process, into ``OUT/<case>``; then
    ``OUT/wan_all_resumed`` (:func:`resumed`) and ``OUT/sana.json`` (:func:`sana_blocks`)."""
    out, base = Path(argv[0]), argv[1]
    with fsdp_on_cpu():
        for name in CASES:
            run_case(name, out / name, base, batch_size=1)
        resumed(out / "wan_all_resumed", base)
    sana_blocks(out)
    training.end_processes()  # train() leaves the launch's group up for the next run
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
