#!/usr/bin/env python
"""One denoising step of a real-width Wan2.1-1.3B transformer on a GPU: SDPA against MHLA (all layers, hybrid).

Random weights (no download), the published width (30 blocks of 12 heads x 128, FFN 8,960) or ``--blocks N`` of
them, one forward of the transformer at 81 frames of 480 x 832 (21 x 30 x 52 = 32,760 tokens) with a 512-token
prompt, in bf16 under ``torch.no_grad``, as one step of Wan's sampler runs it (Wan runs the conditional and the
unconditional pass as two such calls). Variants:

    sdpa            diffusers' own Wan attention processor (PyTorch SDPA)
    mhla-<backend>  apply_mhla(layers="all"): MHLA on every self-attention layer (block grid (3, 5, 7), M = 105)
    hybrid-<backend> apply_mhla(layers="hybrid"): softmax kept on layers 0, 3, 6, ..., MHLA on the others

for each ``--backends`` entry (``triton``, ``torch``). Per variant: forward time per step (median of ``--reps``
after ``--warmup``; the first call, compiles included, apart), peak memory the step adds, and, for the Triton
variants, the relative difference of the step's output from the same variant on the torch backend (the kernels
checked inside the whole model). The JSON (``--out``) is rewritten after each variant: a run cut short keeps
what it measured.

Usage (from the repository root; needs diffusers, see docs/triton.md for installing it from wheels)::

    python benchmarks/gpu_step.py --out gpu_step.json                       # 30 blocks, all variants
    python benchmarks/gpu_step.py --blocks 6 --backends triton --reps 5 --out /tmp/step.json
    python benchmarks/gpu_step.py --dry-run --out /tmp/step.json            # tiny model on the CPU: the wiring only
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import platform
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

VARIANTS = ("sdpa", "mhla", "hybrid")
BACKENDS = ("triton", "torch")
# --dry-run: a tiny Wan (2 heads x 12, FFN 32) on a 2 x 4 x 4 token grid, fp32 on the CPU
TINY = dict(num_attention_heads=2, attention_head_dim=12, ffn_dim=32, text_dim=32, freq_dim=16, rope_max_seq_len=32)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="gpu_step.json", help="the JSON written (rewritten after each variant)")
    p.add_argument("--blocks", type=int, default=30, help="transformer blocks (Wan2.1-1.3B has 30)")
    p.add_argument("--frames", type=int, default=81, help="video frames (4k + 1; 81 -> 21 latent frames)")
    p.add_argument("--height", type=int, default=480, help="video height in pixels (multiple of 16)")
    p.add_argument("--width", type=int, default=832, help="video width in pixels (multiple of 16)")
    p.add_argument("--batch", type=int, default=1, help="samples per call (Wan's sampler: 1 per pass)")
    p.add_argument("--text-len", type=int, default=512, help="prompt tokens (Wan: 512)")
    p.add_argument("--variants", nargs="+", choices=VARIANTS, default=list(VARIANTS))
    p.add_argument("--backends", nargs="+", choices=BACKENDS, default=list(BACKENDS), help="MHLA backends of the mhla / hybrid variants")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--reps", type=int, default=3, help="timed steps per variant")
    p.add_argument("--warmup", type=int, default=1, help="untimed steps per variant after the first call")
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--dry-run", action="store_true",
                   help="a tiny Wan on the CPU in fp32, torch backend only: checks the script's wiring, measures nothing")
    a = p.parse_args(argv)
    if a.dry_run:
        a.device, a.dtype, a.backends = "cpu", "float32", ["torch"]
        a.blocks, a.frames, a.height, a.width, a.text_len = min(a.blocks, 3), 5, 64, 64, 8
        a.reps, a.warmup = 1, 0
    elif a.device == "cpu":
        p.error("gpu_step.py measures a step on a GPU: --device cpu runs only with --dry-run (a tiny model, the wiring alone)")
    if a.frames % 4 != 1:
        p.error(f"--frames must be 4k + 1 (Wan's VAE); got {a.frames}")
    if a.height % 16 or a.width % 16:
        p.error(f"--height and --width must be multiples of 16 (VAE 8 x patch 2); got {a.height} x {a.width}")
    if a.blocks < 1 or a.reps < 1 or a.warmup < 0:
        p.error("--blocks and --reps must be >= 1, --warmup >= 0")
    return a


def import_stack():
    """torch, diffusers' WanTransformer3DModel, mhla_diffusers (with a clear message when diffusers is missing)."""
    import torch

    try:
        from diffusers import WanTransformer3DModel
    except ImportError as exc:
        sys.exit(f"gpu_step.py needs diffusers ({exc}); on a machine without a package index install it from wheels "
                 "(docs/triton.md, 'The end-to-end step')")
    import mhla_diffusers

    return torch, WanTransformer3DModel, mhla_diffusers


def build_model(torch, cls, args):
    """Wan2.1-1.3B's transformer (``--blocks`` of its 30 blocks), random weights from seed 0, on the device, eval."""
    from mhla_diffusers.models.configs import WAN_1_3B

    config = dict(WAN_1_3B, **(TINY if args.dry_run else {}), num_layers=args.blocks)
    torch.manual_seed(0)
    with torch.device(args.device):  # initialised where it runs: seconds on a GPU, not minutes on the CPU
        model = cls(**config)
    return cast_like_from_pretrained(torch, model, getattr(torch, args.dtype)).eval(), config


def cast_like_from_pretrained(torch, model, dtype):
    """``dtype`` everywhere but the modules diffusers keeps in fp32 on load (``_keep_in_fp32_modules``: Wan's rope,
    time embedder, modulation table and norms), as ``from_pretrained(torch_dtype=dtype)`` leaves a model."""
    keep = tuple(getattr(model, "_keep_in_fp32_modules", None) or ())
    torch.nn.Module.to(model, dtype)  # nn.Module's own: diffusers' override warns about exactly what is undone below
    for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
        if tensor.is_floating_point() and any(part in keep for part in name.split(".")):
            tensor.data = tensor.data.float()
    return model


def make_inputs(torch, model, args) -> dict:
    """A latent of ``--frames`` x ``--height`` x ``--width`` pixels, a random prompt embedding, timestep 500."""
    cfg, dtype = model.config, getattr(torch, args.dtype)
    gen = torch.Generator().manual_seed(0)
    latent = torch.randn(args.batch, cfg.in_channels, (args.frames - 1) // 4 + 1, args.height // 8, args.width // 8, generator=gen)
    text = torch.randn(args.batch, args.text_len, cfg.text_dim, generator=gen)
    return dict(hidden_states=latent.to(args.device, dtype), encoder_hidden_states=text.to(args.device, dtype),
                timestep=torch.full((args.batch,), 500.0, device=args.device), return_dict=False)


def token_grid(model, inputs) -> list[int]:
    p_t, p_h, p_w = model.config.patch_size
    _, _, t, h, w = inputs["hidden_states"].shape
    return [t // p_t, h // p_h, w // p_w]


def set_variant(mhla, model, variant: str, backend: str | None) -> int:
    """Stock processors, then MHLA on all or the hybrid set of layers; returns the number of MHLA layers."""
    if mhla.is_mhla_model(model):
        mhla.remove_mhla(model)
    if variant == "sdpa":
        return 0
    return len(mhla.apply_mhla(model, layers="all" if variant == "mhla" else "hybrid", backend=backend))


class Clock:
    """Synchronised wall time of a call (CUDA synchronised before and after)."""

    def __init__(self, torch, device: str):
        self.torch, self.cuda = torch, device == "cuda"

    def sync(self):
        if self.cuda:
            self.torch.cuda.synchronize()

    def seconds(self, fn) -> float:
        self.sync()
        start = time.perf_counter()
        fn()
        self.sync()
        return time.perf_counter() - start


def measure(torch, model, inputs, args, clock: Clock) -> tuple[dict, object]:
    """First call, warm-up, timed steps and peak memory of one forward; returns ``(row, output)``."""
    out = {}

    def step():
        with torch.no_grad():
            out["y"] = model(**inputs)[0]

    row = dict(first_call_s=round(clock.seconds(step), 3))
    for _ in range(args.warmup):
        step()
    times = [clock.seconds(step) for _ in range(args.reps)]
    row.update(step_ms=statistics.median(times) * 1e3, step_ms_all=[t * 1e3 for t in times])
    if clock.cuda:
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        step()
        torch.cuda.synchronize()
        row["step_peak_extra_gib"] = (torch.cuda.max_memory_allocated() - base) / 2**30
    return row, out["y"]


def relative_difference(a, b) -> float:
    a, b = a.double(), b.double()
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


def environment(torch, args) -> dict:
    import diffusers

    env = dict(date=_dt.datetime.now().isoformat(timespec="seconds"), python=platform.python_version(), torch=torch.__version__,
               diffusers=diffusers.__version__, device=args.device, dry_run=args.dry_run)
    if args.device == "cuda":
        env.update(device_name=torch.cuda.get_device_name(), cuda=torch.version.cuda)
        try:
            import triton

            env["triton"] = triton.__version__
        except ImportError:
            env["triton"] = None
    return env


def run(args) -> dict:
    """Every variant in turn on one model; the report (also written to ``--out`` after each variant)."""
    torch, cls, mhla = import_stack()
    if args.device == "cuda" and not torch.cuda.is_available():
        sys.exit("no CUDA device: gpu_step.py measures a GPU (use --dry-run for the CPU wiring check)")
    clock = Clock(torch, args.device)
    t0 = time.perf_counter()
    model, config = build_model(torch, cls, args)
    inputs = make_inputs(torch, model, args)
    report = dict(environment=environment(torch, args), args=vars(args), config=config, token_grid=token_grid(model, inputs),
                  tokens=int(torch.tensor(token_grid(model, inputs)).prod()), build_s=round(time.perf_counter() - t0, 1), variants=[])
    outputs = {}
    plan = [("sdpa", None)] if "sdpa" in args.variants else []
    plan += [(v, b) for v in ("mhla", "hybrid") if v in args.variants for b in args.backends]
    for variant, backend in plan:
        name = variant if backend is None else f"{variant}-{backend}"
        row = dict(variant=name, backend=backend)
        try:
            row["mhla_layers"] = set_variant(mhla, model, variant, backend)
            spec = mhla.mhla_spec(model) or {}
            row.update(layers=spec.get("layers"), block_grid=spec.get("block_grid"), num_blocks=spec.get("num_blocks"))
            timing, y = measure(torch, model, inputs, args, clock)
            row.update(timing)
            outputs[name] = y.float().cpu()
            if backend == "triton" and f"{variant}-torch" in outputs:
                row["vs_torch_backend"] = relative_difference(outputs[name], outputs[f"{variant}-torch"])
        except Exception as exc:  # recorded; the next variant still runs
            row["error"] = f"{type(exc).__name__}: {str(exc)[:500]}"
        report["variants"].append(row)
        summarise(report)
        Path(args.out).write_text(json.dumps(report, indent=1, default=str))
        print(f"{name:16s} " + (f"error: {row['error']}" if "error" in row else
                                f"{row['step_ms']:10.1f} ms/step, first call {row['first_call_s']:.1f} s"), flush=True)
    return report


def summarise(report: dict) -> None:
    """Speed-ups over SDPA, and the Triton variants' agreement with the torch backend where both ran."""
    rows = {r["variant"]: r for r in report["variants"] if "step_ms" in r}
    base = rows.get("sdpa")
    report["speedup_vs_sdpa"] = {n: base["step_ms"] / r["step_ms"] for n, r in rows.items() if base and n != "sdpa"}


def main(argv=None) -> int:
    args = parse_args(argv)
    args.backends = sorted(args.backends, key=lambda b: b != "torch")  # torch first: the Triton variants are compared to it
    report = run(args)
    bad = [r["variant"] for r in report["variants"] if "error" in r]
    print(f"wrote {args.out}; speed-up vs SDPA: " + ", ".join(f"{k} {v:.2f}x" for k, v in report["speedup_vs_sdpa"].items()))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
