#!/usr/bin/env python
"""GPU check of the Triton MHLA backend within a time budget: a first-run profile, then the rest.

Run on an H100/H200 from the repository root (torch and triton only: diffusers is not imported)::

    python benchmarks/gpu_check.py --budget-s 300 --out gpu_check_out    # stops itself within 300 s
    python benchmarks/gpu_check.py --plan                                 # the stages, estimates, compiles
    python benchmarks/gpu_check.py --device cpu --interpret --budget-s 60 --out /tmp/gc   # CPU rehearsal

Stages, in order of value (each in its own process: a kernel fault costs one stage):

    profile-M105    Wan2.1-1.3B 480p self-attention with RoPE (B=1, H=12, d=128, 21x30x52 tokens), the
                    default block grid (3, 5, 7), M = 105: the device's copy bandwidth first, then SDPA
                    (which backend ran, each backend's forward), the torch backend, and the Triton kernels
                    (bf16 outputs and gradients against a float64 oracle, timing, per-kernel times and bytes,
                    a CUDA-graph forward, a determinism check, targets from the bytes model)
    profile-M64     the same Triton and torch cases at block grid (4, 4, 4), M = 64
    wan-variants    Wan without RoPE, the authors' released layer (numerator only) at (3, 5, 10), M = 150,
                    RoPE composed around the kernels, plain linear attention (M = 1)
    correctness-bf16  bf16 outputs and gradients: Wan, SANA and DiT head dims, diffusers' memory layout,
                    normalize / feature map off, uneven blocks
    timing-image    SANA (2 x 36 x 4096 x 32) and DiT-XL (2 x 16 x 1024 / 4096 x 72): triton, torch, SDPA, linear
    correctness-more  the same grid in fp16, fp32 cases, one token, CASES C01
    compiled        the fused-RoPE operator under torch.compile (inductor)

Before a stage starts its estimate (process start + compiles + work, recalibrated from the stages already
run) must fit the time left (the first stage always starts); a stage that does not fit is skipped with a
record, a case inside a stage likewise, and a stage still running at the budget's end is killed. Every result is appended to
``<out>/gpu_check.jsonl`` as soon as it exists (one JSON object per line); ``gpu_check.json`` and
``gpu_check.md`` summarise it at the end. Format and how to read it: docs/triton.md, "The GPU check".

``--device cpu --interpret`` rehearses every stage on the CPU in Triton's interpreter (tiny shapes, fp32 /
fp16; the CUDA graph replaced by an eager replay, events by the wall clock): the control flow, the JSONL,
the budget; the numbers mean nothing.

The code: ``gpu_check_plan.py`` (shapes, stages, costs, ``--plan``), ``gpu_check_run.py`` (the JSONL, a
stage's process, the run in its budget), ``gpu_check_summary.py`` (``gpu_check.json`` and ``gpu_check.md``),
``gpu_check_cases.py`` and ``gpu_check_inputs.py`` (what a stage measures).
"""

import sys

if "--interpret" in sys.argv[1:]:  # must precede the first import of triton (kernels are defined then)
    import os as _os

    _os.environ["TRITON_INTERPRET"] = "1"

import argparse
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
if str(HERE) not in sys.path:  # the sibling modules, also when this file is loaded by path (tests)
    sys.path.insert(0, str(HERE))

from gpu_check_plan import (  # noqa: E402
    CPU_COSTS,
    GPU_COSTS,
    METHODS,
    QUICK_SHAPES,
    REST_SHAPES,
    SHAPES,
    STAGE_NAMES,
    TINY_SHAPES,
    Case,
    Costs,
    Stage,
    build_plan,
    count_builds,
    show_plan,
)
from gpu_check_run import (  # noqa: E402
    JSONL,
    SUMMARY_JSON,
    SUMMARY_MD,
    Journal,
    end_torn_line,
    orchestrate,
    read_records,
    run_child,
    run_stage,
    stop_process,
)
from gpu_check_summary import markdown, summarise  # noqa: E402

__all__ = ["CPU_COSTS", "GPU_COSTS", "JSONL", "METHODS", "QUICK_SHAPES", "REST_SHAPES", "SHAPES", "STAGE_NAMES", "SUMMARY_JSON",
           "SUMMARY_MD", "TINY_SHAPES", "Case", "Costs", "Journal", "Stage", "build_plan", "count_builds", "end_torn_line", "main",
           "markdown", "orchestrate", "parse_args", "read_records", "run_child", "run_stage", "show_plan", "stop_process",
           "summarise"]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="gpu_check_out", help="folder for gpu_check.jsonl, gpu_check.json and gpu_check.md")
    p.add_argument("--budget-s", type=float, default=450.0,
                   help="seconds for the whole run, compiles included (default 450: done within 8 minutes)")
    p.add_argument("--stages", nargs="+", choices=STAGE_NAMES, default=None, help="run only these stages (plan order kept)")
    p.add_argument("--plan", action="store_true", help="print the stages, their estimates and Triton compile counts, and exit")
    p.add_argument("--verbose-plan", action="store_true", help="with --plan: every case, its work and compile counts")
    p.add_argument("--quick", action="store_true", help="fewer correctness cases and timing shapes after the profile")
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--interpret", action="store_true", help="with --device cpu: the CPU rehearsal in Triton's interpreter (tiny shapes)")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"], help="dtype of the timing runs")
    p.add_argument("--shapes", nargs="+", choices=list(REST_SHAPES), default=None,
                   help=f"timing shapes after the profile (default: all of {list(REST_SHAPES)})")
    p.add_argument("--methods", nargs="+", choices=list(METHODS), default=list(METHODS), help="methods timed")
    p.add_argument("--reps", type=int, default=None, help="timed repetitions (default 20; --quick 8; --interpret 1)")
    p.add_argument("--hbm-tbps", type=float, default=4.8, help="nominal peak HBM bandwidth in TB/s (H200: 4.8, H100 SXM: 3.35)")
    p.add_argument("--skip-correctness", action="store_true", help="no correctness cases (the profile's included)")
    p.add_argument("--skip-timing", action="store_true", help="no timing or SDPA cases")
    # internal: one stage's process (set by the orchestrating process)
    p.add_argument("--run-stage", choices=STAGE_NAMES, help=argparse.SUPPRESS)
    p.add_argument("--run-t0", type=float, default=None, help=argparse.SUPPRESS)
    p.add_argument("--deadline", type=float, default=None, help=argparse.SUPPRESS)
    p.add_argument("--copy-gbps", type=float, default=None, help=argparse.SUPPRESS)
    p.add_argument("--measure-device", action="store_true", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.device == "cpu" and not a.interpret:
        p.error("--device cpu needs --interpret (the Triton kernels run on CPU tensors only in the interpreter)")
    if a.interpret and a.device != "cpu":
        p.error("--interpret needs --device cpu")
    if a.budget_s <= 0:
        p.error("--budget-s must be > 0")
    if a.reps is None:
        a.reps = 1 if a.interpret else 8 if a.quick else 20
    return a


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    if args.run_stage:
        return run_stage(args)
    if args.plan:
        return show_plan(args)
    return orchestrate(args, argv)


if __name__ == "__main__":
    sys.exit(main())
