"""Multi-process runs on CPU (gloo) for the context-parallel tests: ``torchrun`` of a script of this
repository, and the results of tests/models/context_parallel_check.py (every case, one launch per world size).

Reuse from any test module::

    from helpers_parallel import torchrun, context_parallel_results
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

__all__ = ["ROOT", "torchrun", "context_parallel_results", "accelerate_launch", "free_port", "max_error", "exported_tensors",
           "assert_same_probes"]

ROOT = Path(__file__).resolve().parents[1]


def torchrun(nproc: int, *args: str, timeout: int = 240) -> subprocess.CompletedProcess:
    """``python -m torch.distributed.run --standalone --nproc_per_node nproc *args`` from the repository root
    (one thread per process, offline)."""
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", PYTHONPATH=str(ROOT))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc), *args]
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


def context_parallel_results(world: int, out: str) -> dict:
    """``{case name: result}`` of tests/models/context_parallel_check.py run on ``world`` processes, written in ``out``."""
    run = torchrun(world, "tests/models/context_parallel_check.py", out)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    return json.loads(Path(out, "results.json").read_text())


def free_port() -> int:
    """A TCP port nothing listens on now (for a launch's rendezvous: not the default 29500 another run may hold)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def accelerate_launch(config: str, processes: int, script: str, *args: str, timeout: int = 600,
                      fails: bool = False) -> subprocess.CompletedProcess:
    """``accelerate launch --config_file finetune/accelerate/<config> --num_processes N script *args`` from the
    repository root on a free port (one thread per process, offline); fails the test with the output's tail (with
    ``fails``: unless the launch fails). Returns the finished launch (its text output)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "PYTHONPATH": str(ROOT)}
    cmd = [str(Path(sys.executable).with_name("accelerate")), "launch", "--config_file", str(ROOT / "finetune/accelerate" / config),
           "--num_processes", str(processes), "--main_process_port", str(free_port()), str(ROOT / script), *args]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    assert (proc.returncode != 0) == fails, proc.stdout[-3000:] + proc.stderr[-5000:]
    return proc


def max_error(a, b) -> float:
    """The largest absolute difference of two tensors, in float64 (0 for empty ones)."""
    return float((a.double() - b.double()).abs().max()) if a.numel() else 0.0


def exported_tensors(run: Path) -> dict:
    """Every tensor of the transformer a training run exported (``run/final/transformer``), keyed ``file:name``."""
    from safetensors.torch import load_file

    out = {}
    for name in ("diffusion_pytorch_model.safetensors", "mhla.safetensors"):
        path = run / "final" / "transformer" / name
        if path.is_file():
            out.update({f"{name}:{k}": v for k, v in load_file(path).items()})
    return out


def assert_same_probes(a: dict, b: dict, grad_tol: float, weight_tol: float, steps=(1, 2, 3)) -> None:
    """Two runs' probes (tests/training/fsdp_check.py: ``grad.<step>.<name>``, ``weight.<step>.<name>``) agree: every
    gradient within ``grad_tol`` of the step's largest entry (the mixing matrices among them), every parameter
    after the step within ``weight_tol`` (absolute)."""
    assert a.keys() == b.keys()
    for step in steps:
        grads = [k for k in a if k.startswith(f"grad.{step}.")]
        assert any("mhla.mixing" in k for k in grads)
        scale = max(float(a[k].abs().max()) for k in grads)
        for k in grads:
            assert max_error(a[k], b[k]) < grad_tol * scale, (k, max_error(a[k], b[k]), scale)
        for k in [k for k in a if k.startswith(f"weight.{step}.")]:
            assert max_error(a[k], b[k]) < weight_tol, (k, max_error(a[k], b[k]))
