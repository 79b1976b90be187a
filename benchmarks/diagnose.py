#!/usr/bin/env python
"""Rank and entropy of the attention matrices of a DiT checkpoint on real photos (MHLA paper, Fig. 3).

For every self-attention layer (or the chosen ones) of a plain or converted DiT pipeline folder:
captures the layer's own q, k in one forward on real inputs (photo crops shipped in the
scikit-image / scikit-learn wheels at the checkpoint's resolution, encoded by the pipeline's vae,
noised at a few timesteps, with class labels), then measures the numerical rank and the mean row
entropy of the N x N attention matrix that softmax attention, plain ReLU linear attention and
MHLA (the layer's own mixing matrix, else the locality init at --num-blocks) would have on them.

    python benchmarks/diagnose.py --checkpoint demo/base_dit --out diagnose_out
    python benchmarks/diagnose.py --checkpoint /tmp/x --layer 2 --num-samples 8

Writes into --out: diagnostics.json, diagnostics.md (the table), rank_entropy.png and the mixing
matrices (mixing_layer<i>.png, or mixing_locality_init.png). Prints the table.
"""

from __future__ import annotations

import argparse
import os
import sys


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint", required=True, help="diffusers DiT pipeline folder (plain or converted)")
    parser.add_argument("--layer", type=int, nargs="+", default=None, help="self-attention layer index(es) (default: all)")
    parser.add_argument("--num-samples", type=int, default=4, help="photo crops (each noised at every --timesteps)")
    parser.add_argument("--timesteps", type=int, nargs="+", default=[100, 500, 900], help="noise timesteps")
    parser.add_argument("--num-blocks", type=int, default=16, help="blocks M of the locality init for layers without MHLA")
    parser.add_argument("--rtol", type=float, default=None,
                        help="rank tolerance relative to the largest singular value (default N * eps(float64))")
    parser.add_argument("--short-side", type=int, default=None, help="photos are resized to this short side (px) before cropping")
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--out", default="diagnose_out", help="output folder")
    args = parser.parse_args(argv)

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1") or 1))
    from mhla_diffusers import MHLACheckpointError, load_mhla_pipeline
    from mhla_diffusers.diagnostics import diagnose_pipeline, markdown_report, write_report

    try:
        pipe = load_mhla_pipeline(args.checkpoint, torch_dtype=torch.float32)
        result = diagnose_pipeline(
            pipe,
            layers=args.layer,
            num_samples=args.num_samples,
            timesteps=args.timesteps,
            num_blocks=args.num_blocks,
            rtol=args.rtol,
            seed=args.seed,
            short_side=args.short_side,
        )
    except (FileNotFoundError, MHLACheckpointError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    result["checkpoint"] = str(args.checkpoint)
    files = write_report(result, args.out, pipe=pipe)
    print(markdown_report(result))
    print("wrote " + ", ".join(str(p) for p in files.values()), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
