"""``MHLAProcessor``: a diffusers attention processor computing self-attention with MHLA.

Reads top to bottom like the math: project q, k, v with the layer's own weights, split heads,
apply the layer's q/k norms, run :func:`~mhla_diffusers.mhla_attention` over the blocks of the
current token grid with the layer's own mixing matrix, project out.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Sequence

import torch

from .grid import current_grid, current_model, ensure_global_hook
from .layout import BlockLayout, choose_block_grid, normalize_grid
from .mixing import MixingMatrix
from .ops import available_backends, mhla_attention

__all__ = ["MHLAProcessor", "get_layout"]


@lru_cache(maxsize=128)
def get_layout(grid: tuple[int, int, int], block_grid: tuple[int, int, int]) -> BlockLayout:
    """Cached :class:`BlockLayout` (its index tensors are cached per device inside)."""
    return BlockLayout(grid, block_grid)


class MHLAProcessor:
    """Attention processor that runs MHLA on self-attention layers (MHLA paper, Sec. 3.2).

    Install with ``mhla_diffusers.apply_mhla(transformer, ...)`` (self-attention layers only,
    mixing matrices created eagerly), the one-liner ``transformer.set_attn_processor(MHLAProcessor())``
    (models that have the method: SANA), or ``mhla_diffusers.set_attn_processor(transformer,
    MHLAProcessor())`` (every model, DiT included; creates the mixing matrices now).
    One processor object may serve many layers: each layer keeps its own mixing matrix, as the
    submodule ``<attention module>.mhla_mixing`` (in ``state_dict()``, following ``.to()``).

    What it computes follows the model family's stock self-attention processor everywhere but the
    attention itself (see :class:`~mhla_diffusers.families.Family`): the layer's own projections,
    its q/k norms where the stock processor applies them (SANA: over all heads, before the head
    split), the stock output dtype and path (SANA: ``to_out`` then the +-65504 clip for float16
    inputs), and the family's eps (SANA 1e-15). With one block (``M = 1``) it is the plain linear
    attention of the paper, i.e. on SANA the stock ``SanaLinearAttnProcessor2_0`` up to float
    summation order. On a cross-attention call (``encoder_hidden_states`` given, or a layer built
    for cross-attention) it runs the family's stock processor unchanged, bit for bit (SANA
    ``SanaAttnProcessor2_0``; others ``AttnProcessor2_0``).

    Args:
        num_blocks: target number of blocks ``M`` when ``block_grid`` is not given; the block grid
            is chosen once per layer from the model's native token grid by
            :func:`~mhla_diffusers.choose_block_grid` (``None``: ``round(sqrt(N) / 2)``).
        block_grid: explicit ``(bt, bh, bw)`` (or ``(bh, bw)``). The block grid is fixed per layer;
            at another resolution the blocks stretch with the image.
        normalize: divide by ``phi(q) . z~ + eps`` (the paper's form) or not.
        eps: denominator epsilon; ``None`` takes the model family's default (DiT 1e-6, SANA 1e-15).
        backend: operator backend, ``"auto"`` or one of :func:`~mhla_diffusers.available_backends`.
        family: model family (``"dit"``, ``"sana"``) whose stock behaviour to follow. ``None``
            (default): the family of the transformer running the layer. Give it only to call
            attention modules directly, outside their transformer (with
            :func:`~mhla_diffusers.token_grid`); there, without it, the generic behaviour applies
            (``AttnProcessor2_0`` for cross-attention, no clip, eps 1e-6).

    Raises (at call time):
        RuntimeError: when the token grid of the call is unknown (no hook published it), or does
            not match the number of tokens; when ``family`` contradicts the running transformer.
        ValueError: when an attention mask is passed to a self-attention layer (MHLA has none).
    """

    def __init__(
        self,
        num_blocks: int | None = None,
        block_grid: Sequence[int] | None = None,
        normalize: bool = True,
        eps: float | None = None,
        backend: str = "auto",
        family: str | None = None,
    ):
        from .families import get_family

        if num_blocks is not None and (isinstance(num_blocks, bool) or int(num_blocks) != num_blocks or num_blocks < 1):
            raise ValueError(f"num_blocks must be a positive integer or None; got {num_blocks!r}")
        self.block_grid = None if block_grid is None else normalize_grid(tuple(block_grid), "block_grid")
        if self.block_grid is not None and num_blocks is not None:
            m = self.block_grid[0] * self.block_grid[1] * self.block_grid[2]
            if m != num_blocks:
                raise ValueError(f"num_blocks={num_blocks} contradicts block_grid={self.block_grid} ({m} blocks); give one of them")
        self.num_blocks = None if num_blocks is None else int(num_blocks)
        self.normalize = bool(normalize)
        if eps is not None and not eps >= 0:
            raise ValueError(f"eps must be >= 0; got {eps}")
        self.eps = eps
        if backend != "auto" and backend not in available_backends():
            raise ValueError(f"unknown backend {backend!r}; choose 'auto' or one of {available_backends()}")
        self.backend = backend
        self.family = None if family is None else get_family(family)
        self._stock: dict[str, object] = {}
        ensure_global_hook()

    def __repr__(self) -> str:
        return (
            f"MHLAProcessor(num_blocks={self.num_blocks}, block_grid={self.block_grid}, "
            f"normalize={self.normalize}, eps={self.eps}, backend={self.backend!r}"
            + ("" if self.family is None else f", family={self.family.name!r}")
            + ")"
        )

    # -- per-layer state --------------------------------------------------------------------------
    def resolve_block_grid(self, reference_grid: Sequence[int]) -> tuple[int, int, int]:
        """The block grid this processor gives a layer of a model whose native token grid is ``reference_grid``."""
        return self.block_grid or choose_block_grid(reference_grid, self.num_blocks)

    def attach(self, attn: torch.nn.Module, reference_grid: Sequence[int], init: str = "locality") -> MixingMatrix:
        """Create the layer's mixing matrix (fp32, on the layer's device) if it has none; return it.

        Raises:
            ValueError: the layer already has a mixing matrix whose block grid contradicts this
                processor's explicit ``block_grid`` / ``num_blocks``.
        """
        mixing = getattr(attn, "mhla_mixing", None)
        if mixing is None:
            device = next(attn.parameters()).device
            mixing = MixingMatrix(self.resolve_block_grid(reference_grid), init=init).to(device)
            attn.add_module("mhla_mixing", mixing)
        elif (self.block_grid is not None and mixing.block_grid != self.block_grid) or (
            self.block_grid is None and self.num_blocks is not None and mixing.num_blocks != self.num_blocks
        ):
            asked = self.block_grid or f"num_blocks={self.num_blocks}"
            raise ValueError(
                f"this layer already has a mixing matrix for block grid {mixing.block_grid}, but the processor asks "
                f"for {asked}; call mhla_diffusers.remove_mhla(model) first to change the number of blocks"
            )
        return mixing

    def _mixing(self, attn) -> MixingMatrix:
        mixing = getattr(attn, "mhla_mixing", None)
        if mixing is not None:
            return mixing
        model = current_model()
        if model is None:
            raise RuntimeError(
                "this attention layer has no MHLA mixing matrix yet and no supported transformer is running; "
                "install MHLA with mhla_diffusers.apply_mhla(transformer) (creates the matrices before training)"
            )
        from .families import family_of

        return self.attach(attn, family_of(model).reference_grid(model.config))

    def _grid(self, attn, num_tokens: int) -> tuple[int, int, int]:
        grid = current_grid()
        seen = attn.__dict__.setdefault("_mhla_grids", {})
        if grid is None:
            # Activation-checkpoint recomputation replays the layer inside the backward pass, after
            # the transformer's forward returned: reuse the grid this layer saw for this N then.
            # Anywhere else an unknown grid is an error, never a guess.
            in_backward = torch._C._current_graph_task_id() != -1
            grid = seen.get(num_tokens) if in_backward else None
            if grid is None:
                raise RuntimeError(
                    f"MHLA does not know the token grid of this call ({num_tokens} tokens) and never guesses it. "
                    "Run the layer inside a supported transformer's forward (apply_mhla / set_attn_processor "
                    "install the hooks), or wrap the call in `with mhla_diffusers.token_grid((T, H, W)):`."
                )
            return grid
        if grid[0] * grid[1] * grid[2] != num_tokens:
            raise RuntimeError(
                f"the token grid {grid} of this forward has {grid[0] * grid[1] * grid[2]} tokens but the "
                f"self-attention received {num_tokens}; MHLA only supports layers that attend over the latent grid"
            )
        seen[num_tokens] = grid
        return grid

    def _family(self):
        """The family whose stock behaviour this call follows: explicit, else the running model's, else ``None``."""
        from .families import find_family

        model = current_model()
        running = None if model is None else find_family(model)
        if self.family is None:
            return running
        if running is not None and running is not self.family:
            raise RuntimeError(
                f"this MHLAProcessor was built with family={self.family.name!r} but runs inside a "
                f"{type(model).__name__} ({running.name}); build it without family= inside transformers"
            )
        return self.family

    def _stock_call(self, family, attn, hidden_states, encoder_hidden_states, attention_mask, temb, args, kwargs):
        """The family's stock cross-attention processor on the very same arguments."""
        key = "" if family is None else family.name
        stock = self._stock.get(key)
        if stock is None:
            stock = self._stock[key] = (
                family.make_stock_cross_processor() if family is not None else _default_stock_processor()
            )
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
        temb: torch.Tensor | None = None,
        *args,
        **kwargs,
    ) -> torch.Tensor:
        family = self._family()
        if encoder_hidden_states is not None or getattr(attn, "is_cross_attention", False):
            return self._stock_call(family, attn, hidden_states, encoder_hidden_states, attention_mask, temb, args, kwargs)
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

        # the layer's own projections and q/k norms, where its stock processor applies them
        query = attn.to_q(hidden_states)
        key = attn.to_k(hidden_states)
        value = attn.to_v(hidden_states)
        across_heads = family is not None and family.qk_norm_across_heads
        if across_heads:
            query, key = _qk_norm(attn, query, key)
        head_dim = key.shape[-1] // attn.heads
        query = query.view(batch, -1, attn.heads, head_dim).transpose(1, 2)  # [B, heads, N, d]
        key = key.view(batch, -1, attn.heads, head_dim).transpose(1, 2)
        value = value.view(batch, -1, attn.heads, value.shape[-1] // attn.heads).transpose(1, 2)
        if not across_heads:
            query, key = _qk_norm(attn, query, key)

        # MHLA over the blocks of this call's token grid (phi = ReLU, fp32 accumulation)
        mixing = self._mixing(attn)
        layout = get_layout(self._grid(attn, num_tokens), mixing.block_grid)
        eps = self.eps if self.eps is not None else (1e-6 if family is None else family.default_eps)
        hidden_states = mhla_attention(
            query, key, value, mixing.clamped(), layout, normalize=self.normalize, eps=eps, backend=self.backend
        )
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
        return hidden_states / getattr(attn, "rescale_output_factor", 1.0)


def _qk_norm(attn, query: torch.Tensor, key: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    if getattr(attn, "norm_q", None) is not None:
        query = attn.norm_q(query)
    if getattr(attn, "norm_k", None) is not None:
        key = attn.norm_k(key)
    return query, key


def _default_stock_processor():
    from diffusers.models.attention_processor import AttnProcessor2_0

    return AttnProcessor2_0()
