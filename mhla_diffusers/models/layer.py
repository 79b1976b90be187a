"""The MHLA a self-attention layer owns: ``<attention module>.mhla``, an :class:`MHLALayer`.

It holds every setting that changes what the layer computes (:class:`~mhla_diffusers.models.spec.LayerSettings`)
and its parameters (the mixing matrix, and where asked the output norm, gate, LePE and input norm); its forward
runs them, so that hooks diffusers and accelerate put on submodules (offloading, casting) fire as on stock
modules. The checkpoint's settings are read from it (:attr:`MHLALayer.settings`). Created once, by ``apply_mhla``
/ ``set_attn_processor`` or at the bare one-liner's first forward (:func:`attach`).
"""

from __future__ import annotations

import math
from typing import Sequence

import torch
from torch import nn
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from mhla_diffusers.families import GENERIC
from mhla_diffusers.models import spec
from mhla_diffusers.models.layer_parts import InputLayerNorm, LePE, OutputGate, OutputRMSNorm
from mhla_diffusers.models.parallel import context_shard, sharded_mhla_attention
from mhla_diffusers.ops import mhla_attention
from mhla_diffusers.ops.layout import BlockLayout, get_layout, occupied_layout
from mhla_diffusers.ops.mixing import MixingMatrix

__all__ = ["MHLALayer", "attach", "create_layer", "layer_requires_grad", "value_devices", "holds_values"]

_SCALARS = ("normalize", "eps", "feature_eps", "feature_power", "rope", "denominator")  # the settings kept as attributes


class MHLALayer(nn.Module):
    """A self-attention layer's MHLA (paper Sec. 3.2), ``<attention>.mhla``: settings, mixing matrix, optional parts.

    Submodules (state-dict keys ``<attention>.mhla.<name>.*``): ``mixing`` (:class:`~mhla_diffusers.MixingMatrix`,
    always), ``output_norm``, ``gate``, ``lepe``, ``input_norm`` (each ``None`` unless its setting is on). The
    scalar settings are plain attributes; :attr:`settings` gives all of them as one value. ``seen_grids``,
    ``verified`` and ``unsettled`` are bookkeeping (the grids of past calls; checked against the current processor;
    made before its family was known), not state.

    Args:
        settings: what the layer computes; its ``eps`` and ``rope`` resolved for the family.
        heads, head_dim: of the attention output (``head_dim``: the value head dim).
        in_features: channels of the tokens entering the layer (gate, input norm).
        lepe_kernel: ``(3, 3)`` (each frame, image families) or ``(3, 3, 3)`` (video families).
        init: the mixing matrix's start (:func:`~mhla_diffusers.models.spec.check_mixing_init`).
        lepe_init: ``"zeros"`` or ``"authors"``.
    """

    def __init__(self, settings: spec.LayerSettings, *, heads: int, head_dim: int, in_features: int,
                 lepe_kernel: Sequence[int] = (3, 3), init: str = "locality", lepe_init: str = "zeros"):
        super().__init__()
        spec.check_mixing_init(init)
        spec.check_lepe_init(lepe_init)
        for name in _SCALARS:
            setattr(self, name, getattr(settings, name))
        constant = init == spec.AUTHORS_CONSTANT
        self.mixing = MixingMatrix(settings.block_grid, init="uniform" if constant else init, clamp=settings.mixing_clamp)
        self.output_norm = OutputRMSNorm(heads, head_dim) if settings.output_norm else None
        self.gate = OutputGate(in_features, heads, head_dim, settings.gate) if settings.gate else None
        self.lepe = LePE(heads * head_dim, lepe_kernel, lepe_init) if settings.lepe else None
        self.input_norm = InputLayerNorm(in_features) if settings.input_norm else None
        if constant:  # the authors' Wan start: matrix and output-norm weight at 1e-6
            with torch.no_grad():
                for module in (self.mixing, self.output_norm):
                    if module is not None:
                        module.weight.fill_(spec.AUTHORS_CONSTANT_VALUE)
        self.seen_grids: dict[int, set[tuple[int, int, int]]] = {}
        self.verified = True
        self.unsettled = False  # made before its model's family was known: the family's defaults are taken later

    def settle(self, settings: spec.LayerSettings) -> None:
        """Take the scalar settings (``eps``, ``rope``, ...) of ``settings``, those the processor's settings give on the
        model's family, once it is known: for a layer made before (``unsettled``: a ``load_state_dict`` before the
        first forward, :mod:`~mhla_diffusers.models.lazy`); callers check ``unsettled`` first."""
        for name in _SCALARS:
            setattr(self, name, getattr(settings, name))
        self.unsettled = False

    @property
    def settings(self) -> spec.LayerSettings:
        """What this layer computes: its attributes, the mixing matrix's grid and clamp, which parts it has."""
        return spec.LayerSettings(
            block_grid=tuple(self.mixing.block_grid), mixing_clamp=self.mixing.clamp,
            output_norm=self.output_norm is not None, gate=None if self.gate is None else self.gate.form,
            lepe=self.lepe is not None, input_norm=self.input_norm is not None,
            **{name: getattr(self, name) for name in _SCALARS},
        )

    def extra_repr(self) -> str:
        fresh = spec.LayerSettings(block_grid=self.mixing.block_grid)
        changed = [f"{k}={v!r}" for k, v in vars(self.settings).items() if k != "block_grid" and v != getattr(fresh, k)]
        return ", ".join(changed)

    # -- the computation ----------------------------------------------------------------------------
    def norm_input(self, tokens: torch.Tensor) -> torch.Tensor:
        """``tokens`` ``[B, N, C]`` through the input LayerNorm (the authors' DiT layer), if the layer has one."""
        return tokens if self.input_norm is None else self.input_norm(tokens)

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, grid: tuple[int, int, int], *,
                tokens: torch.Tensor, rotary_emb=None, family=GENERIC, backend: str = "auto") -> torch.Tensor:
        """MHLA of the layer's own ``query``, ``key`` ``[B, heads, N, d]`` and ``value`` ``[B, heads, N, dv]`` on the
        token grid ``grid`` (paper Eq. 6-7), then the output norm, gate and LePE it has.

        Args:
            tokens: ``[B, N, C]``, the (input-normed) tokens q, k, v came from: the gate's input.
            rotary_emb: the family's rotary embedding of this call (Wan's ``(cos, sin)``), or ``None``.
            family: the running model's :class:`~mhla_diffusers.families.Family` (RoPE, empty blocks).
            backend: the operator's backend (:func:`~mhla_diffusers.mhla_attention`).

        Returns:
            ``[B, heads, N, dv]`` in the query's dtype (float32 with an output norm, gate or LePE).

        Raises:
            RuntimeError: LePE or the authors' DiT normaliser under context parallelism.
            ValueError: a rotary embedding the family does not take, or none where it needs one.
        """
        shard = self._shard(query.shape[2], grid, query.shape[1])  # None unless under context parallelism
        if self.output_norm is not None and query.dtype in (torch.float16, torch.bfloat16):
            query = query.float()  # the un-normalised numerator can exceed the float16 range: keep it in fp32
        query, key, rotary = self._rope(family, query, key, rotary_emb)
        layout, mixing = self._blocks(grid, family.empty_blocks)
        out = self._attention(query, key, value, mixing, layout, shard, rotary, rotary_emb, backend)
        if self.output_norm is not None:
            out = self.output_norm(out)
        if self.gate is not None:  # the authors' order: norm, gate, then + LePE
            out = self.gate(out, tokens)
        if self.lepe is not None:
            out = out + self.lepe(value, grid)
        return out

    def _rope(self, family, query, key, rotary_emb):
        """``(query, key, rotary)``: ``"after"`` gives the map rotating ``phi(q)``, ``phi(k)`` in the numerator;
        ``"before"`` rotates q and k now (no rotary for the operator); ``"none"`` drops the RoPE."""
        if self.rope == "none":
            return query, key, None
        rotary = family.feature_rotary(rotary_emb)
        if rotary is not None and self.rope == "before":
            return rotary(query), rotary(key), None
        return query, key, rotary

    def _blocks(self, grid, empty_blocks: bool) -> tuple[BlockLayout, torch.Tensor]:
        """``(layout, Mc)``: the block grid on this call's token grid and the mixing matrix the operator uses, restricted
        to the blocks holding tokens where some axis has fewer tokens than blocks (families with ``empty_blocks``)."""
        block_grid = self.mixing.block_grid
        compiling = torch.compiler.is_compiling()  # traced: plain constructions, never the lru caches
        if empty_blocks and any(b > n for b, n in zip(block_grid, grid)):
            layout, index = (occupied_layout.__wrapped__ if compiling else occupied_layout)(grid, block_grid)
            return layout, self.mixing(index)
        return (BlockLayout(grid, block_grid) if compiling else get_layout(grid, block_grid)), self.mixing()

    def _attention(self, query, key, value, mixing, layout, shard, rotary, rotary_emb, backend) -> torch.Tensor:
        """The operator (or its context-parallel form on this rank's tokens) with this layer's settings."""
        options = dict(normalize=self.normalize, eps=self.eps, feature_eps=self.feature_eps,
                       feature_power=self.feature_power, backend=backend)
        if self.denominator != "paper":  # the keyword only where set: the sharded path has the paper's alone
            options["denominator"] = self.denominator
        if rotary is not None:
            options["rotary"] = rotary
        if shard is None:
            return mhla_attention(query, key, value, mixing, layout, **options)
        return sharded_mhla_attention(query, key, value, mixing, layout, shard, rotary_key=rotary_emb, **options)

    def _shard(self, num_tokens: int, grid: tuple[int, int, int], heads: int):
        """This rank's shard under context parallelism, ``None`` when the call holds every token of the grid."""
        total = math.prod(grid)
        if num_tokens == total:
            return None
        shard = context_shard(num_tokens, total, heads)
        if shard is None:
            raise RuntimeError(
                f"the token grid {grid} of this forward has {total} tokens but the "
                f"self-attention received {num_tokens}; MHLA only supports layers that attend over the latent grid"
            )
        if self.lepe is not None:
            raise RuntimeError(
                f"this MHLA layer has a LePE convolution (lepe=True), which needs each token's neighbours on the token "
                f"grid, but under context parallelism it holds only this rank's {num_tokens} of the {total} tokens: "
                "LePE is not supported under context parallelism; run this model in one process, or convert without lepe"
            )
        if self.denominator != "paper":
            raise RuntimeError(
                f"denominator={self.denominator!r} pairs each query with the queries at its position in every other "
                f"block, but under context parallelism this rank holds only {num_tokens} of the {total} tokens: not "
                "supported under context parallelism; run this model in one process"
            )
        return shard


# -- creating a layer's MHLA ------------------------------------------------------------------------
def create_layer(attn: nn.Module, settings: spec.LayerSettings, family=None, *, init: str = "locality",
                 lepe_init: str = "zeros", requires_grad: bool = True) -> MHLALayer:
    """Give ``attn`` its :class:`MHLALayer` ``attn.mhla`` (fp32, on the layer's device) made to ``settings``.

    Raises:
        ValueError: a bad ``init`` / ``lepe_init``.
    """
    device = _home(attn)
    # The bare one-liner creates parameters at the first forward, often inside a pipeline's
    # torch.inference_mode() / no_grad(): build them as ordinary tensors anyway.
    with torch.inference_mode(False), torch.enable_grad():
        layer = MHLALayer(settings, heads=attn.heads, head_dim=_output_head_dim(attn), in_features=_input_dim(attn),
                          lepe_kernel=getattr(family, "lepe_kernel", (3, 3)), init=init, lepe_init=lepe_init)
        attn.add_module("mhla", layer.to(device).requires_grad_(requires_grad))
    return layer


def attach(processor, attn: nn.Module, reference_grid: Sequence[int] | None, *, init: str = "locality", family=None,
           requires_grad: bool = True, lepe_init: str = "zeros") -> MHLALayer:
    """The layer's MHLA: created from ``processor``'s settings (:func:`~mhla_diffusers.models.spec.resolve_settings`)
    if the layer has none, else checked against them (:func:`~mhla_diffusers.models.spec.check_layer`).

    Raises:
        ValueError: a contradiction between ``processor`` and the layer's record, naming both values.
    """
    family = family or processor.family
    layer = getattr(attn, "mhla", None)
    if layer is not None:
        spec.check_layer(processor, layer, reference_grid, family)
        return layer
    settings = spec.resolve_settings(processor, family, reference_grid)
    return create_layer(attn, settings, family, init=init, lepe_init=lepe_init, requires_grad=requires_grad)


def value_devices(tensor: torch.Tensor) -> set[torch.device]:
    """The devices holding ``tensor``'s values. A wrapper tensor subclass (optimum-quanto's and torchao's quantized
    weights) holds them in its inner tensors (``__tensor_flatten__``), whatever device it reports itself: a quanto
    weight loaded from a quantized checkpoint says ``meta`` while its int8 data and scales are on the CPU."""
    if is_traceable_wrapper_subclass(tensor):
        inner = [getattr(tensor, name, None) for name in tensor.__tensor_flatten__()[0]]
        inner = [t for t in inner if isinstance(t, torch.Tensor)]
        if inner:
            return set().union(*(value_devices(t) for t in inner))
    return {tensor.device}


def holds_values(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` has values: not on the meta device, nor (a wrapper subclass) any of its inner tensors."""
    return all(device.type != "meta" for device in value_devices(tensor))


def _home(attn: nn.Module) -> torch.device:
    """Where the attention module's weights hold their values (a quantized weight's inner tensors, not the device it
    reports); the first weight's device when none holds values (accelerate's offload keeps them on ``meta``)."""
    for param in attn.parameters():
        devices = {d for d in value_devices(param) if d.type != "meta"}
        if devices:
            return devices.pop()
    return next(attn.parameters()).device


def layer_requires_grad(attn) -> bool:
    """Whether the attention module's own projection weights are trainable (``to_q`` / ``to_k`` /
    ``to_v`` / fused ``to_qkv``; any of its parameters if it has none of these)."""
    weights = [getattr(getattr(attn, name, None), "weight", None) for name in ("to_q", "to_k", "to_v", "to_qkv")]
    weights = [w for w in weights if isinstance(w, torch.Tensor)] or list(attn.parameters())
    return any(w.requires_grad for w in weights)


def _input_dim(attn) -> int:
    """Channels of the tokens entering the layer (the query projection's input)."""
    for name in ("to_q", "to_qkv"):
        layer = getattr(attn, name, None)
        if layer is not None and hasattr(layer, "in_features"):
            return int(layer.in_features)
    return int(attn.query_dim)


def _output_head_dim(attn) -> int:
    """Channels per head of the attention output (the value head dim)."""
    to_v = getattr(attn, "to_v", None)
    if to_v is not None and hasattr(to_v, "out_features"):
        return to_v.out_features // attn.heads
    return attn.inner_dim // attn.heads
