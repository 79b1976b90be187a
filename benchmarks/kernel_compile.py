"""The compile report: MHLA's Triton kernels compiled for an sm_90 / sm_80 target at their recorded launches.

Part of ``kernel_costs`` (``benchmarks/kernel_costs.py``: the method). Each launch :func:`kernel_launches.record`
records is specialised by Triton's own binder (as a CUDA launch would be: divisibility and alignment of every
integer and pointer) and compiled by ``triton.compile`` with the Triton wheel's ptxas, whose log gives
registers, spills and shared memory. Occupancy (CTAs per SM) follows from those and the architecture's
limits (:data:`ARCHS`). Identical builds compile once per run (:class:`BuildCache`).

Nothing here needs a GPU; importing this module imports neither torch nor triton.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import re
import tempfile
import time
from dataclasses import dataclass

from kernel_launches import Launch, Recording, _torch_dtype


@dataclass(frozen=True)
class Arch:
    """Per-SM limits of one NVIDIA architecture (CUDA occupancy calculator values)."""

    name: str
    capability: int
    gpu: str
    sms: int
    regs_per_sm: int = 65536
    sub_partitions: int = 4  # register file split into 4 x 16 K, one per warp scheduler
    reg_alloc_unit: int = 256  # registers per warp are allocated in units of 256
    max_warps: int = 64
    max_ctas: int = 32
    smem_per_sm: int = 233472  # bytes
    smem_per_cta: int = 232448  # bytes a CTA may opt in to
    smem_reserved_per_cta: int = 1024  # bytes the driver reserves per CTA


ARCHS = {
    "sm_80": Arch("sm_80", 80, "A100", 108, smem_per_sm=167936, smem_per_cta=166912),
    "sm_90": Arch("sm_90", 90, "H100 / H200", 132),
}


def occupancy(registers: int, shared_bytes: int, num_warps: int, arch: Arch) -> dict:
    """Resident CTAs per SM from registers per thread, shared bytes per CTA and warps per CTA; what limits it."""
    per_warp = -(-registers * 32 // arch.reg_alloc_unit) * arch.reg_alloc_unit
    warps_by_regs = arch.sub_partitions * ((arch.regs_per_sm // arch.sub_partitions) // per_warp) if per_warp else arch.max_warps
    limits = {
        "registers": warps_by_regs // num_warps,
        "shared_memory": 0 if shared_bytes > arch.smem_per_cta else arch.smem_per_sm // (shared_bytes + arch.smem_reserved_per_cta),
        "warps": arch.max_warps // num_warps,
        "ctas": arch.max_ctas,
    }
    ctas = min(limits.values())
    return {
        "ctas_per_sm": ctas,
        "warps_per_sm": ctas * num_warps,
        "limited_by": sorted(k for k, v in limits.items() if v == ctas),
        "by": limits,
    }


# ---------------------------------------------------------------------------------------------
# Compiling the recorded launches for a GPU target


def parse_ptxas(log: str) -> dict:
    """Registers per thread, spill store / load bytes and stack frame bytes from a ``ptxas -v`` log (last kernel)."""
    def last(pattern):
        found = re.findall(pattern, log)
        return int(found[-1]) if found else None

    return {
        "registers": last(r"Used (\d+) registers"),
        "spill_store_bytes": last(r"(\d+) bytes spill stores"),
        "spill_load_bytes": last(r"(\d+) bytes spill loads"),
        "stack_frame_bytes": last(r"(\d+) bytes stack frame"),
    }


def _bind(launch: Launch, backend):
    """Triton's binder, as a CUDA launch calls it: ``(specialization, options, signature, constexprs, attrs)``."""
    from triton import knobs
    from triton.runtime.jit import create_function_from_signature

    kernel = launch.kernel
    kwargs = dict(launch.meta, debug=bool(kernel.debug or knobs.runtime.debug),
                  instrumentation_mode=knobs.compilation.instrumentation_mode,
                  fpsan_homomorphic_casts=knobs.compilation.fpsan_homomorphic_casts)
    binder = create_function_from_signature(kernel.signature, kernel.params, backend)
    bound, specialization, options = binder(*launch.args, **kwargs)
    packed = kernel._pack_args(backend, kwargs, bound, specialization, options)
    return specialization, options, packed


def build_key(launch: Launch, arch: Arch) -> str:
    """What makes two launches the same build: kernel, target, specialisation (types, constexprs, divisibility), options."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import make_backend

    specialization, options, _ = _bind(launch, make_backend(GPUTarget("cuda", arch.capability, 32)))
    return f"{launch.name}|{arch.name}|{specialization}|{options}"


def compile_launch(launch: Launch, arch: Arch) -> dict:
    """Compile one launch to a cubin for ``arch`` (fresh, no Triton cache) and read ptxas's report.

    Returns registers, spills (bytes), shared memory (bytes per CTA, Triton's metadata), compile seconds.
    """
    import triton
    from triton import knobs
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, make_backend

    backend = make_backend(GPUTarget("cuda", arch.capability, 32))
    _, _, (options, signature, constexprs, attrs) = _bind(launch, backend)
    log = io.StringIO()
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="mhla-kernel-report-") as cache, \
            knobs.cache.scope(), knobs.nvidia.scope(), knobs.compilation.scope(), contextlib.redirect_stdout(log):
        knobs.cache.dir = cache
        knobs.nvidia.dump_ptxas_log = True
        knobs.compilation.always_compile = True
        compiled = triton.compile(ASTSource(launch.kernel, signature, constexprs, attrs),
                                  target=GPUTarget("cuda", arch.capability, 32), options=options.__dict__)
    row = parse_ptxas(log.getvalue())
    if None in (row["registers"], row["spill_store_bytes"], row["spill_load_bytes"]):
        raise RuntimeError(f"ptxas's report was not understood (no registers / spill lines): {log.getvalue()[-800:]!r}")
    row["shared_bytes"] = int(compiled.metadata.shared)
    row["compile_s"] = round(time.perf_counter() - t0, 2)
    return row


class BuildCache:
    """Compile results by :func:`build_key` within one run: identical builds compile once."""

    def __init__(self):
        self.results: dict[str, dict] = {}
        self.compiles = 0

    def get(self, launch: Launch, arch: Arch) -> tuple[dict, str, bool]:
        """``(result, key, cached)``; a failed compile is a result with ``error``."""
        key = build_key(launch, arch)
        cached = key in self.results
        if not cached:
            self.compiles += 1
            try:
                self.results[key] = compile_launch(launch, arch)
            except Exception as exc:  # reported in the row: the caller decides
                self.results[key] = {"error": f"{type(exc).__name__}: {str(exc)[-1500:]}"}
        return self.results[key], key, cached


def build_rows(rec: Recording, arch: Arch, cache: BuildCache, *, shape: str, dtype, rope: bool) -> list[dict]:
    """One row per distinct build among the recorded launches (forward and backward) of one configuration."""
    rows: dict[str, dict] = {}
    for launch in rec.train_forward + rec.backward:
        result, key, cached = cache.get(launch, arch)
        use = f"{'backward' if launch.phase == 'backward' else 'forward'}: {launch.role}"
        if key in rows:
            rows[key]["uses"].append(use)
            continue
        warps = launch.meta.get("num_warps", 4)
        row = {"kernel": launch.name, "arch": arch.name, "dtype": str(_torch_dtype(dtype)).replace("torch.", ""),
               "shape": shape, "rope": bool(rope), "uses": [use],
               "num_warps": warps, "num_stages": launch.meta.get("num_stages"),
               "tiles": {k: v for k, v in launch.meta.items() if k.startswith("BLOCK_")},
               "grid": list(launch.grid), "programs": launch.programs, "cached": cached,
               "build_key": hashlib.sha1(key.encode()).hexdigest()[:16], **result}
        if "error" not in result:
            row["spill_bytes"] = result["spill_store_bytes"] + result["spill_load_bytes"]
            row["occupancy"] = occupancy(result["registers"], result["shared_bytes"], warps, arch)
            per_wave = max(1, row["occupancy"]["ctas_per_sm"]) * arch.sms
            row["waves"] = round(launch.programs / per_wave, 2)
            row["ok"] = result["shared_bytes"] <= arch.smem_per_cta
        else:
            row["ok"] = False
        rows[key] = row
    return list(rows.values())


def compile_available(environ=None) -> str | None:
    """Why kernels cannot be compiled (no Triton, no CUDA backend, no ptxas; ``TRITON_INTERPRET`` set in ``environ``,
    default ``os.environ``), or None."""
    import importlib.util
    import os

    environ = os.environ if environ is None else environ
    if importlib.util.find_spec("triton") is None:
        return "triton is not installed"
    if environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        return "TRITON_INTERPRET is set: the kernels are defined for the CPU interpreter"
    try:
        from triton import knobs
        from triton.backends import backends

        if "nvidia" not in backends:
            return "Triton's CUDA backend is not installed"
        ptxas = knobs.nvidia.ptxas.path
    except Exception as exc:  # an unusual installation: report, do not crash
        return f"cannot locate ptxas: {type(exc).__name__}: {exc}"
    if not ptxas or not os.path.exists(ptxas):
        return f"no ptxas at {ptxas!r}"
    return None
