"""``MHLAProcessor``: a diffusers attention processor computing self-attention with MHLA (paper Sec. 3.2).

A call reads like the equation: the family projects q, k, v with the layer's own weights; MHLA mixes
the block summaries of the call's token grid with the layer's matrix; the family finishes the output
as its stock processor does. Installing (settings, block grid, per-layer state) lives in
:mod:`~mhla_diffusers.models.spec`, :mod:`~mhla_diffusers.models.layer_state` and, for the bare
one-liner, :mod:`~mhla_diffusers.models.lazy`.
"""

from __future__ import annotations

import math
from typing import Sequence

import torch
from torch import nn

from mhla_diffusers.models import layer_state, lazy, spec
from mhla_diffusers.models.families import GENERIC, attention_family, find_family, get_family
from mhla_diffusers.models.grid import GridReader, await_model, current_model, grid_of_call
from mhla_diffusers.models.layer_state import LePE, OutputGate, OutputRMSNorm
from mhla_diffusers.models.lazy import materialize_mhla, pending_mhla_layers
from mhla_diffusers.models.parallel import context_shard, sharded_mhla_attention
from mhla_diffusers.ops import mhla_attention
from mhla_diffusers.ops.layout import get_layout, occupied_layout
from mhla_diffusers.ops.mixing import MixingMatrix

__all__ = [
    "MHLAProcessor",
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
    (matrices at the first forward, or ``materialize_mhla``). One processor may serve many layers; each
    keeps its own ``mhla_mixing`` / ``mhla_output_norm`` / ``mhla_gate`` / ``mhla_lepe``. ``M = 1`` is plain
    linear attention. An ``nn.Module`` without parameters. The contract: ``docs/processor.md``.
    """

    _attention_backend = None  # set by diffusers' set_attention_backend; forwarded to the stock processors
    # the settings added with checkpoint format 2, at their defaults for processors pickled before they existed
    feature_power, rope, gate, lepe, input_norm, denominator = 1.0, None, None, None, None, "paper"

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
        *,
        feature_power: float = 1.0,
        rope: str | None = None,
        gate: bool | str | None = None,
        lepe: bool | None = None,
        input_norm: bool | None = None,
        denominator: str = "paper",
    ):
        """Args:
            num_blocks: target ``M`` without ``block_grid`` (``None``: family default, Wan 105, else ``round(sqrt(N) / 2)``).
            block_grid: ``(bt, bh, bw)`` / ``(bh, bw)`` or a family preset; fixed per layer, stretched at other sizes.
            normalize: divide by ``phi(q) . z~ + eps`` (the paper's form) or numerator only.
            eps: denominator epsilon (``None``: the family's, DiT / Wan 1e-6, SANA 1e-15).
            backend: ``"auto"`` or one of :func:`~mhla_diffusers.available_backends`.
            family: for attention modules called outside their transformer (``None``: the running one's).
            output_norm: per-head RMSNorm on the output (``None``: Wan when ``normalize=False``).
            feature_eps: ``phi(x) = ReLU(x) ** feature_power + feature_eps``.
            feature_power: ``p`` of ``phi = ReLU(x) ** p`` (1: ReLU).
            rope: families with RoPE (Wan): ``"after"`` the feature map, numerator only (``None``: the default),
                ``"before"`` it (q, k rotated, then phi), ``"none"``; a family without RoPE takes ``None`` / ``"none"``.
            gate: output gate from the layer's input tokens: ``"neutral"`` (``True``; ``out * 2 sigmoid(W x + b)``,
                zero start) or ``"authors"`` (``out * SiLU(W x + b)``); ``False``: none; ``None``: the layer's (none fresh).
            lepe: a depthwise convolution of the values over the token grid added to the output (``None``: the layer's).
            input_norm: a LayerNorm (``mhla_input_norm``) on the tokens entering q, k, v, gate and LePE, as the
                authors' DiT layer has (``None``: the layer's; none at a fresh install). For imported weights.
            denominator: ``"paper"`` (``phi(q) . z~``) or ``"authors_dit"``, the authors' DiT layer's normaliser
                (:mod:`~mhla_diffusers.ops.positional`; needs the normaliser and blocks of equal size).

        Raises:
            ValueError: bad ``num_blocks``, ``block_grid``, ``eps``, ``feature_eps``, ``feature_power``, ``rope``,
                ``gate``, ``lepe``, ``input_norm``, ``denominator`` or ``backend``; unknown preset; ``num_blocks``
                contradicting ``block_grid``.
        """
        super().__init__()
        settings = spec.check_settings(
            num_blocks, block_grid, normalize, eps, backend, feature_eps, feature_power=feature_power, rope=rope,
            gate=gate, lepe=lepe, input_norm=input_norm, denominator=denominator,
        )
        self.num_blocks, self.block_grid = settings["num_blocks"], settings["block_grid"]
        self.block_grid_preset, self.normalize = settings["block_grid_preset"], settings["normalize"]
        self.eps, self.backend, self.feature_eps = settings["eps"], settings["backend"], settings["feature_eps"]
        self.feature_power, self.rope = settings["feature_power"], settings["rope"]
        self.gate, self.lepe = settings["gate"], settings["lepe"]
        self.input_norm, self.denominator = settings["input_norm"], settings["denominator"]
        self.family = None if family is None else get_family(family)
        self.output_norm = None if output_norm is None else bool(output_norm)
        self._stock: dict[str, object] = {}
        self._told_block_grids: set = set()  # (reference grid, block grid) already warned about
        lazy.track_processor(self)

    def __setstate__(self, state):  # unpickled or deep-copied (with its model): live, and waiting for that model
        super().__setstate__(state)
        lazy.track_processor(self)
        await_model(self)

    def __repr__(self) -> str:
        grid = repr(self.block_grid_preset) if self.block_grid_preset is not None else self.block_grid
        return (
            f"MHLAProcessor(num_blocks={self.num_blocks}, block_grid={grid}, "
            f"normalize={self.normalize}, eps={self.eps}, backend={self.backend!r}"
            + ("" if self.output_norm is None else f", output_norm={self.output_norm}")
            + ("" if not self.feature_eps else f", feature_eps={self.feature_eps}")
            + ("" if self.feature_power == 1.0 else f", feature_power={self.feature_power}")
            + ("" if self.rope is None else f", rope={self.rope!r}")
            + ("" if self.gate is None else f", gate={self.gate!r}")
            + ("" if self.lepe is None else f", lepe={self.lepe}")
            + ("" if self.input_norm is None else f", input_norm={self.input_norm}")
            + ("" if self.denominator == "paper" else f", denominator={self.denominator!r}")
            + ("" if self.family is None else f", family={self.family.name!r}")
            + ")"
        )

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
            ValueError: an attention mask on self-attention; a rotary embedding for a family without RoPE.
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

        tokens, call = family.tokens(attn, hidden_states, temb)  # [B, N, C]
        tokens = self._input_norm(attn, tokens)  # the authors' DiT layer normalises its input first
        mixing = self._mixing(attn)  # before any computation: refused outside a supported transformer
        grid = grid_of_call(mixing, tokens.shape[1])
        shard = self._shard(attn, tokens.shape[1], grid)  # None unless under context parallelism
        query, key, value = family.project(attn, tokens)  # [B, heads, N, d]
        query, key, rotary = self._rope(family, query, key, rotary_emb)  # Wan: RoPE after the feature map by default
        layout, weight = family.blocks(mixing, grid)  # the layer's M x M matrix on this call's blocks
        hidden_states = self._mhla(attn, query, key, value, weight, layout, family, shard, rotary, rotary_emb)
        hidden_states = self._gate_and_lepe(attn, hidden_states, tokens, value, grid)
        return family.finish(attn, hidden_states, call, query.dtype)

    @staticmethod
    def _input_norm(attn, tokens: torch.Tensor) -> torch.Tensor:
        """``tokens`` through the layer's ``mhla_input_norm`` (a LayerNorm, computed in fp32), if it has one."""
        norm = getattr(attn, "mhla_input_norm", None)
        return tokens if norm is None else norm(tokens)

    def _rope(self, family, query, key, rotary_emb):
        """``(query, key, rotary)``: ``rope="after"`` (default) gives the map rotating ``phi(q)``, ``phi(k)`` in the
        numerator; ``"before"`` rotates q and k now (no rotary for the operator); ``"none"`` drops the RoPE."""
        if self.rope == "none":
            return query, key, None
        rotary = family.feature_rotary(rotary_emb)
        if rotary is not None and self.rope == "before":
            return rotary(query), rotary(key), None
        return query, key, rotary

    def _mhla(self, attn, query, key, value, weight, layout, family, shard, rotary, rotary_emb) -> torch.Tensor:
        """``[B, heads, N, dv]``: MHLA (paper Eq. 6-7) on this call's blocks, then the output norm if any."""
        norm = getattr(attn, "mhla_output_norm", None)
        if norm is not None and query.dtype in (torch.float16, torch.bfloat16):
            query = query.float()  # the un-normalised numerator can exceed the float16 range: keep it in fp32
        options = dict(normalize=self.normalize, eps=family.default_eps if self.eps is None else self.eps,
                       feature_eps=self.feature_eps, feature_power=self.feature_power, backend=self.backend)
        if self.denominator != "paper":  # the keyword only where set: the sharded path has the paper's alone
            options["denominator"] = self.denominator
        if rotary is not None:
            options["rotary"] = rotary
        if shard is None:
            out = mhla_attention(query, key, value, weight, layout, **options)
        else:  # this rank's tokens: one exchange over the context-parallel group (models/parallel.py)
            out = sharded_mhla_attention(query, key, value, weight, layout, shard, rotary_key=rotary_emb, **options)
        return out if norm is None else norm(out)

    @staticmethod
    def _gate_and_lepe(attn, out, tokens, value, grid) -> torch.Tensor:
        """The authors' order after the output norm: ``out * gate(x)`` (``mhla_gate``), then ``+ lepe(v)`` (``mhla_lepe``)."""
        gate = getattr(attn, "mhla_gate", None)
        if gate is not None:
            out = gate(out, tokens)
        lepe = getattr(attn, "mhla_lepe", None)
        if lepe is not None:
            out = out + lepe(value, grid)
        return out

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

    def _mixing(self, attn) -> MixingMatrix:
        """The layer's mixing matrix; created now for the bare one-liner, checked once after a processor change."""
        mixing = getattr(attn, "mhla_mixing", None)
        if mixing is None:
            return lazy.mixing_at_first_forward(self, attn)
        if not getattr(mixing, "verified", False):
            model = current_model()
            running = None if model is None else find_family(model)
            reference = None if running is None else running.reference_grid(model.config)
            spec.check_layer(self, attn, reference, running or self.family or attention_family(attn))
            if not torch.compiler.is_compiling():
                mixing.verified = True
        return mixing

    def _shard(self, attn, num_tokens: int, grid: tuple[int, int, int]):
        """This rank's shard under context parallelism, ``None`` when the call holds every token of the grid."""
        total = math.prod(grid)
        if num_tokens == total:
            return None
        shard = context_shard(num_tokens, total, attn.heads)
        if shard is None and num_tokens != total:
            raise RuntimeError(
                f"the token grid {grid} of this forward has {total} tokens but the "
                f"self-attention received {num_tokens}; MHLA only supports layers that attend over the latent grid"
            )
        if getattr(attn, "mhla_lepe", None) is not None:
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

    def resolve_output_norm(self, family=None) -> bool:
        """:func:`~mhla_diffusers.models.spec.resolve_output_norm` for this processor."""
        return spec.resolve_output_norm(self, family)

    def check_layer(self, attn: nn.Module, reference_grid: Sequence[int] | None = None, family=None) -> None:
        """:func:`~mhla_diffusers.models.spec.check_layer` for this processor (``ValueError`` on a contradiction)."""
        spec.check_layer(self, attn, reference_grid, family)

    def attach(self, attn: nn.Module, reference_grid: Sequence[int], init: str = "locality", family=None,
               requires_grad: bool = True, lepe_init: str = "zeros") -> MixingMatrix:
        """:func:`~mhla_diffusers.models.layer_state.attach`: the layer's matrix (and gate, LePE), created or checked."""
        return layer_state.attach(self, attn, reference_grid, init=init, family=family, requires_grad=requires_grad,
                                  lepe_init=lepe_init)


@torch.compiler.disable  # first call under torch.compile: built outside the graph, then read from the cache
def _make_stock_processor(cache: dict, key: str, family):
    stock = cache[key] = family.make_stock_cross_processor()
    return stock
