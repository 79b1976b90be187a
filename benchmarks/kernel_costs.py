"""What MHLA's two backends cost on a GPU, worked out without one: compile reports, a bytes model, ATen op counts.

Used by ``benchmarks/kernel_report.py`` (the command line) and importable by other scripts
(``from kernel_costs import bytes_model``, with ``benchmarks/`` on ``sys.path``). This module gathers the
names of its three parts:

- **Launches** (``kernel_launches.py``). The Triton backend's own host code (``mhla_diffusers.ops.triton_ops``)
  is run on ``meta`` tensors with its launch recorder (``triton_ops._RECORD``, private) switched on: kernels
  are not run, their grids, arguments and meta-parameters are recorded with the CUDA launch configuration
  (tiles, warps, stages, splits), so nothing here copies the launchers' tile choices.
- **Compile report** (``kernel_compile.py``). Each recorded launch is specialised by Triton's own binder (as a
  CUDA launch would be: divisibility and alignment of every integer and pointer) and compiled for an sm_80 /
  sm_90 target by ``triton.compile`` with the Triton wheel's ptxas, whose log gives registers, spills and
  shared memory. Occupancy (CTAs per SM) follows from those and the architecture's limits.
- **Bytes model** (``kernel_bytes.py``). Per launch, from the kernel's loads and stores (per program: which
  tensors, how many bytes; how many programs), under three assumptions on what stays in L2 (:data:`SCENARIOS`),
  plus the torch operations the launcher runs between kernels (counted as below).
- **Torch backend** (``kernel_bytes.py``, counted with ``kernel_launches.op_counter``).
  ``mhla_attention(..., backend="torch")`` on ``meta`` tensors under a ``TorchDispatchMode`` that counts every
  ATen op and the bytes of its tensor inputs plus outputs. ``torch_ops.py`` branches on
  ``device.type != "cpu"`` only, so ``meta`` takes every branch that CUDA takes (one chunk holding all heads,
  no kept workspace, no huge pages).

Nothing here needs a GPU; importing this module imports neither torch nor triton.
"""

from __future__ import annotations

from kernel_bytes import (
    DEFAULT_SCENARIO,
    H200_BYTES_PER_S,
    SCENARIOS,
    Access,
    bytes_model,
    floor_bytes,
    launch_traffic,
    torch_backend_traffic,
)
from kernel_compile import (
    ARCHS,
    Arch,
    BuildCache,
    build_key,
    build_rows,
    compile_available,
    compile_launch,
    occupancy,
    parse_ptxas,
)
from kernel_launches import (
    SHAPES,
    SMALL_BYTES,
    Launch,
    OpRecord,
    Recording,
    Shape,
    op_counter,
    record,
)

__all__ = [
    "ARCHS", "DEFAULT_SCENARIO", "H200_BYTES_PER_S", "SCENARIOS", "SHAPES", "SMALL_BYTES",
    "Access", "Arch", "BuildCache", "Launch", "OpRecord", "Recording", "Shape",
    "build_key", "build_rows", "bytes_model", "compile_available", "compile_launch", "floor_bytes", "launch_traffic",
    "occupancy", "op_counter", "parse_ptxas", "record", "torch_backend_traffic",
]
