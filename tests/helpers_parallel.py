"""Multi-process runs on CPU (gloo) for the context-parallel tests: ``torchrun`` of a script of this
repository, and the results of tests/models/context_parallel_check.py (every case, one launch per world size).

Reuse from any test module::

    from helpers_parallel import torchrun, context_parallel_results
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

__all__ = ["ROOT", "torchrun", "context_parallel_results"]

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
