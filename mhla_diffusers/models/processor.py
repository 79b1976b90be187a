"""``MHLAProcessor``: a diffusers attention processor computing self-attention with MHLA (paper Sec. 3.2).

A call reads like the equation: the family projects q, k, v with the layer's own weights; the layer's
MHLA mixes the block summaries of the call's token grid with its matrix; the family finishes the output
as its stock processor does. The layer's own module, ``attn.mhla`` (:mod:`~mhla_diffusers.models.layer`),
holds what it computes; settings and their checks live in :mod:`~mhla_diffusers.models.spec`, the bare
one-liner's late creation in :mod:`~mhla_diffusers.models.lazy`.
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch import nn

from mhla_diffusers.families import GENERIC, attention_family, find_family, get_family
from mhla_diffusers.models import lazy, spec
from mhla_diffusers.models.grid import GridReader, await_model, current_model, grid_of_call
from mhla_diffusers.models.layer import MHLALayer, attach
from mhla_diffusers.models.layer_parts import LePE, OutputGate, OutputRMSNorm
from mhla_diffusers.models.lazy import materialize_mhla, pending_mhla_layers
from mhla_diffusers.ops.layout import get_layout, occupied_layout

__all__ = [
    "MHLAProcessor",
    "MHLALayer",
    "OutputRMSNorm",
    "OutputGate",
    "LePE",
    "get_layout",
    "occupied_layout",
    "pending_mhla_layers",
    "materialize_mhla",
]


class MHLAProcessor(GridReader, nn.Module):
    """Attention processor: MHLA (paper Sec. 3.2) on self-attention, the family's stock processor, unchanged, on cross-attention.

    Install with ``mhla_diffusers.apply_mhla(transformer)`` or ``transformer.set_attn_processor(MHLAProcessor())``
    (layers made at the first forward, or ``materialize_mhla``). A layer's MHLA is its own module, ``attn.mhla``
    (:class:`~mhla_diffusers.models.layer.MHLALayer`: settings, mixing matrix, output norm, gate, LePE), which the
    processor runs as recorded; one processor may serve many layers. Settings given here are the defaults of
    layers that have no MHLA yet; over a layer that has, a given setting must agree with its record. ``M = 1``
    is plain linear attention. An ``nn.Module`` without parameters. The contract: ``docs/processor.md``.
    """

    _attention_backend = None  # set by diffusers' set_attention_backend; forwarded to the stock processors

    def __init__(
        self,
        num_blocks: int | None = None,
        block_grid: Sequence[int] | str | None = None,
        normalize: bool | None = None,
        eps: float | None = None,
        backend: str = "auto",
        family: str | None = None,
        output_norm: bool | None = None,
        feature_eps: float | None = None,
        *,
        feature_power: float | None = None,
        rope: str | None = None,
        gate: bool | str | None = None,
        lepe: bool | None = None,
        input_norm: bool | None = None,
        denominator: str | None = None,
        mixing_clamp: bool | None = None,
    ):
        """Each setting ``None`` (the default) is the layer's: as recorded on a layer with MHLA, the default below
        for a layer without. Given, it is what a new layer gets and must agree with an existing layer's record.

        Args:
            num_blocks: target ``M`` without ``block_grid`` (fresh: family default, Wan 105, else ``round(sqrt(N) / 2)``).
            block_grid: ``(bt, bh, bw)`` / ``(bh, bw)`` or a family preset; fixed per layer, stretched at other sizes.
            normalize: divide by ``phi(q) . z~ + eps`` (the paper's form; fresh: ``True``) or numerator only.
            eps: denominator epsilon (fresh: the family's, DiT / Wan 1e-6, SANA 1e-15).
            backend: ``"auto"`` or one of :func:`~mhla_diffusers.available_backends`: how this processor runs its
                layers (a run-time choice, not a layer setting: every backend gives the same numbers).
            family: for attention modules called outside their transformer (``None``: the running one's).
            output_norm: per-head RMSNorm on the output (fresh: on for Wan with ``normalize=False``, else off).
            feature_eps: ``phi(x) = ReLU(x) ** feature_power + feature_eps`` (fresh: 0).
            feature_power: ``p`` of ``phi = ReLU(x) ** p`` (fresh: 1, ReLU).
            rope: families with RoPE (Wan): ``"after"`` the feature map, numerator only (fresh), ``"before"`` it
                (q, k rotated, then phi), ``"none"``; a family without RoPE takes ``None`` / ``"none"``.
            gate: output gate from the layer's input tokens: ``"neutral"`` (``True``; ``out * 2 sigmoid(W x + b)``,
                zero start) or ``"authors"`` (``out * SiLU(W x + b)``); ``False``: none (fresh).
            lepe: a depthwise convolution of the values over the token grid added to the output (fresh: none).
            input_norm: a LayerNorm (``attn.mhla.input_norm``) on the tokens entering q, k, v, gate and LePE, as the
                authors' DiT layer has (fresh: none). For imported weights.
            denominator: ``"paper"`` (``phi(q) . z~``; fresh) or ``"authors_dit"``, the authors' DiT layer's
                normaliser (:mod:`~mhla_diffusers.ops.positional`; needs the normaliser and blocks of equal size).
            mixing_clamp: the mixing matrix used clamped to ``[0, 1]`` (fresh) or as stored.

        Raises:
            ValueError: a bad value of any setting; unknown preset; ``num_blocks`` contradicting ``block_grid``.
        """
        super().__init__()
        settings = spec.check_settings(
            num_blocks, block_grid, normalize, eps, backend, feature_eps, feature_power=feature_power, rope=rope,
            gate=gate, lepe=lepe, input_norm=input_norm, denominator=denominator, mixing_clamp=mixing_clamp,
            output_norm=output_norm,
        )
        for name, value in settings.items():
            setattr(self, name, value)
        self.family = None if family is None else get_family(family)
        self._stock: dict[str, object] = {}
        self._told_block_grids: set = set()  # (reference grid, block grid) already warned about
        lazy.track_processor(self)

    def __setstate__(self, state):  # unpickled or deep-copied (with its model): live, and waiting for that model
        super().__setstate__(state)
        lazy.track_processor(self)
        await_model(self)

    def __repr__(self) -> str:
        names = ("num_blocks", "block_grid", "normalize", "eps", "backend", "output_norm", "feature_eps", "feature_power",
                 "rope", "gate", "lepe", "input_norm", "denominator", "mixing_clamp", "family")
        shown = {name: getattr(self, name) for name in names}
        shown["block_grid"] = self.block_grid_preset or self.block_grid
        shown["backend"] = None if self.backend == "auto" else self.backend
        shown["family"] = None if self.family is None else self.family.name
        return "MHLAProcessor(" + ", ".join(f"{k}={v!r}" for k, v in shown.items() if v is not None) + ")"

    # -- the computation ---------------------------------------------------------------------------
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
        """Run the layer on ``hidden_states`` ``[B, N, C]`` (or legacy ``[B, C, H, W]``), taking what the stock processor takes.

        Returns:
            The layer output, shaped and typed as the stock processor's.

        Raises:
            RuntimeError: unknown or mismatched token grid; ``family`` contradicting the transformer; unsupported class.
            ValueError: an attention mask on self-attention; a rotary embedding for a family without RoPE; a setting
                contradicting the layer's MHLA.
            TypeError: an argument the stock processor would refuse.
        """
        family = self._family(attn)
        cross = encoder_hidden_states is not None or getattr(attn, "is_cross_attention", False)
        if not cross:
            family.check_arguments(args, kwargs, temb=temb, rotary_emb=rotary_emb)
        temb, rotary_emb, args = family.split_arguments(args, temb, rotary_emb)
        if cross:
            return self._stock_call(family, attn, hidden_states, encoder_hidden_states, attention_mask, temb, rotary_emb, args, kwargs)
        if attention_mask is not None:
            raise ValueError("MHLA self-attention takes no attention mask; remove MHLA from this layer or drop the mask")

        mhla = self._layer(attn)  # attn.mhla: before any computation (refused outside a supported transformer)
        tokens, call = family.tokens(attn, hidden_states, temb)  # [B, N, C]
        tokens = mhla.norm_input(tokens)  # the authors' DiT layer normalises its input first
        grid = grid_of_call(mhla, tokens.shape[1])
        query, key, value = family.project(attn, tokens)  # [B, heads, N, d]
        hidden_states = mhla(query, key, value, grid, tokens=tokens, rotary_emb=rotary_emb, family=family, backend=self.backend)
        return family.finish(attn, hidden_states, call, query.dtype)

    # -- what a call needs, looked up -------------------------------------------------------------
    def _family(self, attn):
        """The family whose stock behaviour this call follows: explicit, else the running model's, else
        the attention module class's (``WanAttention``), else diffusers' generic behaviour."""
        model = current_model()
        running = None if model is None else find_family(model)
        if self.family is None:
            return running or attention_family(attn) or GENERIC
        if running is not None and running is not self.family:
            raise RuntimeError(
                f"this MHLAProcessor was built with family={self.family.name!r} but runs inside a "
                f"{type(model).__name__} ({running.name}); build it without family= inside transformers"
            )
        return self.family

    def _layer(self, attn) -> MHLALayer:
        """The layer's MHLA; created now for the bare one-liner, checked against this processor once after a change."""
        layer = getattr(attn, "mhla", None)
        if layer is None:
            return lazy.layer_at_first_forward(self, attn)
        if not layer.verified:
            model = current_model()
            running = None if model is None else find_family(model)
            reference = None if running is None else running.reference_grid(model.config)
            family = running or self.family or attention_family(attn)
            if layer.unsettled and family is not None:
                layer.settle(spec.resolve_settings(self, family, reference, block_grid=layer.mixing.block_grid))
            spec.check_layer(self, layer, reference, family)
            if not torch.compiler.is_compiling():
                layer.verified = True
        return layer

    def _stock_processor(self, family):
        key = "" if family is None else family.name
        stock = self._stock.get(key)
        if stock is None:
            stock = _make_stock_processor(self._stock, key, family or GENERIC)
        if hasattr(stock, "_attention_backend"):
            stock._attention_backend = self._attention_backend
        return stock

    def _stock_call(self, family, attn, hidden_states, encoder_hidden_states, attention_mask, temb, rotary_emb, args, kwargs):
        """The family's stock cross-attention processor on the very same arguments, in the same convention."""
        stock = self._stock_processor(family)
        if family.processor_call == "positional":
            return stock(attn, hidden_states, encoder_hidden_states, attention_mask, rotary_emb, *args, **kwargs)
        if args:
            return stock(attn, hidden_states, encoder_hidden_states, attention_mask, temb, *args, **kwargs)
        if temb is not None:  # only AttnProcessor2_0-like processors take it; SANA's never receive one
            kwargs = {"temb": temb, **kwargs}
        return stock(attn, hidden_states, encoder_hidden_states=encoder_hidden_states, attention_mask=attention_mask, **kwargs)

    # -- install-time, for callers (apply_mhla, conversion, tests) ----------------------------------
    def resolve_block_grid(self, reference_grid: Sequence[int], family=None) -> tuple[int, int, int]:
        """:func:`~mhla_diffusers.models.spec.resolve_block_grid` for this processor."""
        return spec.resolve_block_grid(self, reference_grid, family)

    def attach(self, attn: nn.Module, reference_grid: Sequence[int] | None, init: str = "locality", family=None,
               requires_grad: bool = True, lepe_init: str = "zeros") -> MHLALayer:
        """:func:`~mhla_diffusers.models.layer.attach`: the layer's MHLA, created from this processor or checked against it."""
        return attach(self, attn, reference_grid, init=init, family=family, requires_grad=requires_grad, lepe_init=lepe_init)


@torch.compiler.disable  # first call under torch.compile: built outside the graph, then read from the cache
def _make_stock_processor(cache: dict, key: str, family):
    stock = cache[key] = family.make_stock_cross_processor()
    return stock
