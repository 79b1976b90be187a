"""The steps of one self-attention call that differ per model family (mixed into ``Family``).

:class:`~mhla_diffusers.MHLAProcessor` runs, for every self-attention call, ``split_arguments`` and
``check_arguments`` (what the family's stock processor accepts), ``tokens`` (``[B, N, C]``),
``project`` (q, k, v with the layer's own weights and q/k norms), ``feature_rotary`` (Wan's RoPE) and
``finish`` (the stock output path).
Each reads only the :class:`~mhla_diffusers.families.base.Family` fields, so a family is data.
"""

from __future__ import annotations

import inspect
from typing import Callable, NamedTuple

import torch

__all__ = ["FamilyAttention", "StockSignature"]


class StockSignature:
    """What a stock self-attention processor's ``__call__`` accepts after ``attn`` (read from its signature)."""

    def __init__(self, processor):
        params = list(inspect.signature(processor.__call__).parameters.values())[1:]  # after attn
        kinds = inspect.Parameter
        self.owner = type(processor).__name__
        self.positional = tuple(p.name for p in params if p.kind in (kinds.POSITIONAL_ONLY, kinds.POSITIONAL_OR_KEYWORD))
        self.keywords = frozenset(p.name for p in params if p.kind in (kinds.POSITIONAL_OR_KEYWORD, kinds.KEYWORD_ONLY))
        self.var_positional = any(p.kind == kinds.VAR_POSITIONAL for p in params)
        self.var_keyword = any(p.kind == kinds.VAR_KEYWORD for p in params)


class CallInput(NamedTuple):
    """What :meth:`FamilyAttention.finish` needs of the layer's input: the residual, the input dtype
    and, for legacy 4-D inputs, ``(B, C, H, W)``."""

    residual: torch.Tensor
    dtype: torch.dtype
    image_shape: tuple[int, int, int, int] | None


class FamilyAttention:
    """Per-call steps of a self-attention layer of one family (a mixin of the ``Family`` dataclass)."""

    qk_norm_across_heads: bool
    attention_output_dtype: str
    fp16_output_clip: float | None
    processor_call: str
    rotary: Callable | None
    rotary_required: bool
    empty_blocks: bool
    stock_signature: StockSignature

    def split_arguments(self, args: tuple, temb, rotary_emb) -> tuple[object, object, tuple]:
        """A fifth positional argument is ``rotary_emb`` for a positional call (Wan), else ``temb``.

        Returns ``(temb, rotary_emb, remaining args)``. Raises ``TypeError`` for ``rotary_emb`` given twice.
        """
        if not args:
            return temb, rotary_emb, args
        if self.processor_call == "positional":
            if rotary_emb is not None:
                raise TypeError("rotary_emb was given both positionally and by keyword")
            return temb, args[0], args[1:]
        if temb is None:
            return args[0], rotary_emb, args[1:]
        return temb, rotary_emb, args

    def check_arguments(self, args: tuple, kwargs: dict, **named) -> None:
        """Refuse what the family's stock self-attention processor would refuse.

        ``args``: the positional arguments after ``attention_mask``; ``kwargs``: the other keywords;
        ``named``: ``temb`` / ``rotary_emb`` (``None`` = not given). DiT's ``AttnProcessor2_0`` takes
        anything; SANA's and Wan's take a fixed list.

        Raises:
            TypeError: as Python's own for the stock ``__call__``: too many positional arguments, an
                unexpected keyword, or one argument given twice.
        """
        signature = self.stock_signature
        given = 3 + len(args)  # hidden_states, encoder_hidden_states, attention_mask, *args
        where = f"{signature.owner}.__call__ (MHLAProcessor takes what this layer's stock processor takes)"
        if given > len(signature.positional) and not signature.var_positional:
            raise TypeError(f"{where} takes {len(signature.positional)} positional arguments after attn but {given} were given")
        for name in list(kwargs) + [name for name, value in named.items() if value is not None]:
            if name not in signature.keywords and not signature.var_keyword:
                raise TypeError(f"{where} got an unexpected keyword argument {name!r}")
            if name in signature.positional[:given]:
                raise TypeError(f"{where} got multiple values for argument {name!r}")

    def tokens(self, attn, hidden_states: torch.Tensor, temb) -> tuple[torch.Tensor, CallInput]:
        """The layer input as ``[B, N, C]`` tokens (legacy ``Attention``: spatial norm, 4-D input, group norm)."""
        call = CallInput(hidden_states, hidden_states.dtype, None)
        if getattr(attn, "spatial_norm", None) is not None:
            hidden_states = attn.spatial_norm(hidden_states, temb)
        if hidden_states.ndim == 4:
            batch, channel, height, width = hidden_states.shape
            call = call._replace(image_shape=(batch, channel, height, width))
            hidden_states = hidden_states.view(batch, channel, height * width).transpose(1, 2)
        if getattr(attn, "group_norm", None) is not None:
            hidden_states = attn.group_norm(hidden_states.transpose(1, 2)).transpose(1, 2)
        return hidden_states, call

    def project(self, attn, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``[B, N, C]`` -> query, key ``[B, heads, N, d]`` and value ``[B, heads, N, dv]``: the layer's own
        projections (fused ``to_qkv`` included) and q/k norms where its stock processor applies them."""
        if getattr(attn, "fused_projections", False) and hasattr(attn, "to_qkv"):
            query, key, value = attn.to_qkv(hidden_states).chunk(3, dim=-1)
        else:
            query, key, value = attn.to_q(hidden_states), attn.to_k(hidden_states), attn.to_v(hidden_states)
        if self.qk_norm_across_heads:  # SANA, Wan: over all heads, before the head split
            query, key = _qk_norm(attn, query, key)
        batch, heads = hidden_states.shape[0], attn.heads
        query = query.view(batch, -1, heads, key.shape[-1] // heads).transpose(1, 2)
        key = key.view(batch, -1, heads, key.shape[-1] // heads).transpose(1, 2)
        value = value.view(batch, -1, heads, value.shape[-1] // heads).transpose(1, 2)
        if not self.qk_norm_across_heads:
            query, key = _qk_norm(attn, query, key)
        return query, key, value

    def feature_rotary(self, rotary_emb) -> Callable[[torch.Tensor], torch.Tensor] | None:
        """The map rotating ``phi(q)``, ``phi(k)`` ``[B, heads, N, d]`` (Wan), or ``None`` without ``rotary_emb``.

        Raises:
            ValueError: a rotary embedding for a family without RoPE; none for a family whose stock layer needs one.
        """
        if rotary_emb is None:
            if self.rotary_required:
                raise ValueError(
                    f"this {self.title} self-attention was called without rotary_emb, which its stock processor needs too: "
                    "call it inside its transformer (which passes model.rope(latent)), pass rotary_emb=, or build the "
                    "processor with rope='none' to compute MHLA without RoPE"
                )
            return None
        if self.rotary is None:
            raise ValueError(
                f"a rotary embedding was passed but the model family {self.name or None!r} has no RoPE handling in MHLA"
            )
        return self.rotary(rotary_emb)

    def finish(self, attn, hidden_states: torch.Tensor, call: CallInput, dtype: torch.dtype) -> torch.Tensor:
        """Attention output ``[B, heads, N, dv]`` -> the layer output, as the stock processor returns it:
        cast (to ``dtype``, the query's, or the input's), ``to_out``, SANA's float16 clip, the legacy
        4-D shape, residual and rescale."""
        batch, _, num_tokens, _ = hidden_states.shape
        out_dtype = call.dtype if self.attention_output_dtype == "input" else dtype
        hidden_states = hidden_states.transpose(1, 2).reshape(batch, num_tokens, -1).to(out_dtype)
        hidden_states = attn.to_out[1](attn.to_out[0](hidden_states))
        if self.fp16_output_clip is not None and call.dtype == torch.float16:
            hidden_states = hidden_states.clip(-self.fp16_output_clip, self.fp16_output_clip)
        if call.image_shape is not None:
            hidden_states = hidden_states.transpose(-1, -2).reshape(call.image_shape)
        if getattr(attn, "residual_connection", False):
            hidden_states = hidden_states + call.residual
        rescale = getattr(attn, "rescale_output_factor", 1.0)
        return hidden_states if rescale == 1.0 else hidden_states / rescale


def _qk_norm(attn, query: torch.Tensor, key: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    if getattr(attn, "norm_q", None) is not None:
        query = attn.norm_q(query)
    if getattr(attn, "norm_k", None) is not None:
        key = attn.norm_k(key)
    return query, key
