"""``MHLAProcessor``: a diffusers attention processor computing self-attention with MHLA.

Reads top to bottom like the math: project q, k, v with the layer's own weights, split heads,
apply the layer's q/k norms, run :func:`~mhla_diffusers.mhla_attention` over the blocks of the
current token grid with the layer's own mixing matrix (and, for Wan, its RoPE after the feature
map, numerator only), optionally a per-head RMSNorm on the output, project out.
"""

from __future__ import annotations

import inspect
import math
import warnings
from functools import lru_cache
from typing import Sequence

import torch
from diffusers.models.attention_processor import AttnProcessor2_0
from torch import nn

from mhla_diffusers.models.families import (
    FAMILIES,
    attention_family,
    attention_modules,
    block_grid_preset_names,
    family_of,
    find_family,
    get_family,
    self_attention_modules,
    supported_model_classes,
)
from mhla_diffusers.models.grid import (
    GridReader,
    _exit,
    current_grid,
    current_model,
    ensure_global_hook,
    install_grid_hooks,
)
from mhla_diffusers.models.parallel import context_shard, sharded_mhla_attention
from mhla_diffusers.models.provenance import warn_fresh_mixing
from mhla_diffusers.ops import available_backends, mhla_attention
from mhla_diffusers.ops.layout import BlockLayout, choose_block_grid, get_layout, normalize_grid
from mhla_diffusers.ops.mixing import MixingMatrix

__all__ = [
    "MHLAProcessor",
    "OutputRMSNorm",
    "get_layout",
    "occupied_layout",
    "pending_mhla_layers",
    "materialize_mhla",
]


@lru_cache(maxsize=128)
@torch.inference_mode(False)  # cached across calls: never inference tensors
def occupied_layout(grid: tuple[int, int, int], block_grid: tuple[int, int, int]) -> tuple[BlockLayout, torch.Tensor]:
    """The blocks of ``block_grid`` that hold tokens of ``grid``, when some axis has fewer tokens than blocks.

    Token ``(t, h, w)`` belongs to block ``(t * bt // T, h * bh // H, w * bw // W)`` (DESIGN.md); on an
    axis with ``n < b`` tokens only the ``n`` blocks ``i * b // n`` hold tokens. Returns
    ``(layout, index)``: a :class:`BlockLayout` on ``grid`` with ``min(b, n)`` blocks per axis, and the
    ``[M']`` int64 ids (CPU) of those blocks in the full block grid, in the layout's block order.
    MHLA on ``layout`` with ``Mc[index][:, index]`` is exactly MHLA on the full block grid with the
    empty blocks contributing nothing (their summaries are zero).
    """
    axes = []
    for n, b in zip(grid, block_grid):
        axes.append(torch.arange(b) if b <= n else torch.arange(n) * b // n)
    it, ih, iw = axes
    _, bh, bw = block_grid
    index = ((it[:, None, None] * bh + ih[None, :, None]) * bw + iw[None, None, :]).reshape(-1)
    reduced = tuple(min(n, b) for n, b in zip(grid, block_grid))
    return BlockLayout(grid, reduced), index


class OutputRMSNorm(nn.Module):
    """Per-head RMSNorm of the attention output (the authors' Wan recipe with the normaliser off).

    ``y[b, h, n, :] = x[b, h, n, :] / sqrt(mean(x[b, h, n, :]^2) + eps) * weight[h, :]``, computed in
    float32 (float64 for float64 inputs) and returned in that dtype. Installed per layer as
    ``<attention module>.mhla_output_norm`` (state-dict key ``...mhla_output_norm.weight``, saved in
    ``mhla.safetensors``); ``weight`` starts at ones. The authors' configuration only says
    ``rms_output: true``; the per-head form with one weight per output channel is this project's.

    Args:
        heads: number of attention heads. head_dim: channels per head of the attention output.
        eps: added to the mean square.
    """

    def __init__(self, heads: int, head_dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = float(eps)
        self.weight = nn.Parameter(torch.ones(heads, head_dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x``: ``[B, heads, N, head_dim]`` -> same shape, float32 (float64 for float64 ``x``)."""
        if x.ndim != 4 or x.shape[1] != self.weight.shape[0] or x.shape[-1] != self.weight.shape[1]:
            raise ValueError(f"expected [B, {self.weight.shape[0]}, N, {self.weight.shape[1]}]; got {tuple(x.shape)}")
        acc = torch.float64 if x.dtype == torch.float64 else torch.float32
        x = x.to(acc)
        x = x * torch.rsqrt(x.square().mean(dim=-1, keepdim=True) + self.eps)
        return x * self.weight.to(acc)[:, None, :]

    def extra_repr(self) -> str:
        return f"heads={self.weight.shape[0]}, head_dim={self.weight.shape[1]}, eps={self.eps}"


class MHLAProcessor(GridReader, nn.Module):
    """Attention processor that runs MHLA on self-attention layers (MHLA paper, Sec. 3.2).

    Install with ``mhla_diffusers.apply_mhla(transformer, ...)`` (self-attention layers only,
    mixing matrices created eagerly), the one-liner ``transformer.set_attn_processor(MHLAProcessor())``
    (models that have the method: SANA, Wan), or ``mhla_diffusers.set_attn_processor(transformer,
    MHLAProcessor())`` (every model, DiT included; creates the mixing matrices now).
    One processor object may serve many layers: each layer keeps its own mixing matrix, as the
    submodule ``<attention module>.mhla_mixing`` (in ``state_dict()``, following ``.to()``), and its
    own output norm ``<attention module>.mhla_output_norm`` when it has one.

    The processor itself is an ``nn.Module`` without parameters or buffers (as diffusers' own
    IP-Adapter processors are): ``set_processor`` registers it as ``<attention module>.processor``
    (nothing in ``state_dict()``), so torch tells MHLA whenever it is put on a layer, through
    diffusers' own ``set_attn_processor`` too. It is called through its own ``__call__`` (module
    hooks on it do not run).

    A layer that already has a mixing matrix: a processor without an explicit block spec
    (``num_blocks`` and ``block_grid`` both ``None``) uses the layer's matrix and block grid as they
    are (that is how a loaded checkpoint runs). A processor whose ``block_grid``, preset or
    ``num_blocks`` gives another block grid than the layer's matrix (on the model's native token
    grid, as a fresh install would), or whose explicit ``output_norm`` contradicts the layer, is
    refused with a ``ValueError`` naming the fix, ``mhla_diffusers.remove_mhla(model)`` first: at
    install (``apply_mhla``, ``mhla_diffusers.set_attn_processor``), at the first forward after
    diffusers' own ``set_attn_processor`` / ``set_processor``, and by ``mhla_spec`` (so saving).
    The old matrix is never kept silently, nor silently replaced (trained values would be lost).

    Matrices created at the first forward: diffusers' own ``set_attn_processor(MHLAProcessor())``
    (the bare one-liner) cannot create a layer's matrix when it installs the processor, because the
    block grid comes from the transformer's native token grid, which an attention module does not
    know. The layer's first forward creates it (the block grid and locality init a fresh install
    gives, fp32 on the layer's device) with the ``requires_grad`` of the layer's own projection
    weights (a frozen model stays frozen), and warns once per model, unless that forward is pure
    inference (grad disabled and eval mode), naming the fix
    ``mhla_diffusers.materialize_mhla(transformer)``: an optimizer, an EMA (diffusers' ``EMAModel``)
    or a state dict taken before that forward does not hold the matrices. ``load_state_dict`` of a
    state dict with ``...mhla_mixing.weight`` keys into such a layer creates the matrix first when
    the block grid is known without the model (``block_grid=``, or a preset of the layer's family),
    else fails naming ``materialize_mhla`` (also with ``strict=False``: trained matrices are never
    dropped silently). ``torch.compile(fullgraph=True)`` and ``torch.export`` before the matrices
    exist fail naming ``materialize_mhla``; a plain ``torch.compile`` creates them eagerly at its
    first call (with graph breaks, and a warning).

    What it computes follows the model family's stock self-attention processor everywhere but the
    attention itself (see :class:`~mhla_diffusers.models.families.Family`): the layer's own projections
    (fused ``to_qkv`` included), its q/k norms where the stock processor applies them (SANA, Wan:
    over all heads, before the head split), the stock output dtype and path (SANA: ``to_out`` then
    the +-65504 clip for float16 inputs), and the family's eps (SANA 1e-15). With one block
    (``M = 1``) it is the plain linear attention of the paper, i.e. on SANA the stock
    ``SanaLinearAttnProcessor2_0`` up to float summation order. On Wan the model's RoPE is applied
    after the feature map: rotated ``phi(q)``, ``phi(k)`` in the numerator, un-rotated ones in the
    denominator (DESIGN.md; the authors' video model). On a cross-attention call
    (``encoder_hidden_states`` given, or a layer built for cross-attention) it runs the family's
    stock processor unchanged, bit for bit (SANA ``SanaAttnProcessor2_0``, Wan ``WanAttnProcessor``
    with its image branch; others ``AttnProcessor2_0``).

    Under diffusers' context parallelism (``enable_parallelism``; :func:`~mhla_diffusers.enable_context_parallel`)
    a self-attention call receives this rank's contiguous shard of the tokens: the layer then computes its
    queries' outputs over the whole sequence through one exchange over the context-parallel group
    (:mod:`mhla_diffusers.models.parallel`: block summaries, or heads in Ulysses mode), exactly as in one process.

    Both call conventions of diffusers are accepted: the legacy ``Attention`` one (keywords,
    ``temb=``) and ``WanAttention``'s positional ``(attn, hidden_states, encoder_hidden_states,
    attention_mask, rotary_emb)`` (CASES C11).

    Args:
        num_blocks: target number of blocks ``M`` when ``block_grid`` is not given; the block grid
            is chosen once per layer from the model's native token grid by
            :func:`~mhla_diffusers.choose_block_grid` (``None``: the family's default, Wan 105,
            else ``round(sqrt(N) / 2)``).
        block_grid: explicit ``(bt, bh, bw)`` (or ``(bh, bw)``), or the name of a preset of the
            model's family (Wan: ``"paper"`` = ``(3, 5, 7)``, ``"authors"`` = ``(3, 5, 10)``). The
            block grid is fixed per layer; at another resolution the blocks stretch with the image
            (Wan: at fewer tokens than blocks on an axis, e.g. one frame, the empty blocks drop out).
        normalize: divide by ``phi(q) . z~ + eps`` (the paper's form) or not (numerator only).
        eps: denominator epsilon; ``None`` takes the model family's default (DiT, Wan 1e-6, SANA 1e-15).
        backend: operator backend, ``"auto"`` or one of :func:`~mhla_diffusers.available_backends`.
        family: model family (``"dit"``, ``"sana"``, ``"wan"``) whose stock behaviour to follow.
            ``None`` (default): the family of the transformer running the layer (or of the
            attention module's class, Wan's ``WanAttention``). Give it only to call attention
            modules directly, outside their transformer (with :func:`~mhla_diffusers.token_grid`);
            there, without it, the generic behaviour applies (``AttnProcessor2_0`` for
            cross-attention, no clip, eps 1e-6).
        output_norm: put a per-head RMSNorm (:class:`OutputRMSNorm`, one per layer, weight ones at
            install) on the attention output. ``None``: the family's default, which for Wan is on
            exactly when ``normalize=False`` (the authors' Wan recipe) and off elsewhere.
        feature_eps: a constant added to the features after the ReLU, ``phi(x) = ReLU(x) + feature_eps``
            (the authors' released Wan model: 1e-6; see :func:`~mhla_diffusers.mhla_attention`).
            Default 0: the paper's ``phi = ReLU``.

    Raises (at construction):
        ValueError: bad ``num_blocks``, ``block_grid``, ``eps``, ``feature_eps`` or ``backend``; an unknown preset
            name; ``num_blocks`` contradicting ``block_grid``.

    Raises (at call time):
        RuntimeError: when the token grid of the call is unknown (no hook published it), or does
            not match the number of tokens; when ``family`` contradicts the running transformer.
        ValueError: when an attention mask is passed to a self-attention layer (MHLA has none);
            a rotary embedding given to a family without RoPE.
    """

    _attention_backend = None  # set by diffusers' set_attention_backend; forwarded to the stock processors

    def __init__(
        self,
        num_blocks: int | None = None,
        block_grid: Sequence[int] | str | None = None,
        normalize: bool = True,
        eps: float | None = None,
        backend: str = "auto",
        family: str | None = None,
        output_norm: bool | None = None,
        feature_eps: float = 0.0,
    ):
        super().__init__()
        if num_blocks is not None and (isinstance(num_blocks, bool) or int(num_blocks) != num_blocks or num_blocks < 1):
            raise ValueError(f"num_blocks must be a positive integer or None; got {num_blocks!r}")
        self.block_grid_preset = None
        if isinstance(block_grid, str):
            if block_grid not in block_grid_preset_names():
                raise ValueError(
                    f"unknown block-grid preset {block_grid!r}; known presets: {sorted(block_grid_preset_names())} "
                    "(or give a tuple (bt, bh, bw))"
                )
            if num_blocks is not None:
                raise ValueError(f"give num_blocks or the preset block_grid={block_grid!r}, not both")
            self.block_grid_preset, block_grid = block_grid, None
        self.block_grid = None if block_grid is None else normalize_grid(tuple(block_grid), "block_grid")
        if self.block_grid is not None and num_blocks is not None:
            m = self.block_grid[0] * self.block_grid[1] * self.block_grid[2]
            if m != num_blocks:
                raise ValueError(f"num_blocks={num_blocks} contradicts block_grid={self.block_grid} ({m} blocks); give one of them")
        self.num_blocks = None if num_blocks is None else int(num_blocks)
        self.normalize = bool(normalize)
        if eps is not None and (isinstance(eps, bool) or not isinstance(eps, (int, float)) or not 0 <= eps < math.inf):
            raise ValueError(f"eps must be a finite number >= 0 (or None: the family default); got {eps!r}")
        if eps is not None and eps == 0 and self.normalize:
            raise ValueError(
                "eps=0 with the normaliser gives 0 / 0 = NaN for every query or block whose ReLU features are all "
                "zero (any negative q or key block); use a small positive eps (the family default: eps=None)"
            )
        self.eps = eps
        if backend != "auto" and backend not in available_backends():
            raise ValueError(f"unknown backend {backend!r}; choose 'auto' or one of {available_backends()}")
        self.backend = backend
        self.family = None if family is None else get_family(family)
        self.output_norm = None if output_norm is None else bool(output_norm)
        if isinstance(feature_eps, bool) or not isinstance(feature_eps, (int, float)) or not 0 <= feature_eps < math.inf:
            raise ValueError(f"feature_eps must be a finite number >= 0; got {feature_eps!r}")
        self.feature_eps = float(feature_eps)
        self._stock: dict[str, object] = {}
        self._told_block_grids: set = set()  # (reference grid, block grid) already warned about
        ensure_global_hook()
        _ensure_registration_hook()

    def __repr__(self) -> str:
        grid = repr(self.block_grid_preset) if self.block_grid_preset is not None else self.block_grid
        return (
            f"MHLAProcessor(num_blocks={self.num_blocks}, block_grid={grid}, "
            f"normalize={self.normalize}, eps={self.eps}, backend={self.backend!r}"
            + ("" if self.output_norm is None else f", output_norm={self.output_norm}")
            + ("" if not self.feature_eps else f", feature_eps={self.feature_eps}")
            + ("" if self.family is None else f", family={self.family.name!r}")
            + ")"
        )

    # -- per-layer state --------------------------------------------------------------------------
    def resolve_block_grid(self, reference_grid: Sequence[int], family=None) -> tuple[int, int, int]:
        """The block grid this processor gives a layer of a model whose native token grid is ``reference_grid``.

        ``family`` (a :class:`~mhla_diffusers.models.families.Family`, default the processor's own) supplies
        presets and the default ``M``.

        Raises:
            ValueError: a preset name without a family, or one the family does not have.
        """
        if self.block_grid is not None:
            return self.block_grid
        family = family or self.family
        if self.block_grid_preset is not None:
            if family is None:
                raise ValueError(f"the block-grid preset {self.block_grid_preset!r} needs the model family (pass family=)")
            return family.preset(self.block_grid_preset)
        num_blocks = self.num_blocks
        if num_blocks is None and family is not None:
            num_blocks = family.default_num_blocks
        grid = choose_block_grid(reference_grid, num_blocks)
        if self.num_blocks is not None:
            self._tell_chosen_grid(reference_grid, grid)
        return grid

    def _tell_chosen_grid(self, reference_grid: Sequence[int], grid: tuple[int, int, int]) -> None:
        """Warn (once per processor and grid) when the block grid chosen for the user's ``num_blocks``
        does not have that many blocks: never a silently different ``M``."""
        reference = normalize_grid(tuple(reference_grid))
        blocks = grid[0] * grid[1] * grid[2]
        if blocks == self.num_blocks or (reference, grid) in self._told_block_grids or torch.compiler.is_compiling():
            return
        self._told_block_grids.add((reference, grid))
        tokens = reference[0] * reference[1] * reference[2]
        shape = " x ".join(str(n) for n in reference if n > 1) or "1"
        if self.num_blocks > math.isqrt(tokens):
            why = (
                f"MHLA keeps M^2 <= N (the mixing then costs no more than the block summaries), so the native token grid "
                f"{shape} (N = {tokens}) allows at most M = {max(1, math.isqrt(tokens))}"
            )
        else:
            why = f"the native token grid {shape} (N = {tokens}) has no near-square split into exactly {self.num_blocks} blocks"
        warnings.warn(
            f"num_blocks={self.num_blocks}: {why}; using block grid {grid} (M = {blocks}). Give a num_blocks "
            "this grid allows, or an explicit block_grid, to silence this warning",
            UserWarning,
            stacklevel=3,
        )

    def resolve_output_norm(self, family=None) -> bool:
        """Whether layers installed by this processor get a per-head output RMSNorm (see ``output_norm``)."""
        if self.output_norm is not None:
            return self.output_norm
        family = family or self.family
        return bool(family is not None and family.output_norm_without_normalize and not self.normalize)

    def attach(
        self,
        attn: torch.nn.Module,
        reference_grid: Sequence[int],
        init: str = "locality",
        family=None,
        requires_grad: bool = True,
    ) -> MixingMatrix:
        """Create the layer's mixing matrix (fp32, on the layer's device) if it has none, and its output
        norm if this processor asks for one; return the mixing matrix.

        Args:
            attn: the self-attention module. reference_grid: the model's native token grid ``(T, H, W)``.
            init: ``"locality"`` or ``"uniform"`` (see :class:`~mhla_diffusers.MixingMatrix`).
            family: the model's :class:`~mhla_diffusers.models.families.Family` (default: the processor's).
            requires_grad: of the new parameters (``apply_mhla`` / ``set_attn_processor``: ``True``;
                created for the bare one-liner: that of the layer's own projection weights).

        Raises:
            ValueError: the layer already has a mixing matrix whose block grid is not the one this
                processor's explicit ``block_grid`` / preset / ``num_blocks`` gives on
                ``reference_grid``, or an output norm where this processor asks for none (or the
                reverse): call ``remove_mhla`` first (see the class docstring).
        """
        family = family or self.family
        mixing = getattr(attn, "mhla_mixing", None)
        if mixing is None:
            return self._create(attn, self.resolve_block_grid(reference_grid, family), family, init, requires_grad)
        self.check_layer(attn, reference_grid, family)
        return mixing

    def _create(self, attn, block_grid, family, init: str, requires_grad: bool) -> MixingMatrix:
        """Add ``mhla_mixing`` (and ``mhla_output_norm`` if this processor asks for one) to ``attn``."""
        device = next(attn.parameters()).device
        # The bare one-liner creates parameters at the first forward, often inside a pipeline's
        # torch.inference_mode() / no_grad(): build them as ordinary tensors anyway.
        with torch.inference_mode(False), torch.enable_grad():
            mixing = MixingMatrix(block_grid, init=init).to(device).requires_grad_(requires_grad)
            attn.add_module("mhla_mixing", mixing)
            if self.resolve_output_norm(family) and getattr(attn, "mhla_output_norm", None) is None:
                norm = OutputRMSNorm(attn.heads, _output_head_dim(attn)).to(device).requires_grad_(requires_grad)
                attn.add_module("mhla_output_norm", norm)
        attn.__dict__[_CHECKED_BY] = self  # the layer's MHLA state is this processor's own
        return mixing

    def _explicit_block_grid(self, reference_grid: Sequence[int] | None, family) -> tuple[int, int, int] | None:
        """The block grid this processor's explicit spec gives on ``reference_grid`` (``None``: no spec,
        or a ``num_blocks`` / preset that cannot be resolved without the model)."""
        if self.block_grid is not None:
            return self.block_grid
        if self.block_grid_preset is not None:
            return None if family is None else family.preset(self.block_grid_preset)
        if self.num_blocks is not None and reference_grid is not None:
            return self.resolve_block_grid(reference_grid, family)
        return None

    def check_layer(self, attn: torch.nn.Module, reference_grid: Sequence[int] | None = None, family=None) -> None:
        """Refuse a layer whose MHLA state contradicts this processor's explicit settings.

        A processor without ``num_blocks`` / ``block_grid`` / ``output_norm`` accepts any layer. With
        one, the layer's mixing matrix must have the block grid a fresh install would give it on the
        model's native token grid ``reference_grid`` (``None``: unknown; then a ``num_blocks`` must
        equal the matrix's number of blocks), and its output norm must be there exactly when asked.

        Raises:
            ValueError: naming both settings and the fix, ``mhla_diffusers.remove_mhla(model)`` first.
        """
        family = family or self.family
        mixing = getattr(attn, "mhla_mixing", None)
        if mixing is not None:
            wanted = self._explicit_block_grid(reference_grid, family)
            if wanted is None and self.num_blocks is not None and reference_grid is None:
                mismatch = mixing.num_blocks != self.num_blocks
            else:
                mismatch = wanted is not None and tuple(mixing.block_grid) != tuple(wanted)
            if mismatch:
                spec = (
                    f"block_grid={self.block_grid}" if self.block_grid is not None
                    else f"block_grid={self.block_grid_preset!r}" if self.block_grid_preset is not None
                    else f"num_blocks={self.num_blocks}"
                )
                gives = "" if wanted is None or self.block_grid is not None else f" (block grid {wanted})"
                raise ValueError(
                    f"this layer already has a mixing matrix for block grid {mixing.block_grid}, but the processor asks "
                    f"for {spec}{gives}. MHLA neither keeps the old matrix under a new spec nor replaces it silently: "
                    "call mhla_diffusers.remove_mhla(model) first to install the new block grid (fresh locality-init "
                    "matrices), or use an MHLAProcessor without num_blocks / block_grid to keep the layer's matrix"
                )
        has_norm = getattr(attn, "mhla_output_norm", None) is not None
        if mixing is not None and self.output_norm is not None and has_norm != self.output_norm:
            raise ValueError(
                f"this layer {'has' if has_norm else 'has no'} MHLA output norm but the processor asks for "
                f"output_norm={self.output_norm}; call mhla_diffusers.remove_mhla(model) first to change it"
            )

    def _mixing(self, attn, family=None) -> MixingMatrix:
        mixing = getattr(attn, "mhla_mixing", None)
        if mixing is not None:
            if getattr(attn, _CHECKED_BY, None) is not self:
                self._check_running_layer(attn, family)
            return mixing
        if torch.compiler.is_exporting():
            # torch.export (non-strict) runs no always_call forward hook when the forward raises: close
            # the running model's grid frame here, or it would outlive the export
            _close_frame(current_model())
            raise RuntimeError(_NOT_MATERIALIZED.format(what="torch.export"))
        if torch.compiler.is_compiling():
            # torch.compile traces the first forward of the bare one-liner: create every pending
            # layer's parameters eagerly (graph breaks, this call only; the next call recompiles
            # into one graph with the new parameters). Under fullgraph=True this is an error that
            # names materialize_mhla (the reason given to torch.compiler.disable).
            return _materialize_eagerly(self, attn)
        model = current_model()
        if model is None:
            raise RuntimeError(
                f"this attention layer has no MHLA mixing matrix yet and runs outside a supported transformer: MHLA "
                f"supports {supported_model_classes()} (another class is refused, never run by guess: its attention "
                "may differ, e.g. q/k norms over all heads). In a supported transformer, install MHLA with "
                "mhla_diffusers.apply_mhla(transformer)"
            )
        running = family_of(model)
        if not model.__dict__.get(_SOURCE_CHECKED):  # once per model, before its first matrix exists
            model.__dict__[_SOURCE_CHECKED] = True
            warn_fresh_mixing(model)
        mixing = self.attach(
            attn, running.reference_grid(model.config), family=running, requires_grad=_layer_requires_grad(attn)
        )
        _warn_created_at_forward(model, compiled=False)
        return mixing

    def _check_running_layer(self, attn, family) -> None:
        """:meth:`check_layer` at a forward, on the running model's native grid; remembered per layer."""
        model = current_model()
        running = None if model is None else find_family(model)
        reference = None if running is None else running.reference_grid(model.config)
        self.check_layer(attn, reference, running or family)
        if not torch.compiler.is_compiling():
            attn.__dict__[_CHECKED_BY] = self

    def _grid(self, attn, num_tokens: int) -> tuple[int, int, int]:
        grid = current_grid()
        if grid is None:
            # diffusers' gradient checkpointing replays the grid of the forward (grid._ReplayGrid). Another
            # activation-checkpointing scheme recomputing the layer inside the backward pass gets the grid
            # this layer saw for this N, only if that is the only one it ever saw (never a guess).
            in_backward = torch._C._current_graph_task_id() != -1
            grids = attn.__dict__.get("_mhla_grids", {}).get(num_tokens, ()) if in_backward else ()
            if len(grids) == 1:
                return next(iter(grids))
            if len(grids) > 1:
                raise RuntimeError(
                    f"MHLA is recomputed in the backward pass without a token grid, and this layer has seen "
                    f"{len(grids)} grids with {num_tokens} tokens ({sorted(grids)}): it does not guess which. Use "
                    "diffusers' enable_gradient_checkpointing() (MHLA replays the grid there), or checkpoint the "
                    "whole transformer forward."
                )
            raise RuntimeError(
                f"MHLA does not know the token grid of this call ({num_tokens} tokens) and never guesses it. "
                f"Run the layer inside the forward of a supported transformer ({supported_model_classes()}; "
                "apply_mhla / set_attn_processor install the hooks; another class is refused), or wrap the call in "
                "`with mhla_diffusers.token_grid((T, H, W)):`."
            )
        if grid[0] * grid[1] * grid[2] != num_tokens and context_shard(num_tokens, grid[0] * grid[1] * grid[2]) is None:
            raise RuntimeError(
                f"the token grid {grid} of this forward has {grid[0] * grid[1] * grid[2]} tokens but the "
                f"self-attention received {num_tokens}; MHLA only supports layers that attend over the latent grid"
            )
        # The grids seen, for the recomputation fallback above. Not while torch.compile traces: a traced
        # dict update would make every call re-check it, and there the grid is a constant of the graph.
        if not torch.compiler.is_compiling():
            attn.__dict__.setdefault("_mhla_grids", {}).setdefault(num_tokens, set()).add(grid)
        return grid

    @staticmethod
    def _blocks(mixing: MixingMatrix, grid, family) -> tuple[BlockLayout, torch.Tensor]:
        """``(layout, Mc)`` for this call: the layer's block grid on the call's token grid, and the
        clamped mixing matrix (restricted to the blocks holding tokens where the family allows empty blocks)."""
        block_grid = mixing.block_grid
        if family is not None and family.empty_blocks and any(b > n for b, n in zip(block_grid, grid)):
            # traced by torch.compile: the function itself, not its lru cache
            layout, index = (occupied_layout.__wrapped__ if torch.compiler.is_compiling() else occupied_layout)(grid, block_grid)
            weight = mixing.clamped()
            index = index.to(weight.device)
            return layout, weight.index_select(0, index).index_select(1, index)
        if torch.compiler.is_compiling():  # traced: a plain construction (no tensors built), not the lru cache
            return BlockLayout(grid, block_grid), mixing.clamped()
        return get_layout(grid, block_grid), mixing.clamped()

    def _family(self, attn=None):
        """The family whose stock behaviour this call follows: explicit, else the running model's, else
        the attention module class's (``WanAttention``), else ``None``."""
        model = current_model()
        running = None if model is None else find_family(model)
        if self.family is None:
            if running is None and attn is not None:
                return attention_family(attn)
            return running
        if running is not None and running is not self.family:
            raise RuntimeError(
                f"this MHLAProcessor was built with family={self.family.name!r} but runs inside a "
                f"{type(model).__name__} ({running.name}); build it without family= inside transformers"
            )
        return self.family

    def _stock_processor(self, family):
        key = "" if family is None else family.name
        stock = self._stock.get(key)
        if stock is None:
            stock = _make_stock_processor(self._stock, key, family)
        if hasattr(stock, "_attention_backend"):
            stock._attention_backend = self._attention_backend
        return stock

    def _stock_call(self, family, attn, hidden_states, encoder_hidden_states, attention_mask, temb, rotary_emb, args, kwargs):
        """The family's stock cross-attention processor on the very same arguments, in the same convention."""
        stock = self._stock_processor(family)
        if family is not None and family.processor_call == "positional":
            return stock(attn, hidden_states, encoder_hidden_states, attention_mask, rotary_emb, *args, **kwargs)
        if args:
            return stock(attn, hidden_states, encoder_hidden_states, attention_mask, temb, *args, **kwargs)
        if temb is not None:  # only AttnProcessor2_0-like processors take it; SANA's never receive one
            kwargs = {"temb": temb, **kwargs}
        return stock(attn, hidden_states, encoder_hidden_states=encoder_hidden_states, attention_mask=attention_mask, **kwargs)

    # -- the computation --------------------------------------------------------------------------
    def __call__(
        self,
        attn,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        *args,
        temb: torch.Tensor | None = None,
        rotary_emb=None,
        **kwargs,
    ) -> torch.Tensor:
        """Run the layer: MHLA for self-attention, the stock processor for cross-attention.

        Args:
            attn: the attention module (legacy ``Attention`` or ``WanAttention``).
            hidden_states: ``[B, N, C]`` (or ``[B, C, H, W]`` for legacy 4-D inputs).
            encoder_hidden_states, attention_mask: as diffusers passes them (cross-attention only;
                a mask on self-attention is an error).
            args: a fifth positional argument is ``rotary_emb`` for modules calling their processor
                positionally (Wan), ``temb`` otherwise.
            temb: legacy ``Attention``'s ``temb`` (spatial norm). rotary_emb: Wan's ``(cos, sin)``.

        Returns:
            The layer output, shaped and typed as the stock processor's.
        """
        family = self._family(attn)
        if encoder_hidden_states is None and not getattr(attn, "is_cross_attention", False):
            _check_stock_arguments(family, args, kwargs, temb=temb, rotary_emb=rotary_emb)
        if args:
            positional = family is not None and family.processor_call == "positional"
            if positional:
                if rotary_emb is not None:
                    raise TypeError("rotary_emb was given both positionally and by keyword")
                rotary_emb, args = args[0], args[1:]
            elif temb is None:
                temb, args = args[0], args[1:]
        if encoder_hidden_states is not None or getattr(attn, "is_cross_attention", False):
            return self._stock_call(
                family, attn, hidden_states, encoder_hidden_states, attention_mask, temb, rotary_emb, args, kwargs
            )
        if attention_mask is not None:
            raise ValueError("MHLA self-attention takes no attention mask; remove MHLA from this layer or drop the mask")

        input_dtype = hidden_states.dtype
        residual = hidden_states
        if getattr(attn, "spatial_norm", None) is not None:
            hidden_states = attn.spatial_norm(hidden_states, temb)
        input_ndim = hidden_states.ndim
        if input_ndim == 4:
            batch, channel, height, width = hidden_states.shape
            hidden_states = hidden_states.view(batch, channel, height * width).transpose(1, 2)
        if getattr(attn, "group_norm", None) is not None:
            hidden_states = attn.group_norm(hidden_states.transpose(1, 2)).transpose(1, 2)
        batch, num_tokens, _ = hidden_states.shape
        mixing = self._mixing(attn, family)  # before any computation: refused outside a supported transformer
        grid = self._grid(attn, num_tokens)

        # the layer's own projections and q/k norms, where its stock processor applies them
        if getattr(attn, "fused_projections", False) and hasattr(attn, "to_qkv"):
            query, key, value = attn.to_qkv(hidden_states).chunk(3, dim=-1)
        else:
            query, key, value = attn.to_q(hidden_states), attn.to_k(hidden_states), attn.to_v(hidden_states)
        across_heads = family is not None and family.qk_norm_across_heads
        if across_heads:
            query, key = _qk_norm(attn, query, key)
        head_dim = key.shape[-1] // attn.heads
        query = query.view(batch, -1, attn.heads, head_dim).transpose(1, 2)  # [B, heads, N, d]
        key = key.view(batch, -1, attn.heads, head_dim).transpose(1, 2)
        value = value.view(batch, -1, attn.heads, value.shape[-1] // attn.heads).transpose(1, 2)
        if not across_heads:
            query, key = _qk_norm(attn, query, key)
        extra = {}
        if rotary_emb is not None:  # Wan: RoPE after the feature map, numerator only
            if family is None or family.rotary is None:
                raise ValueError(
                    f"a rotary embedding was passed but the model family {getattr(family, 'name', None)!r} has no "
                    "RoPE handling in MHLA"
                )
            extra["rotary"] = family.rotary(rotary_emb)

        # MHLA over the blocks of this call's token grid (phi = ReLU, fp32 accumulation)
        shard = context_shard(num_tokens, grid[0] * grid[1] * grid[2], attn.heads)  # None unless under context parallelism
        layout, weight = self._blocks(mixing, grid, family)
        eps = self.eps if self.eps is not None else (1e-6 if family is None else family.default_eps)
        output_norm = getattr(attn, "mhla_output_norm", None)
        q_op = query
        if output_norm is not None and query.dtype in (torch.float16, torch.bfloat16):
            q_op = query.float()  # the un-normalised numerator can exceed the float16 range: keep it in fp32
        if shard is None:
            hidden_states = mhla_attention(
                q_op, key, value, weight, layout, normalize=self.normalize, eps=eps, backend=self.backend,
                feature_eps=self.feature_eps, **extra,
            )
        else:  # this rank's tokens: one exchange over the context-parallel group (models/parallel.py)
            hidden_states = sharded_mhla_attention(
                q_op, key, value, weight, layout, shard, normalize=self.normalize, eps=eps,
                feature_eps=self.feature_eps, backend=self.backend, rotary_key=rotary_emb, **extra,
            )
        if output_norm is not None:
            hidden_states = output_norm(hidden_states)
        out_dtype = input_dtype if family is not None and family.attention_output_dtype == "input" else query.dtype
        hidden_states = hidden_states.transpose(1, 2).reshape(batch, num_tokens, -1).to(out_dtype)

        # the stock output path
        hidden_states = attn.to_out[0](hidden_states)
        hidden_states = attn.to_out[1](hidden_states)
        if family is not None and family.fp16_output_clip is not None and input_dtype == torch.float16:
            hidden_states = hidden_states.clip(-family.fp16_output_clip, family.fp16_output_clip)
        if input_ndim == 4:
            hidden_states = hidden_states.transpose(-1, -2).reshape(batch, channel, height, width)
        if getattr(attn, "residual_connection", False):
            hidden_states = hidden_states + residual
        rescale = getattr(attn, "rescale_output_factor", 1.0)
        return hidden_states if rescale == 1.0 else hidden_states / rescale


class _StockSignature:
    """What a stock self-attention processor's ``__call__`` accepts after ``attn`` (read from its signature)."""

    def __init__(self, processor):
        params = list(inspect.signature(processor.__call__).parameters.values())[1:]  # after attn
        kinds = inspect.Parameter
        self.owner = type(processor).__name__
        self.positional = tuple(p.name for p in params if p.kind in (kinds.POSITIONAL_ONLY, kinds.POSITIONAL_OR_KEYWORD))
        self.keywords = frozenset(p.name for p in params if p.kind in (kinds.POSITIONAL_OR_KEYWORD, kinds.KEYWORD_ONLY))
        self.var_positional = any(p.kind == kinds.VAR_POSITIONAL for p in params)
        self.var_keyword = any(p.kind == kinds.VAR_KEYWORD for p in params)


def _read_stock_signatures() -> dict[str, _StockSignature]:
    """Every family's stock self-attention signature by family name (``""``: the generic path, AttnProcessor2_0),
    read once at import so that a traced call only looks one up."""
    signatures = {name: _StockSignature(family.stock_self_processor()) for name, family in FAMILIES.items()}
    signatures[""] = _StockSignature(AttnProcessor2_0())
    return signatures


def _check_stock_arguments(family, args: tuple, kwargs: dict, **named) -> None:
    """Refuse the arguments that the family's stock self-attention processor would refuse.

    ``args`` are the positional arguments after ``attention_mask``, ``kwargs`` the other keywords and
    ``named`` the keywords :meth:`MHLAProcessor.__call__` names itself (``temb``, ``rotary_emb``; ``None``
    = not given). DiT's ``AttnProcessor2_0`` takes (and ignores) anything; SANA's and Wan's processors
    take a fixed list, so a misspelt keyword or an extra positional argument is an error there.

    Raises:
        TypeError: as Python's own for the stock ``__call__``: too many positional arguments, an
            unexpected keyword, or one argument given twice.
    """
    signature = _STOCK_SIGNATURES["" if family is None else family.name]
    given = 3 + len(args)  # hidden_states, encoder_hidden_states, attention_mask, *args
    where = f"{signature.owner}.__call__ (MHLAProcessor takes what this layer's stock processor takes)"
    if given > len(signature.positional) and not signature.var_positional:
        raise TypeError(f"{where} takes {len(signature.positional)} positional arguments after attn but {given} were given")
    keywords = list(kwargs) + [name for name, value in named.items() if value is not None]
    for name in keywords:
        if name not in signature.keywords and not signature.var_keyword:
            raise TypeError(f"{where} got an unexpected keyword argument {name!r}")
        if name in signature.positional[:given]:
            raise TypeError(f"{where} got multiple values for argument {name!r}")


_STOCK_SIGNATURES = _read_stock_signatures()


@torch.compiler.disable  # first call under torch.compile: built outside the graph, then read from the cache
def _make_stock_processor(cache: dict, key: str, family):
    stock = cache[key] = family.make_stock_cross_processor() if family is not None else _default_stock_processor()
    return stock


_NOT_MATERIALIZED = (
    "{what} of a model whose MHLA mixing matrices do not exist yet (diffusers' own "
    "set_attn_processor(MHLAProcessor()), the bare one-liner, creates them at the first forward, outside any "
    "graph): call mhla_diffusers.materialize_mhla(transformer) after set_attn_processor and before {what} "
    "(or install MHLA with mhla_diffusers.apply_mhla / mhla_diffusers.set_attn_processor)"
)


@torch.compiler.disable(reason=_NOT_MATERIALIZED.format(what="torch.compile(fullgraph=True)"))
def _materialize_eagerly(processor: "MHLAProcessor", attn) -> MixingMatrix:
    """The running model's pending MHLA layers get their matrices now (outside the traced graph)."""
    model = current_model()
    if model is not None:
        materialize_mhla(model)
        _warn_created_at_forward(model, compiled=True)
    mixing = getattr(attn, "mhla_mixing", None)
    return mixing if mixing is not None else processor._mixing(attn)


def _close_frame(model: nn.Module | None) -> None:
    """Remove ``model``'s innermost grid frame (what its always_call forward hook does)."""
    if model is not None:
        _exit(model, None, None)


# attn.__dict__ key: the MHLAProcessor that created or checked the layer's MHLA state (a forward then
# skips MHLAProcessor.check_layer); a processor put on the layer later is checked at its first forward.
_CHECKED_BY = "_mhla_checked_by"
_WARNED = "_mhla_created_at_forward_warned"  # model.__dict__ key: the warning below was given
_SOURCE_CHECKED = "_mhla_source_checked"  # model.__dict__ key: checked for a stock load of a converted folder


def _layer_requires_grad(attn) -> bool:
    """Whether the attention module's own projection weights are trainable (``to_q`` / ``to_k`` /
    ``to_v`` / fused ``to_qkv``; any of its parameters if it has none of these)."""
    weights = [getattr(getattr(attn, name, None), "weight", None) for name in ("to_q", "to_k", "to_v", "to_qkv")]
    weights = [w for w in weights if isinstance(w, torch.Tensor)] or list(attn.parameters())
    return any(w.requires_grad for w in weights)


def _warn_created_at_forward(model: nn.Module, compiled: bool) -> None:
    """The bare one-liner's matrices were just created by a forward: say so, once per model (not for
    pure inference, grad disabled and eval mode, as in a pipeline's call)."""
    if model.__dict__.get(_WARNED) or not (compiled or torch.is_grad_enabled() or model.training):
        return
    model.__dict__[_WARNED] = True
    if compiled:
        what = (
            "torch.compile traced it before they existed, so they were created eagerly and this compiled code has "
            "graph breaks"
        )
    else:
        what = (
            "an optimizer, EMA (diffusers' EMAModel) or state dict taken before this forward does not hold them, "
            "and they have the requires_grad of each layer's projection weights"
        )
    warnings.warn(
        f"MHLA created the mixing matrices of this {type(model).__name__} at its first forward (diffusers' own "
        f"set_attn_processor(MHLAProcessor()), the bare one-liner, cannot create them earlier): {what}. Call "
        "mhla_diffusers.materialize_mhla(transformer) right after set_attn_processor (or install MHLA with "
        "mhla_diffusers.apply_mhla), before building an optimizer or EMA, loading a state dict or compiling",
        UserWarning,
        stacklevel=2,
    )


class _PendingMixingLoader:
    """``load_state_dict`` pre-hook of an attention module that has been given an :class:`MHLAProcessor`:
    a state dict holding ``<prefix>mhla_mixing.weight`` for a layer whose matrix does not exist yet
    (the bare one-liner before its first forward) creates the matrix first when the processor's block
    grid is known without the model (explicit ``block_grid``, a preset of the layer's family), and
    otherwise fails naming ``materialize_mhla``. A plain object: hooked models pickle and deep-copy."""

    def __call__(self, attn, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs):
        key = f"{prefix}mhla_mixing.weight"
        processor = getattr(attn, "processor", None)
        if key not in state_dict or getattr(attn, "mhla_mixing", None) is not None or not isinstance(processor, MHLAProcessor):
            return
        family = processor.family or attention_family(attn)
        block_grid = processor._explicit_block_grid(None, family)
        if block_grid is not None:
            processor._create(attn, block_grid, family, "locality", _layer_requires_grad(attn))
            return
        if not any(_PENDING_LOAD in msg for msg in error_msgs):  # one message, not one per layer
            error_msgs.append(
                f"{key}: {_PENDING_LOAD} (diffusers' own set_attn_processor(MHLAProcessor()), the bare one-liner, "
                "creates it at the model's first forward from the transformer's native token grid, which the layer "
                "alone does not know), so the state dict's MHLA weights have nowhere to go. Call "
                "mhla_diffusers.materialize_mhla(model) before load_state_dict (or install MHLA with "
                "mhla_diffusers.apply_mhla / mhla_diffusers.set_attn_processor, or give the MHLAProcessor an explicit "
                "block_grid)"
            )


_PENDING_LOAD = "this layer runs MHLAProcessor but has no mixing matrix yet"


def _add_load_hook(attn: nn.Module) -> None:
    """Give ``attn`` the :class:`_PendingMixingLoader` pre-hook (once)."""
    if not any(isinstance(getattr(h, "hook", None), _PendingMixingLoader) for h in attn._load_state_dict_pre_hooks.values()):
        attn.register_load_state_dict_pre_hook(_PendingMixingLoader())


def remove_load_hook(attn: nn.Module) -> None:
    """Remove the :class:`_PendingMixingLoader` pre-hook from ``attn`` (no-op without one)."""
    hooks = attn._load_state_dict_pre_hooks
    for hook_id in [i for i, h in hooks.items() if isinstance(getattr(h, "hook", None), _PendingMixingLoader)]:
        del hooks[hook_id]


def _on_module_registration(module: nn.Module, name: str, submodule: nn.Module):
    """Process-wide module-registration hook: an :class:`MHLAProcessor` set as an attention module's
    ``processor`` (by diffusers' ``set_processor``) gives that module the load pre-hook."""
    if name == "processor" and isinstance(submodule, MHLAProcessor):
        _add_load_hook(module)
    return None


_registration_handle = None


def _ensure_registration_hook() -> None:
    """Register (once per process) :func:`_on_module_registration`."""
    global _registration_handle
    if _registration_handle is None:
        _registration_handle = nn.modules.module.register_module_module_registration_hook(_on_module_registration)


def _output_head_dim(attn) -> int:
    """Channels per head of the attention output (the value head dim)."""
    to_v = getattr(attn, "to_v", None)
    if to_v is not None and hasattr(to_v, "out_features"):
        return to_v.out_features // attn.heads
    return attn.inner_dim // attn.heads


def _qk_norm(attn, query: torch.Tensor, key: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    if getattr(attn, "norm_q", None) is not None:
        query = attn.norm_q(query)
    if getattr(attn, "norm_k", None) is not None:
        key = attn.norm_k(key)
    return query, key


def _default_stock_processor():
    return AttnProcessor2_0()


# -- matrices created before the first forward ---------------------------------------------------
def pending_mhla_layers(model: nn.Module) -> list[str]:
    """Names of the self-attention layers that run an :class:`MHLAProcessor` but have no mixing matrix yet.

    diffusers' own ``model.set_attn_processor(MHLAProcessor())`` (the bare one-liner) installs the
    processor only; each layer's matrix is created at its first forward. ``[]`` for a model that is
    not a supported transformer.
    """
    family = find_family(model)
    if family is None:
        return []
    return [
        name
        for name, attn in self_attention_modules(model, family)
        if isinstance(getattr(attn, "processor", None), MHLAProcessor) and getattr(attn, "mhla_mixing", None) is None
    ]


def materialize_mhla(transformer: nn.Module) -> list[str]:
    """Create now the mixing matrices (and output norms) that the first forward would create for
    the layers of :func:`pending_mhla_layers`: same block grid (the processor's, resolved on the
    family's reference grid), locality init, fp32 on the layer's device, ``requires_grad`` as the
    layer's own projection weights (a frozen model stays frozen; unfreeze them with
    ``p.requires_grad_(True)`` for ``p`` in ``mhla_diffusers.mixing_parameters(model)`` to train them).

    Call it right after diffusers' own ``set_attn_processor(MHLAProcessor())`` (the bare one-liner),
    before building an optimizer or EMA, loading a state dict, ``torch.compile`` or
    ``torch.export``: otherwise the matrices appear only at the first forward (with a warning).

    Returns:
        Names of the layers that got their matrices (``[]`` when none was pending).

    Raises:
        ValueError: ``transformer`` is not a supported transformer but has MHLA processors, or a
            processor's settings do not fit the model (e.g. a preset the family lacks).
    """
    family = find_family(transformer)
    if family is None:
        if any(isinstance(getattr(a, "processor", None), MHLAProcessor) for a in attention_modules(transformer).values()):
            family_of(transformer)  # raises, naming the supported classes
        return []
    for attn in attention_modules(transformer).values():  # the stock processors the cross-attention layers call
        proc = getattr(attn, "processor", None)
        if isinstance(proc, MHLAProcessor):
            proc._stock_processor(family)
    pending = set(pending_mhla_layers(transformer))
    if not pending:
        return []
    reference = family.reference_grid(transformer.config)
    warn_fresh_mixing(transformer)
    done = []
    for name, attn in self_attention_modules(transformer, family):
        if name in pending:
            attn.processor.attach(attn, reference, family=family, requires_grad=_layer_requires_grad(attn))
            done.append(name)
    install_grid_hooks(transformer)
    return done
