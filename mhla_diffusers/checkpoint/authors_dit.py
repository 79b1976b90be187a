"""Import a DiT trained with the authors' MHLA DiT code (DAGroup-PKU/MHLA ``mhla_dit``) into diffusers' ``DiTTransformer2DModel``.

Their model is the original DiT (facebookresearch/DiT key layout: ``x_embedder``, ``t_embedder``, ``y_embedder``,
``blocks.<i>.adaLN_modulation``, ``blocks.<i>.mlp``, ``final_layer``) whose attention is their ``MHLA4DiT``:

- a LayerNorm ``attn.norm`` (weight and bias, eps 1e-5) on the layer's input: our ``input_norm``;
- one fused ``attn.to_qkv`` with bias: split into diffusers' ``to_q`` / ``to_k`` / ``to_v``;
- features ``ReLU(x) + eps`` (``feature_eps``), no scale, no RoPE; ``eps`` their layer's constructor argument (default
  1e-6), read from their training checkpoint's ``args.model_kwargs``;
- the mixing matrix ``attn.piece_attn.conv.weight[:, :, 0, 0]`` (rows = query blocks) over square blocks of
  ``block_size`` tokens: their training clamps it to [0, 1] after every step, their forward uses it as stored; clamped
  here too (``mixing_clamp``) unless the file holds values outside [0, 1], which then run as stored, unclamped;
- their normaliser ``sum_j Mc[i, j] phi(q[j, l]) . z_j + eps`` (``denominator="authors_dit"``,
  :mod:`~mhla_diffusers.ops.positional`);
- LePE ``attn.lepe``: a depthwise 3 x 3 ``Conv2d`` with bias of v over the image, added: our ``lepe``;
- ``attn.to_out.0``: diffusers' ``to_out.0``.

Layers with the stock timm ``attn.qkv`` / ``attn.proj`` stay softmax. Their variant with q / k RMSNorms over all
heads (``qk_norm``) has no diffusers counterpart and is refused. The mapping in full: ``docs/families/dit.md``
(the authors' DiT weights).
"""

from __future__ import annotations

import math
import os
import re
import warnings
from collections.abc import Mapping

import torch

from mhla_diffusers.apply import apply_mhla
from mhla_diffusers.checkpoint.authors import AuthorsCheckpointError, authors_state, storage_dtype, write_import
from mhla_diffusers.checkpoint.conversion import pipeline_around, single_file_target
from mhla_diffusers.families import DIT, family_of, self_attention_modules
from mhla_diffusers.models.installer import mhla_spec

__all__ = ["AUTHORS_DIT_EPS", "split_authors_dit_state_dict", "install_authors_dit_mhla", "load_authors_dit",
           "import_authors_dit", "run_eps"]

AUTHORS_DIT_EPS = 1e-6  # their MHLA4DiT's default eps (kwargs.get("eps", 1e-6)): added to the features and the normaliser

# their keys -> diffusers' (shared embedders are copied into every block's AdaLayerNormZero, as diffusers' DiT holds them)
_TOP = {
    "x_embedder.proj.weight": "pos_embed.proj.weight", "x_embedder.proj.bias": "pos_embed.proj.bias",
    "final_layer.adaLN_modulation.1.weight": "proj_out_1.weight", "final_layer.adaLN_modulation.1.bias": "proj_out_1.bias",
    "final_layer.linear.weight": "proj_out_2.weight", "final_layer.linear.bias": "proj_out_2.bias",
}
_SHARED = {
    "t_embedder.mlp.0.weight": "norm1.emb.timestep_embedder.linear_1.weight",
    "t_embedder.mlp.0.bias": "norm1.emb.timestep_embedder.linear_1.bias",
    "t_embedder.mlp.2.weight": "norm1.emb.timestep_embedder.linear_2.weight",
    "t_embedder.mlp.2.bias": "norm1.emb.timestep_embedder.linear_2.bias",
    "y_embedder.embedding_table.weight": "norm1.emb.class_embedder.embedding_table.weight",
}
_BLOCK = {
    "adaLN_modulation.1.weight": "norm1.linear.weight", "adaLN_modulation.1.bias": "norm1.linear.bias",
    "mlp.fc1.weight": "ff.net.0.proj.weight", "mlp.fc1.bias": "ff.net.0.proj.bias",
    "mlp.fc2.weight": "ff.net.2.weight", "mlp.fc2.bias": "ff.net.2.bias",
}
# an attention layer: fused qkv and output projection, by kind
_ATTENTION = {
    "softmax": {"qkv": "attn.qkv", "out": "attn.proj", "own": ()},
    "mhla": {"qkv": "attn.to_qkv", "out": "attn.to_out.0",
             "own": ("attn.norm.weight", "attn.norm.bias", "attn.lepe.weight", "attn.lepe.bias", "attn.piece_attn.conv.weight")},
}
_BLOCK_KEY = re.compile(r"^blocks\.(\d+)\.(.+)$")
_QK_NORM = re.compile(r"^blocks\.\d+\.attn\.(q_norm|k_norm)\.")


def split_authors_dit_state_dict(
    state: Mapping[str, torch.Tensor], num_layers: int
) -> tuple[dict[str, torch.Tensor], dict[int, dict[str, torch.Tensor]], torch.Tensor | None]:
    """Their DiT state dict as diffusers ``DiTTransformer2DModel`` keys, the MHLA parameters of each MHLA layer apart.

    Returns:
        ``(stock, mhla, pos_embed)``: ``stock`` in diffusers' names (q, k, v split from the fused projection);
        ``mhla`` ``{layer: {"norm.weight", "norm.bias", "lepe.weight", "lepe.bias", "piece_attn.conv.weight"}}``
        (their names without ``blocks.<i>.attn.``); ``pos_embed`` their fixed sin-cos table or ``None``.

    Raises:
        AuthorsCheckpointError: unknown keys (their names), a layer of both kinds or of neither, a part of a
            layer missing, the ``qk_norm`` variant, a block index beyond ``num_layers``.
    """
    qk_norm = sorted(k for k in state if _QK_NORM.match(k))
    if qk_norm:
        raise AuthorsCheckpointError(
            f"the file holds q / k norms {qk_norm[:4]}: their qk_norm variant normalises q and k over all heads at once, "
            "which diffusers' DiT attention cannot hold; this importer maps their default layer (qk_norm=False) only; "
            "nothing was written"
        )
    stock, blocks, unknown = {}, {}, []
    for key, value in state.items():
        if key in _TOP:
            stock[_TOP[key]] = value
        elif key in _SHARED:
            for i in range(num_layers):
                stock[f"transformer_blocks.{i}.{_SHARED[key]}"] = value
        elif (match := _BLOCK_KEY.match(key)) is not None:
            blocks.setdefault(int(match.group(1)), {})[match.group(2)] = value
        elif key != "pos_embed":
            unknown.append(key)
    beyond = sorted(i for i in blocks if i >= num_layers)
    if unknown or beyond:
        raise AuthorsCheckpointError(
            f"unknown keys {sorted(unknown)[:12]}" + (f"; blocks {beyond} beyond the config's {num_layers} layers" if beyond else "")
            + ": not a DiT of the authors' mhla_dit code for this config; nothing was written"
        )
    mhla = {}
    for i, parts in sorted(blocks.items()):
        stock.update(_block_to_diffusers(i, parts, mhla))
    return stock, mhla, state.get("pos_embed")


def _block_to_diffusers(i: int, parts: dict[str, torch.Tensor], mhla: dict) -> dict[str, torch.Tensor]:
    """One block's diffusers keys; its MHLA parameters go to ``mhla[i]``."""
    kinds = [kind for kind, names in _ATTENTION.items() if f"{names['qkv']}.weight" in parts]
    if len(kinds) != 1:
        what = "both a softmax (attn.qkv) and an MHLA (attn.to_qkv)" if kinds else "no attention (attn.qkv or attn.to_qkv)"
        raise AuthorsCheckpointError(f"block {i} holds {what} projection; nothing was written")
    names = _ATTENTION[kinds[0]]
    wanted = [*_BLOCK, *(f"{names[p]}.{t}" for p in ("qkv", "out") for t in ("weight", "bias")), *names["own"]]
    missing = [f"blocks.{i}.{name}" for name in wanted if name not in parts]
    extra = [f"blocks.{i}.{name}" for name in parts if name not in wanted]
    if missing or extra:
        raise AuthorsCheckpointError(
            (f"missing keys {missing}" if missing else "") + ("; " if missing and extra else "")
            + (f"unknown keys {extra}" if extra else "") + f": block {i} is not a whole {kinds[0]} DiT block; nothing was written"
        )
    out = {f"transformer_blocks.{i}.{ours}": parts[theirs] for theirs, ours in _BLOCK.items()}
    for t in ("weight", "bias"):
        qkv = parts[f"{names['qkv']}.{t}"]
        if qkv.shape[0] % 3:
            raise AuthorsCheckpointError(f"blocks.{i}.{names['qkv']}.{t} has {qkv.shape[0]} rows, not 3 x the width")
        for name, piece in zip(("to_q", "to_k", "to_v"), qkv.chunk(3, dim=0)):
            out[f"transformer_blocks.{i}.attn1.{name}.{t}"] = piece.contiguous()
        out[f"transformer_blocks.{i}.attn1.to_out.0.{t}"] = parts[f"{names['out']}.{t}"]
    if kinds[0] == "mhla":
        mhla[i] = {name[len("attn."):]: parts[name] for name in names["own"]}
    return out


def install_authors_dit_mhla(transformer, mhla: Mapping[int, Mapping[str, torch.Tensor]], eps: float = AUTHORS_DIT_EPS) -> list[int]:
    """MHLA on the layers of ``mhla`` of a diffusers ``DiTTransformer2DModel`` as their ``MHLA4DiT`` runs, with their weights.

    ``apply_mhla`` with their block grid (``M = sqrt(M) x sqrt(M)`` square blocks over the token grid),
    ``input_norm=True``, ``lepe=True`` (3 x 3), ``feature_eps=eps``, ``denominator="authors_dit"``; then
    ``mhla.input_norm <- norm``, ``mhla.lepe <- lepe``, mixing ``<- piece_attn.conv.weight[:, :, 0, 0]``. The mixing
    is clamped to [0, 1] as in their training (a no-op on what it saves) unless a matrix holds values outside it:
    their forward runs those as stored, so then every matrix is unclamped (``mixing_clamp=False``, with a warning).

    Args:
        eps: their layer's ``eps`` (features and normaliser): the run's (:func:`run_eps`).

    Returns:
        The MHLA layer indices.

    Raises:
        AuthorsCheckpointError: no MHLA layer; a mixing matrix not ``[M, M, 1, 1]`` with ``M`` a square dividing the
            token grid, or differing between layers; a norm or LePE of the wrong shape; non-finite values.
    """
    if family_of(transformer) is not DIT:
        raise AuthorsCheckpointError(f"the authors' MHLA DiT is a DiT; got a {type(transformer).__name__}")
    if not mhla:
        raise AuthorsCheckpointError(
            "the file holds no MHLA layer (no blocks.<i>.attn.to_qkv): it is a plain DiT; convert it to diffusers and "
            "retrofit it with convert.py --from diffusers instead"
        )
    block_grid = _authors_dit_block_grid(transformer, mhla)
    channels = transformer.config.num_attention_heads * transformer.config.attention_head_dim
    shapes = {"norm.weight": (channels,), "norm.bias": (channels,), "lepe.weight": (channels, 1, 3, 3),
              "lepe.bias": (channels,)}
    for i, params in sorted(mhla.items()):
        for name, shape in shapes.items():
            if tuple(params[name].shape) != shape:
                raise AuthorsCheckpointError(f"blocks.{i}.attn.{name} has shape {tuple(params[name].shape)}, expected {shape}")
        for name, value in params.items():
            if not value.is_floating_point():
                raise AuthorsCheckpointError(f"blocks.{i}.attn.{name} holds {value.dtype} values, not floating point weights")
            if not torch.isfinite(value).all():
                raise AuthorsCheckpointError(f"blocks.{i}.attn.{name} holds NaN or infinite values")
    layers = sorted(mhla)
    apply_mhla(transformer, layers, block_grid=block_grid, eps=eps, feature_eps=eps, input_norm=True, lepe=True,
               denominator="authors_dit", mixing_clamp=_keeps_clamp(mhla))
    modules = self_attention_modules(transformer, DIT)
    with torch.no_grad():
        for i in layers:
            attn = modules[i][1]
            attn.mhla.mixing.weight.copy_(mhla[i]["piece_attn.conv.weight"][:, :, 0, 0].float())
            attn.mhla.input_norm.weight.copy_(mhla[i]["norm.weight"].float())
            attn.mhla.input_norm.bias.copy_(mhla[i]["norm.bias"].float())
            attn.mhla.lepe.weight.copy_(mhla[i]["lepe.weight"].float())
            attn.mhla.lepe.bias.copy_(mhla[i]["lepe.bias"].float())
    return layers


def _keeps_clamp(mhla: Mapping[int, Mapping[str, torch.Tensor]]) -> bool:
    """Whether every mixing matrix lies in [0, 1] (clamping changes nothing their forward computes); else warns that
    the matrices run unclamped, as their forward runs them."""
    weights = {i: params["piece_attn.conv.weight"] for i, params in sorted(mhla.items())}
    outside = {i: w for i, w in weights.items() if bool((w < 0).any() or (w > 1).any())}
    if not outside:
        return True
    low = min(float(w.min()) for w in outside.values())
    high = max(float(w.max()) for w in outside.values())
    warnings.warn(
        f"the mixing matrices of blocks {sorted(outside)} hold values outside [0, 1] (from {low:.4g} to {high:.4g}); their "
        "layer's forward uses them as stored (their training clamps after each step), so the imported layers run them "
        "unclamped (mixing_clamp=False, recorded): fine-tuning here will not clamp them either",
        stacklevel=3,
    )
    return False


def run_eps(obj, eps: float | None, src) -> float:
    """Their layer's ``eps`` for the checkpoint object ``obj``: ``args.model_kwargs["eps"]`` of their ``train.py``
    checkpoint (their default 1e-6 when the run set none); ``eps`` when given; 1e-6 with a warning when the file holds
    no run arguments (a bare state dict).

    Raises:
        AuthorsCheckpointError: ``eps`` contradicting the run's, or a run's ``eps`` that is not a number >= 0.
    """
    kwargs = _model_kwargs(obj)
    if kwargs is None:
        if eps is None:
            warnings.warn(
                f"{src} holds no run arguments (their train.py saves args.model_kwargs beside the weights): their layers' "
                f"eps is taken as their default {AUTHORS_DIT_EPS:g}; if the run set another, give it (eps=, --eps)",
                stacklevel=3,
            )
        return AUTHORS_DIT_EPS if eps is None else float(eps)
    recorded = kwargs.get("eps", AUTHORS_DIT_EPS)
    if isinstance(recorded, bool) or not isinstance(recorded, (int, float)) or not 0 <= recorded < math.inf:
        raise AuthorsCheckpointError(f"{src}: args.model_kwargs['eps'] is {recorded!r}, not a number >= 0; nothing was written")
    if eps is not None and float(eps) != float(recorded):
        raise AuthorsCheckpointError(
            f"eps={eps} contradicts the run's eps={recorded} (args.model_kwargs of {src}); leave eps (--eps) out to use the "
            "run's; nothing was written"
        )
    return float(recorded)


def _model_kwargs(obj) -> Mapping | None:
    """``obj["args"].model_kwargs`` (their ``train.py``'s argparse ``Namespace``, or a dict), else ``None``."""
    args = obj.get("args") if isinstance(obj, Mapping) else None
    kwargs = args.get("model_kwargs") if isinstance(args, Mapping) else getattr(args, "model_kwargs", None)
    return kwargs if isinstance(kwargs, Mapping) else None


def _authors_dit_block_grid(transformer, mhla) -> tuple[int, int, int]:
    """``(1, s, s)`` from their ``[M, M, 1, 1]`` mixing matrices (``M = s^2`` square pieces), checked against the grid."""
    shapes = {tuple(params["piece_attn.conv.weight"].shape) for params in mhla.values()}
    side = transformer.config.sample_size // transformer.config.patch_size  # tokens per side of their square latents
    if len(shapes) != 1:
        raise AuthorsCheckpointError(f"the MHLA layers' mixing matrices differ in shape {sorted(shapes)}; their model has one")
    shape = shapes.pop()
    m = shape[0]
    s = math.isqrt(m)
    if len(shape) != 4 or shape != (m, m, 1, 1) or s * s != m or side % s:
        raise AuthorsCheckpointError(
            f"attn.piece_attn.conv.weight has shape {shape}: expected [M, M, 1, 1] with M = s^2 square pieces whose side s "
            f"divides the {side} x {side} token grid of this config (their block_size = ({side} / s)^2 tokens)"
        )
    return (1, s, s)


def load_authors_dit(
    src: str | os.PathLike | Mapping[str, torch.Tensor],
    config: str | os.PathLike,
    *,
    torch_dtype: torch.dtype | None = None,
    state_dict_key: str | None = None,
    eps: float | None = None,
):
    """A DiT of the authors' ``mhla_dit`` code as a diffusers pipeline (or transformer) with our MHLA layers.

    Args:
        src: their checkpoint (``.pt`` of their ``train.py``: choose ``state_dict_key="ema"`` or ``"model"``;
            or a ``.safetensors``), a folder holding just that file, or the loaded checkpoint (or state dict).
        config: a local diffusers DiT pipeline or transformer folder of the same architecture, or a Hub id.
        torch_dtype: base weights' dtype (``None``: the file's); MHLA parameters are float32.
        eps: their layers' ``eps`` for a file without the run's arguments (:func:`run_eps`; ``None``: the run's, else
            their default 1e-6).

    Returns:
        (tuple): ``(pipeline or None, transformer)``, the transformer in eval mode.

    Raises:
        AuthorsCheckpointError: as :func:`split_authors_dit_state_dict`, :func:`install_authors_dit_mhla` and
            :func:`run_eps`; diffusers keys missing or mis-shaped for the config; a ``pos_embed`` that is not the config's
            sin-cos table.
        FileNotFoundError: ``src`` or ``config`` does not exist.
    """
    name, state, obj = authors_state(src, state_dict_key)
    eps = run_eps(obj, eps, name)
    cls, load_kwargs, pipeline_folder = single_file_target(name, str(config), "dit")
    if cls.__name__ != "DiTTransformer2DModel":
        raise AuthorsCheckpointError(f"config {config} describes a {cls.__name__}; the authors' MHLA DiT needs a DiT config")
    model = cls.from_config(cls.load_config(load_kwargs["config"], subfolder=load_kwargs.get("subfolder")))
    stock, mhla, pos_embed = split_authors_dit_state_dict(state, model.config.num_layers)
    _check_against(model, stock, pos_embed, name)
    model.load_state_dict(stock, strict=True)
    model.to(torch_dtype or storage_dtype(state))
    install_authors_dit_mhla(model, mhla, eps)
    model.eval()
    if pipeline_folder is None:
        return None, model
    return pipeline_around(pipeline_folder, model, torch_dtype or storage_dtype(state)), model


def _check_against(model, stock: dict, pos_embed, src) -> None:
    """Every parameter once with its shape; their ``pos_embed`` the config's fixed table (they never train it)."""
    expected = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    integers = sorted(k for k, v in stock.items() if not v.is_floating_point())
    if integers:
        raise AuthorsCheckpointError(f"{src}: {integers[:12]} (diffusers names) hold integer values, not floating point "
                                     "weights; nothing was written")
    missing = [k for k in expected if k not in stock]
    shapes = [f"{k}: {tuple(v.shape)} in the file, {expected[k]} in the config" for k, v in stock.items()
              if k in expected and tuple(v.shape) != expected[k]]
    if missing or shapes:
        raise AuthorsCheckpointError(
            f"{src} does not match the diffusers DiT config ("
            + "; ".join(([f"missing keys (diffusers names) {missing[:12]}"] if missing else []) + shapes[:12])
            + "); pass the config of the model this file belongs to; nothing was written"
        )
    table = model.pos_embed.pos_embed
    if pos_embed is not None and not _same_table(pos_embed, table):
        raise AuthorsCheckpointError(
            f"{src}: pos_embed {tuple(pos_embed.shape)} is not the fixed sin-cos table {tuple(table.shape)} diffusers' DiT "
            "computes for this config (their DiT never trains it); a learned or other table cannot be held; nothing was written"
        )


def _same_table(stored: torch.Tensor, table: torch.Tensor) -> bool:
    """``stored`` is ``table`` as the file's dtype holds it (fp16 / bf16 files round it: compared at that precision)."""
    if tuple(stored.shape) != tuple(table.shape) or not stored.is_floating_point():
        return False
    atol = max(1e-5, 2 * torch.finfo(stored.dtype).eps)  # values in [-1, 1]: a rounding is at most half an eps
    return torch.allclose(stored.double(), table.to(stored.dtype).double(), atol=atol)


def import_authors_dit(
    src: str | os.PathLike,
    out: str | os.PathLike,
    *,
    config: str | os.PathLike,
    torch_dtype: torch.dtype | None = None,
    overwrite: bool = False,
    state_dict_key: str | None = None,
    eps: float | None = None,
) -> dict:
    """Convert their DiT checkpoint into a converted checkpoint at ``out`` (atomic); arguments as :func:`load_authors_dit`.

    Returns:
        The spec written to ``mhla_config.json`` plus ``"out"``.

    Raises:
        ValueError: ``out`` would replace ``src``. FileExistsError: a non-empty ``out`` without ``overwrite``.
        Otherwise as :func:`load_authors_dit`.
    """
    model = write_import(src, out, overwrite, lambda: load_authors_dit(
        src, config, torch_dtype=torch_dtype, state_dict_key=state_dict_key, eps=eps))
    return {**mhla_spec(model), "out": str(out)}
