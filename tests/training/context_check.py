"""The trainer under context parallelism (``parallel.context``) on CPU processes, for tests/training/test_train_context.py.

Run by the test as ``accelerate launch --config_file finetune/accelerate/multi_cpu.yaml --num_processes 2
tests/training/context_check.py OUT BASE`` (DDP, one context group of 2) and with ``finetune/accelerate/fsdp.yaml
--num_processes 4 ... --fsdp`` (FSDP2 over 4 processes: 2 data ranks x 2 context ranks; accelerate's FSDP path
switched on for CPU processes as tests/training/fsdp_check.py does). Every case records the probes of
fsdp_check.py (every gradient when the trainer clips, every parameter after each step's clamp) into
``OUT/<case>``; the test runs the one-process references.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))  # fsdp_check: the cases, the probes, FSDP on the CPU
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fsdp_check import case_config, fsdp_on_cpu, probes  # noqa: E402

from mhla_diffusers import training  # noqa: E402

# Adam's first steps divide by |g| + eps: at the default eps (1e-8) a gradient entry near 0, where the context ranks'
# reduction order moves the last bits, turns into updates anywhere in [-lr, lr] (a mixing entry: up to 0.3). With
# eps 1e-3 the update is a smooth function of the gradient, and the weights compare at the gradients' precision.
SMOOTH_ADAM = "train.adam_eps=1e-3"
RING = "parallel.context={ring_degree: 2}"
ULYSSES = "parallel.context={ulysses_degree: 2}"
# name -> (fsdp_check case, batch per data rank, overrides): 2 processes, one context group
CASES = {
    # Wan, MHLA on every layer, ring mode (the summary exchange), full fine-tuning
    "wan_all_ring": ("wan_all", 2, [RING]),
    # Wan hybrid (softmax on layer 0: diffusers' Ulysses attention), LoRA + the mixing matrices, output matching
    # against the original teacher
    "wan_lora_ulysses": ("wan_lora", 2, [ULYSSES, "distill.teacher=original", "distill.output_weight=0.5"]),
    # DiT, MHLA on every layer (the trunk plan), the class-conditional recipe, its EMA exported, held-out losses
    # before and after training (every rank of the group evaluates: the forward is a collective)
    "dit_all_ring": ("dit_hybrid", 2, ["mhla.layers=all", RING, "ema.enabled=true", "ema.decay=0.5", "ema.export=true",
                                       "eval.samples=4", "eval.batch_size=2"]),
}
# 4 processes under FSDP2: 2 data ranks x 2 context ranks
FSDP_CASES = {"wan_all_ring_fsdp": ("wan_all", 1, [RING])}


def config_of(name: str, out: str | Path, base: str | Path, *extra: str, context: bool = True) -> dict:
    """The training config of ``name`` (without its parallel.context when ``context`` is false: the reference)."""
    case, batch, overrides = {**CASES, **FSDP_CASES}[name]
    overrides = [o for o in overrides if context or not o.startswith("parallel.")]
    return case_config(case, out, base, batch, SMOOTH_ADAM, *overrides, *extra)


def run_case(name: str, out: str | Path, base: str | Path, *extra: str, context: bool = True, batch: int | None = None) -> dict:
    """Train ``name`` into ``out`` with the probes on (``batch``: the per-process batch, else the case's)."""
    if batch is not None:
        extra = (f"data.batch_size={batch}", *extra)
    with probes(out):
        return training.train(config_of(name, out, base, *extra, context=context))


def resumed(out: Path, base: str | Path) -> None:
    """``wan_all_ring`` in two runs into ``out``: 2 steps with a checkpoint at step 2, then resumed to step 3."""
    for steps, resume in ((2, "false"), (3, "true")):
        run_case("wan_all_ring", out, base, f"train.max_steps={steps}", "train.checkpointing_steps=2", f"train.resume={resume}")


def killed(out: Path, base: str | Path) -> None:
    """``wan_all_ring`` to 3 steps, checkpointing at step 2, every rank SIGKILLed right after that checkpoint is
    complete (the launch fails); ``--resume-killed`` then resumes it in a new launch."""
    import os
    import signal

    from mhla_diffusers.training import loop

    save = loop._save_checkpoint

    def save_then_die(run, epoch):
        save(run, epoch)
        os.kill(os.getpid(), signal.SIGKILL)

    loop._save_checkpoint = save_then_die
    run_case("wan_all_ring", out, base, "train.checkpointing_steps=2")


def main(argv: list[str]) -> int:
    out, base, fsdp = Path(argv[0]), argv[1], "--fsdp" in argv
    if "--kill" in argv:
        killed(out, base)
        return 0  # not reached
    if "--resume-killed" in argv:
        run_case("wan_all_ring", out, base, "train.checkpointing_steps=2", "train.resume=true")
    elif fsdp:
        with fsdp_on_cpu():
            for name in FSDP_CASES:
                run_case(name, out / name, base)
    else:
        for name in CASES:
            summary = run_case(name, out / name, base)
            # what train() returned on this rank: the main process's summary on every rank
            (out / name / f"returned_{dist.get_rank()}.json").write_text(json.dumps(summary, sort_keys=True))
        resumed(out / "wan_all_ring_resumed", base)
    training.end_processes()  # train() leaves the launch's group up for the next run
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
