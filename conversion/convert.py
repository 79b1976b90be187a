#!/usr/bin/env python
r"""Retrofit a pretrained diffusers checkpoint with MHLA.

    python conversion/convert.py --family dit --src facebook/DiT-XL-2-256 --out dit-mhla --layers hybrid
    python conversion/convert.py --family dit --src demo/base_dit --out /tmp/dit-mhla --num-blocks 16
    python conversion/convert.py --family sana --src Efficient-Large-Model/Sana_600M_1024px_diffusers --out sana-mhla
    python conversion/convert.py --family sana --src Sana_600M_1024px.pth --config ./Sana_600M_1024px_diffusers \
        --out sana-mhla --dtype bf16
    python conversion/convert.py --family wan --src Wan-AI/Wan2.1-T2V-1.3B-Diffusers --out wan-mhla --layers hybrid
    python conversion/convert.py --family dit --src demo/base_dit --out /tmp/dit-auto --layers auto --keep-softmax 2
    python conversion/convert.py --family wan --src Wan-AI/Wan2.1-T2V-1.3B-Diffusers --out wan-auto --layers auto --attention-budget 0.5
    python conversion/convert.py --family wan --src Wan2.1-T2V-1.3B/diffusion_pytorch_model.safetensors \
        --config ./Wan2.1-T2V-1.3B-Diffusers --out wan-mhla --block-grid authors --no-normalize --dtype bf16
    python conversion/convert.py --family wan --src Wan-AI/Wan2.2-T2V-A14B-Diffusers --out wan22-mhla --layers hybrid \
        --layers-2 all
    python conversion/convert.py --family wan --from authors --src MHLA/model.safetensors \
        --config ./Wan2.1-T2V-1.3B-Diffusers --out wan-mhla-authors
    python conversion/convert.py --family dit --from authors --src results/DiT-S-2/checkpoints/epoch-0079.pt \
        --state-dict-key ema --config ./DiT-S-2-diffusers --out dit-mhla-authors

A Wan 2.2 A14B pipeline (two experts: transformer for high noise, transformer_2 for low noise) has both
converted with the same settings; --layers-2 gives transformer_2 its own layer selection (none: keep it stock;
--layers none --layers-2 all: convert the low-noise expert only). With --layers auto --layers-2 auto each expert is
scored on calibration at its own timesteps (transformer: t >= boundary_ratio x 1000, transformer_2: below).

--from authors imports the authors' released Wan MHLA weights (DAGroup-PKU/MHLA): layers, blocks,
feature epsilon, output norm, gate and LePE are theirs, read from the file (mhla_diffusers.checkpoint.authors);
--layers, --num-blocks, --no-normalize, --output-norm and --eps do not apply there. Their layer's normaliser
(norm_output) is not in the file: numerator only, as their release, unless --norm-output. With --family dit it
imports a DiT trained with their mhla_dit code (their MHLA4DiT layers: input LayerNorm, LePE, their normaliser, the
run's eps from the checkpoint's args.model_kwargs, else --eps, else their default 1e-6;
mhla_diffusers.checkpoint.authors_dit) into diffusers' DiT; --block-grid does not apply either.
--src is their checkpoint file, or a folder holding that one weights file.
Their training checkpoints (.pth / .pt, numpy RNG state or the run's argparse arguments beside the weights) are
read with torch.load(weights_only=True).

Writes the base checkpoint + transformer/mhla_config.json + transformer/mhla.safetensors
(see mhla_diffusers.checkpoint.format). Exit code 2 for bad input (a damaged or truncated source file included),
3 if the source is already converted.
--layers auto scores every self-attention layer (mhla_diffusers.layer_sensitivity) on calibration inputs made
offline from the source (DiT: random class labels; SANA / Wan: generic prompts through the pipeline's own text
encoder, or --calibration-embeddings) and records the selection and the scores in mhla_config.json; --device cuda
runs that measurement on a GPU, --calibration-latent-size (e.g. 5,30,52 for Wan) makes it smaller.
"""

from __future__ import annotations

import argparse
import json
import sys

DTYPES = {"keep": None, "fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


def parse_layers(text: str):
    if text in ("all", "hybrid", "auto"):
        return text
    try:
        layers = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"--layers takes 'all', 'hybrid', 'auto' or comma-separated indices; got {text!r}"
        ) from None
    if not layers:
        raise argparse.ArgumentTypeError(
            f"no layers selected ({text!r}): give 'all', 'hybrid' or comma-separated indices such as 1,2,4"
        )
    return layers


def parse_layers_2(text: str):
    return "none" if text == "none" else parse_layers(text)


def parse_latent_size(text: str):
    try:
        size = tuple(int(x) for x in text.split(","))
    except ValueError:
        size = ()
    if not 2 <= len(size) <= 3 or min(size) < 1:
        raise argparse.ArgumentTypeError(
            f"--calibration-latent-size takes H,W (dit / sana) or F,H,W (wan, latent frames) positive integers; got {text!r}"
        )
    return size


def parse_token_grid(text: str):
    try:
        grid = tuple(int(x) for x in text.split(","))
    except ValueError:
        grid = ()
    if not 2 <= len(grid) <= 3 or min(grid) < 1:
        raise argparse.ArgumentTypeError(f"--cost-grid takes a token grid H,W or T,H,W of positive integers; got {text!r}")
    return grid


def parse_block_grid(text: str):
    if text.isidentifier():  # a preset name of the family (Wan: paper, authors); checked on conversion
        return text
    try:
        grid = tuple(int(x) for x in text.split(","))
    except ValueError:
        grid = ()
    if not 1 <= len(grid) <= 3 or min(grid) < 1:
        raise argparse.ArgumentTypeError(
            f"--block-grid takes 1-3 positive integers like 4,4 or 3,5,7, or a preset name (wan: paper, authors); got {text!r}"
        )
    return grid


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--family", required=True, help="model family: dit | sana | wan | sana_video | wan_vace")
    parser.add_argument(
        "--from",
        dest="source_kind",
        choices=("diffusers", "authors"),
        default="diffusers",
        help="diffusers: retrofit a pretrained model (default); authors: import the MHLA authors' released Wan "
        "weights (--family wan, --src their checkpoint file, --config a diffusers Wan2.1-T2V-1.3B folder or Hub id) or "
        "a DiT of their mhla_dit code (--family dit, --config a diffusers DiT folder of the same architecture)",
    )
    parser.add_argument(
        "--state-dict-key", default=None, help="--from authors: the entry of a nested training checkpoint to import"
    )
    parser.add_argument(
        "--norm-output", action="store_true",
        help="--from authors --family wan: their layers were built with norm_output=True (their constructors' default; "
        "the released config sets it false, the default here): import their normaliser. The weights cannot tell",
    )
    parser.add_argument(
        "--src", required=True, help="Hub id, local pipeline folder, local transformer folder, or original single file"
    )
    parser.add_argument(
        "--config",
        default=None,
        help="a single-file --src, and --from authors (required there): the diffusers config to read it with, a local "
        "pipeline folder (writes a pipeline), transformer folder, or Hub id; not for a diffusers folder or Hub id --src",
    )
    parser.add_argument("--out", required=True, help="output folder (must not exist, or be empty)")
    parser.add_argument(
        "--layers", type=parse_layers_2, default=None,
        help="all (default) | hybrid | none (Wan 2.2 A14B with --layers-2: convert transformer_2 only) | auto (the layers "
        "MHLA damages most keep their attention, measured on calibration "
        "inputs: with --keep-softmax or --attention-budget) | comma-separated indices (negative ones count from the end: "
        "write --layers=-1,-2, with '=')",
    )
    keep = parser.add_mutually_exclusive_group()
    keep.add_argument("--keep-softmax", type=int, default=None, metavar="K",
                      help="--layers auto: keep the stock attention on the K most sensitive layers (0: all MHLA)")
    keep.add_argument("--attention-budget", type=float, default=None, metavar="F",
                      help="--layers auto: keep the most sensitive layers whose attention cost stays <= F (0 < F <= 1) "
                      "of the stock model's (priced by --cost)")
    parser.add_argument("--cost", choices=["flops", "measured"], default=None,
                        help="--layers auto: price each layer's attention by the FLOP model at the native resolution "
                        "(flops, the default) or by timing its attention operator on --device (measured)")
    parser.add_argument("--cost-grid", type=parse_token_grid, default=None, metavar="T,H,W",
                        help="--cost measured: the token grid (after patching) to time at (default: the model's native grid)")
    parser.add_argument("--cost-cache", default=None, metavar="FILE",
                        help="--cost measured: a JSON file of earlier timings, read and updated")
    parser.add_argument("--calibration-samples", type=int, default=None,
                        help="--layers auto: calibration forwards (default 8; timesteps spread over the noise process)")
    parser.add_argument("--calibration-seed", type=int, default=None, help="--layers auto: seed of the calibration inputs (0)")
    parser.add_argument(
        "--calibration-embeddings", default=None, metavar="FILE",
        help="--layers auto, sana / wan: cached text-encoder states (safetensors from "
        "mhla_diffusers.encode_calibration_prompts) instead of the pipeline's text encoder",
    )
    parser.add_argument(
        "--layers-2", type=parse_layers_2, default=None,
        help="Wan 2.2 A14B only: layer selection of the second expert (transformer_2, low noise): all | hybrid | none | "
        "auto (with --layers auto: scored on calibration at its own timesteps, below boundary_ratio x 1000) | indices "
        "(default: as --layers)",
    )
    parser.add_argument(
        "--calibration-latent-size", type=parse_latent_size, default=None, metavar="H,W|F,H,W",
        help="--layers auto: latent size of the calibration inputs (default the model's native size; Wan 21,60,104: "
        "give a smaller one such as 5,30,52 on a CPU)",
    )
    parser.add_argument(
        "--device", default=None,
        help="--layers auto: where the sensitivity measurement runs (e.g. cuda; default where the model loads, the CPU); "
        "the written checkpoint is the same",
    )
    group = parser.add_mutually_exclusive_group()
    group.add_argument(
        "--num-blocks", type=int, default=None, help="target number of blocks M (default: wan 105, else round(sqrt(N)/2))"
    )
    group.add_argument(
        "--block-grid",
        type=parse_block_grid,
        default=None,
        help="explicit block grid, e.g. 4,4 or 3,5,7, or a preset: wan paper (3,5,7) | authors (3,5,10)",
    )
    parser.add_argument("--no-normalize", action="store_true", help="drop the denominator (numerator only)")
    norm = parser.add_mutually_exclusive_group()
    norm.add_argument(
        "--output-norm",
        dest="output_norm",
        action="store_true",
        default=None,
        help="per-head RMSNorm on the attention output (default: wan with --no-normalize, as the authors)",
    )
    norm.add_argument("--no-output-norm", dest="output_norm", action="store_false", help="no output RMSNorm")
    parser.add_argument(
        "--eps", type=float, default=None,
        help="denominator epsilon (default: family default); --from authors --family dit: their run's eps, for a file "
        "without the run's arguments (default: read from the checkpoint's args.model_kwargs, else their 1e-6)",
    )
    parser.add_argument(
        "--mixing-init", default=None, metavar="NAME",
        help="start of the mixing matrices: a MixingMatrix init name (default locality, the paper's; uniform; ...) or "
        "authors_constant (the authors' Wan start: mixing matrix and output-norm weight at 1e-6)",
    )
    parser.add_argument(
        "--feature-eps", type=float, default=None, help="phi = ReLU(x) ** p + feature_eps (default 0; the authors' Wan 1e-6)"
    )
    parser.add_argument(
        "--feature-power", type=float, default=None, metavar="P", help="phi = ReLU(x) ** P (default 1: ReLU; P > 0)"
    )
    parser.add_argument(
        "--no-mixing-clamp", action="store_true",
        help="use the mixing matrices as stored, not clamped to [0, 1] (the authors' Wan run)",
    )
    parser.add_argument(
        "--rope", choices=("after", "before", "none"), default=None,
        help="wan: where RoPE goes: after the feature map, numerator only (default) | before it (q, k rotated, then "
        "phi) | none; families without RoPE take none only",
    )
    parser.add_argument(
        "--gate", choices=("neutral", "authors"), default=None,
        help="an output gate from the layer's input tokens: neutral (out * 2 sigmoid(Wx + b), zero start: the output "
        "unchanged) | authors (out * SiLU(Wx + b), nn.Linear's init); default none",
    )
    parser.add_argument(
        "--lepe", action="store_true",
        help="LePE: a depthwise 3x3 (wan: 3x3x3) convolution of the values over the token grid, added to the output",
    )
    parser.add_argument(
        "--lepe-init", choices=("zeros", "authors"), default=None,
        help="--lepe: zeros (default: the output without LePE at the start) | authors (PyTorch's conv init)",
    )
    parser.add_argument(
        "--dtype", choices=sorted(DTYPES), default="keep", help="dtype of the written base weights (keep: as stored)"
    )
    parser.add_argument("--overwrite", action="store_true", help="replace a non-empty --out")
    args = parser.parse_args(argv)

    if args.source_kind == "authors":
        return _import_authors(args)
    for flag, given in (("--state-dict-key", args.state_dict_key is not None), ("--norm-output", args.norm_output)):
        if given:
            print(f"convert.py: {flag} only applies with --from authors", file=sys.stderr)
            return 2
    if args.lepe_init is not None and not args.lepe:
        print("convert.py: --lepe-init only applies with --lepe", file=sys.stderr)
        return 2

    import torch

    from mhla_diffusers.checkpoint.conversion import AlreadyConvertedError, convert_checkpoint

    dtype = None if DTYPES[args.dtype] is None else getattr(torch, DTYPES[args.dtype])
    try:
        spec = convert_checkpoint(
            args.src,
            args.out,
            family=args.family,
            layers="all" if args.layers is None else args.layers,
            num_blocks=args.num_blocks,
            block_grid=args.block_grid,
            normalize=not args.no_normalize,
            eps=args.eps,
            torch_dtype=dtype,
            overwrite=args.overwrite,
            config=args.config,
            output_norm=args.output_norm,
            keep_softmax=args.keep_softmax,
            max_attention_cost=args.attention_budget,
            calibration_samples=args.calibration_samples,
            calibration_seed=args.calibration_seed,
            calibration_embeddings=args.calibration_embeddings,
            layers_2=args.layers_2,
            calibration_latent_size=args.calibration_latent_size,
            device=args.device,
            cost=_cost(args),
            **_options(args),
        )
    except AlreadyConvertedError as err:
        print(f"convert.py: {err}", file=sys.stderr)
        return 3
    except (ValueError, FileNotFoundError, FileExistsError) as err:
        print(f"convert.py: {err}", file=sys.stderr)
        return 2
    print(json.dumps(spec, indent=2))
    return 0


def _cost(args):
    """``--cost`` / ``--cost-grid`` / ``--cost-cache`` as convert_checkpoint's ``cost`` (``ValueError`` if inconsistent)."""
    if args.cost != "measured":
        if args.cost_grid is not None or args.cost_cache is not None:
            raise ValueError("--cost-grid and --cost-cache set how --cost measured times the layers; add --cost measured")
        return args.cost
    from mhla_diffusers.selection.cost import MeasuredCost

    return MeasuredCost(grid=args.cost_grid, cache=args.cost_cache)


def _options(args) -> dict:
    """The per-layer options given on the command line, as convert_checkpoint keywords (defaults left out)."""
    options = {
        "init": args.mixing_init, "feature_eps": args.feature_eps, "feature_power": args.feature_power, "rope": args.rope,
        "gate": args.gate, "lepe_init": args.lepe_init,
    }
    options = {key: value for key, value in options.items() if value is not None}
    if args.lepe:
        options["lepe"] = True
    if args.no_mixing_clamp:
        options["mixing_clamp"] = False
    return options


def _import_authors(args) -> int:
    """--from authors: the authors' Wan MHLA checkpoint into the converted format (exit 2 on bad input)."""
    given = {
        "--layers": args.layers is not None,
        "--num-blocks": args.num_blocks is not None,
        "--no-normalize": args.no_normalize,
        "--output-norm / --no-output-norm": args.output_norm is not None,
        "--keep-softmax / --attention-budget": args.keep_softmax is not None or args.attention_budget is not None,
        "--calibration-*": any(v is not None for v in (args.calibration_samples, args.calibration_seed, args.calibration_embeddings,
                                                       args.calibration_latent_size)),
        "--device": args.device is not None,
        "--cost / --cost-grid / --cost-cache": any(v is not None for v in (args.cost, args.cost_grid, args.cost_cache)),
        "--layers-2": args.layers_2 is not None,
        "--mixing-init / --feature-eps / --feature-power / --no-mixing-clamp / --rope / --gate / --lepe / --lepe-init": bool(
            _options(args)
        ),
    }
    if args.family == "dit":
        given["--block-grid"] = args.block_grid is not None
        given["--norm-output"] = args.norm_output
    else:  # their DiT run's eps is read from the file (--eps when it holds no run arguments); their Wan layer's is 1e-6
        given["--eps"] = args.eps is not None
    fixed = [flag for flag, on in given.items() if on]
    problem = None
    if args.family not in ("wan", "dit"):
        problem = (f"--from authors imports the authors' Wan2.1 MHLA model (--family wan) or a DiT of their mhla_dit code "
                   f"(--family dit); got {args.family!r}")
    elif fixed:
        problem = (
            f"{', '.join(fixed)} cannot be set with --from authors: the MHLA layers, blocks, normaliser, output norm, "
            "feature epsilon and the authors' modules are those of their model, read from the file"
        )
    elif args.config is None:
        problem = ("--from authors needs --config: a diffusers Wan2.1-T2V-1.3B pipeline folder, transformer folder or Hub id"
                   if args.family == "wan" else "--from authors --family dit needs --config: a diffusers DiT pipeline or "
                   "transformer folder (or Hub id) of the same architecture")
    if problem is not None:
        print(f"convert.py: {problem}", file=sys.stderr)
        return 2

    import torch

    dtype = None if DTYPES[args.dtype] is None else getattr(torch, DTYPES[args.dtype])
    if args.family == "dit":
        from mhla_diffusers.checkpoint.authors_dit import import_authors_dit

        return _report(import_authors_dit, args.src, args.out, config=args.config, torch_dtype=dtype,
                       overwrite=args.overwrite, state_dict_key=args.state_dict_key, eps=args.eps)

    from mhla_diffusers.checkpoint.authors import AUTHORS_BLOCK_GRID, import_authors_wan

    block_grid = AUTHORS_BLOCK_GRID if args.block_grid in (None, "authors") else args.block_grid
    if isinstance(block_grid, str) or len(block_grid) != 3:
        print(f"convert.py: --from authors takes --block-grid as bt,bh,bw (default 3,5,10); got {args.block_grid!r}",
              file=sys.stderr)
        return 2
    return _report(import_authors_wan, args.src, args.out, config=args.config, torch_dtype=dtype, overwrite=args.overwrite,
                   state_dict_key=args.state_dict_key, block_grid=tuple(block_grid), norm_output=args.norm_output)


def _report(importer, *args, **kwargs) -> int:
    """Run an importer; print its spec (exit 0) or its error (exit 2)."""
    try:
        spec = importer(*args, **kwargs)
    except (ValueError, FileNotFoundError, FileExistsError) as err:
        print(f"convert.py: {err}", file=sys.stderr)
        return 2
    print(json.dumps(spec, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
