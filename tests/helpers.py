"""Tiny, deterministic diffusers components for tests (offline, CPU, a few ms per forward).

Reuse from any test module::

    from helpers import tiny_dit, dit_inputs, tiny_dit_pipeline, AttnCapture
"""

from __future__ import annotations

import copy
import logging
import re
from contextlib import contextmanager

import torch
from torch import nn

__all__ = [
    "tiny_dit",
    "dit_inputs",
    "run_dit",
    "tiny_vae",
    "tiny_dit_pipeline",
    "AttnCapture",
    "CallCapture",
    "stock_copy",
    "randomize_mixing_",
    "self_attn",
    "realign_",
]


def tiny_dit(
    num_layers: int = 4,
    heads: int = 2,
    head_dim: int = 8,
    sample_size: int = 8,
    patch_size: int = 2,
    in_channels: int = 4,
    out_channels: int | None = None,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
):
    """An eval-mode ``DiTTransformer2DModel`` with ``num_embeds_ada_norm=1000`` (class 1000 = null label).

    ``out_channels`` defaults to ``in_channels`` and is written to the config as an int (DiTPipeline
    reads ``config.out_channels // 2``). Weights are drawn from ``torch.manual_seed(seed)``; the
    global RNG state is restored afterwards.
    """
    from diffusers import DiTTransformer2DModel

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = DiTTransformer2DModel(
            num_attention_heads=heads,
            attention_head_dim=head_dim,
            in_channels=in_channels,
            out_channels=in_channels if out_channels is None else out_channels,
            num_layers=num_layers,
            sample_size=sample_size,
            patch_size=patch_size,
            num_embeds_ada_norm=1000,
            norm_num_groups=1,
        )
        # diffusers leaves the adaLN modulation at its default init; make every gate clearly non-zero
        # so each attention layer visibly changes the output.
        for block in model.transformer_blocks:
            nn.init.normal_(block.norm1.linear.weight, std=0.2)
    model.eval()
    return model if dtype == torch.float32 else model.to(dtype)


def dit_inputs(batch: int = 2, size: int | tuple[int, int] = 8, in_channels: int = 4, seed: int = 0, dtype=torch.float32):
    """``(latent [B, C, H, W], timestep [B] long, class_labels [B] long)``, deterministic from ``seed``."""
    h, w = (size, size) if isinstance(size, int) else size
    g = torch.Generator().manual_seed(seed)
    latent = torch.randn(batch, in_channels, h, w, generator=g).to(dtype)
    timestep = torch.randint(0, 1000, (batch,), generator=g)
    labels = torch.randint(0, 1000, (batch,), generator=g)
    return latent, timestep, labels


def run_dit(model, inputs) -> torch.Tensor:
    """The model's output sample for ``inputs = (latent, timestep, class_labels)`` (no grad)."""
    latent, timestep, labels = inputs
    with torch.no_grad():
        return model(latent, timestep=timestep, class_labels=labels).sample


def self_attn(model) -> list[nn.Module]:
    """The ``attn1`` modules of a DiT, in layer order."""
    return [block.attn1 for block in model.transformer_blocks]


def stock_copy(model):
    """A deep copy of a DiT (taken BEFORE MHLA is installed, so it keeps the stock processors)."""
    return copy.deepcopy(model)


@torch.no_grad()
def randomize_mixing_(model, seed: int = 0, low: float = -0.25, high: float = 1.25) -> None:
    """Fill every mixing matrix with uniform values in ``[low, high]`` (a "trained" state, partly
    outside ``[0, 1]`` so the clamp matters)."""
    from mhla_diffusers import mixing_parameters

    g = torch.Generator().manual_seed(seed)
    for p in mixing_parameters(model):
        p.copy_(torch.empty(p.shape, dtype=torch.float64).uniform_(low, high, generator=g).to(p.dtype))


@torch.no_grad()
def realign_(module: nn.Module) -> nn.Module:
    """Copy every parameter and buffer into freshly allocated (64-byte aligned) memory; returns ``module``.

    ``from_pretrained`` leaves weights at the byte offsets they have in the memory-mapped safetensors
    file (e.g. 8 mod 64). On CPU, MKL/oneDNN GEMV/GEMM results depend on operand alignment in the
    last bit, so a loaded model can differ by an ulp from the very same weights in fresh memory (plain
    diffusers DiT included, MHLA or not). Realigning both sides makes bitwise comparisons meaningful.
    """
    for t in list(module.parameters()) + list(module.buffers()):
        t.data = t.data.clone()
    return module


class CallCapture:
    """Forward hooks on the modules whose name matches ``pattern`` (``re.search``): each call's ``(args, kwargs,
    output)``, detached clones (tuples, such as a rotary embedding, cloned element by element), in
    ``calls[name]``. Use as a context manager; hooks are removed on exit."""

    def __init__(self, model: nn.Module, pattern: str):
        self.modules = {n: m for n, m in model.named_modules() if re.search(pattern, n)}
        self.calls: dict[str, list] = {n: [] for n in self.modules}
        self._handles = []

    def __enter__(self):
        def clone(x):
            if isinstance(x, tuple):
                return tuple(clone(t) for t in x)
            return x.detach().clone() if isinstance(x, torch.Tensor) else x

        for name, module in self.modules.items():
            def hook(module, args, kwargs, output, name=name):
                self.calls[name].append((clone(tuple(args)), {k: clone(v) for k, v in kwargs.items()}, clone(output)))

            self._handles.append(module.register_forward_hook(hook, with_kwargs=True))
        return self

    def __exit__(self, *exc):
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        return False


class AttnCapture:
    """Forward hooks on attention modules recording each call's ``hidden_states`` input and output.

    ``inputs[name]`` / ``outputs[name]``: lists of tensors, one per call (detached clones).
    Use as a context manager; hooks are removed on exit.
    """

    def __init__(self, model: nn.Module, pattern: str = r"transformer_blocks\.\d+\.attn1$"):
        self.model = model
        self.modules = {n: m for n, m in model.named_modules() if re.search(pattern, n)}
        self.inputs: dict[str, list[torch.Tensor]] = {n: [] for n in self.modules}
        self.outputs: dict[str, list[torch.Tensor]] = {n: [] for n in self.modules}
        self._handles = []

    def __enter__(self):
        for name, module in self.modules.items():
            self._handles.append(module.register_forward_hook(self._hook(name), with_kwargs=True))
        return self

    def _hook(self, name):
        def hook(module, args, kwargs, output):
            hidden = args[0] if args else kwargs["hidden_states"]
            self.inputs[name].append(hidden.detach().clone())
            self.outputs[name].append(output.detach().clone())

        return hook

    def __exit__(self, *exc):
        for h in self._handles:
            h.remove()
        self._handles.clear()
        return False


def tiny_vae(seed: int = 0, latent_channels: int = 4):
    """A one-level ``AutoencoderKL`` (scale factor 1): latent 8x8 -> image 8x8."""
    from diffusers import AutoencoderKL

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        vae = AutoencoderKL(
            in_channels=3,
            out_channels=3,
            down_block_types=("DownEncoderBlock2D",),
            up_block_types=("UpDecoderBlock2D",),
            block_out_channels=(8,),
            layers_per_block=1,
            latent_channels=latent_channels,
            norm_num_groups=8,
            sample_size=8,
        )
    return vae.eval()


def tiny_dit_pipeline(num_layers: int = 3, seed: int = 0):
    """A ``DiTPipeline`` from :func:`tiny_dit`, :func:`tiny_vae` and a ``DDIMScheduler``."""
    from diffusers import DDIMScheduler, DiTPipeline

    pipe = DiTPipeline(
        transformer=tiny_dit(num_layers=num_layers, seed=seed),
        vae=tiny_vae(seed),
        scheduler=DDIMScheduler(num_train_timesteps=1000),
    )
    pipe.set_progress_bar_config(disable=True)
    return pipe


@contextmanager
def no_grid_frames():
    """Assert that no grid frame leaks out of the block (frames are thread-local and must be popped)."""
    from mhla_diffusers.models import grid

    before = list(grid._frames())
    yield
    after = list(grid._frames())
    assert after == before, f"grid frames leaked: {len(before)} before, {len(after)} after"


def load_script(path: str):
    """Import a repository script (e.g. ``"benchmarks/bench_ops.py"``) as a module, so its
    ``main(argv)`` runs in-process without a new interpreter's import cost."""
    import importlib.util
    from pathlib import Path

    file = Path(__file__).resolve().parents[1] / path
    spec = importlib.util.spec_from_file_location(file.stem, file)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run_main(path: str, *args, capsys) -> tuple[int, str]:
    """``load_script(path).main(args)`` -> ``(exit code, captured stderr)``."""
    code = load_script(path).main([str(a) for a in args])
    return code, capsys.readouterr().err


class WarningLog(logging.Handler):
    """Collects diffusers' log records (its root logger does not propagate to pytest's caplog)."""

    def __init__(self):
        super().__init__(level=logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record):
        self.messages.append(record.getMessage())

    def __enter__(self):
        logging.getLogger("diffusers").addHandler(self)
        return self

    def __exit__(self, *exc):
        logging.getLogger("diffusers").removeHandler(self)


def legacy_key(key: str) -> str:
    """The checkpoint-format 1 / 2 name of an MHLA key: ``<attention>.mhla.mixing.weight`` was
    ``<attention>.mhla_mixing.weight`` (each part a child of the attention module then), written here from that format."""
    return re.sub(r"\.mhla\.(mixing|output_norm|gate|lepe|input_norm)\.", r".mhla_\1.", key)


def benchmark_module(name: str):
    """Import ``benchmarks/<name>.py`` as the module ``name``, with ``benchmarks/`` on the path while it imports
    (its siblings import each other by name)."""
    import importlib
    import sys
    from pathlib import Path

    folder = str(Path(__file__).resolve().parents[1] / "benchmarks")
    sys.path.insert(0, folder)
    try:
        return importlib.import_module(name)
    finally:
        sys.path.remove(folder)
