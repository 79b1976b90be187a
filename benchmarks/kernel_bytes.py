"""The bytes model: HBM bytes of MHLA's two backends against the compulsory floor, worked out without a GPU.

Part of ``kernel_costs`` (``benchmarks/kernel_costs.py``: the method), from the launches and ATen ops that
``kernel_launches.py`` records on ``meta`` tensors.

- **Triton backend** (:func:`bytes_model`): per launch, from the kernel's loads and stores (per program: which
  tensors, how many bytes; how many programs), under three assumptions on what stays in L2
  (:data:`SCENARIOS`), plus the torch operations the launcher runs between kernels.
- **Torch backend** (:func:`torch_backend_traffic`): ``mhla_attention(..., backend="torch")`` on ``meta``
  tensors, every ATen op and the bytes of its tensor inputs plus outputs. ``torch_ops.py`` branches on
  ``device.type != "cpu"`` only, so ``meta`` takes every branch that CUDA takes (one chunk holding all heads,
  no kept workspace, no huge pages).

Importing this module imports neither torch nor triton.
"""

from __future__ import annotations

from dataclasses import dataclass

from kernel_launches import (
    SMALL_BYTES,
    Launch,
    OpRecord,
    Recording,
    _inputs,
    _layout,
    _op_summary,
    _rotary,
    _torch_dtype,
    op_counter,
    record,
)

#: H200 nominal HBM3e bandwidth, bytes / s (estimates only: not yet measured on a GPU).
H200_BYTES_PER_S = 4.8e12

#: What the bytes model assumes stays in L2, by scenario name.
SCENARIOS = {
    "no_l2": "every program's loads and stores reach HBM (tensors under 1 MiB count once per launch): the RoPE tables "
             "once per head, a block's summary once per split (fwd_output, bwd_key walk a split's tiles), the mixing "
             "GEMM's operand once per row tile",
    "shared_in_l2": "what the programs of one launch share is read from HBM once (RoPE tables once per launch, each "
                    "fp32 summary once per launch); everything passed between kernels or torch ops crosses HBM",
    "summaries_on_chip": "as shared_in_l2, and the fp32 summaries (S, z, their splits, mixes and gradients) never "
                         "reach HBM: the bound for kernels that keep them on chip",
}
#: The scenario reported as ``forward_bytes`` / ``backward_bytes``.
DEFAULT_SCENARIO = "shared_in_l2"


# ---------------------------------------------------------------------------------------------
# The bytes model: per kernel, from its loads and stores


@dataclass
class Access:
    """Bytes one launch moves for one tensor: ``loaded`` summed over its programs, ``unique`` distinct bytes."""

    tensor: str
    kind: str  # "stream" (q, k, v, outputs, gradients), "summary" (fp32 S, z and their kin), "table" (RoPE), "small"
    write: bool
    loaded: float
    unique: float

    def bytes(self, scenario: str) -> float:
        """HBM bytes under ``scenario`` (a key of :data:`SCENARIOS`)."""
        if self.kind == "summary" and scenario == "summaries_on_chip":
            return 0.0
        if self.kind == "small" or self.unique < SMALL_BYTES:
            return self.unique
        if self.write or self.kind == "stream" or scenario == "no_l2":
            return self.loaded
        return self.unique


def _tokens_per_program(layout, programs_per_block: int, tokens_per_program: int) -> list[int]:
    """Tokens each program of a (block, split or tile) grid axis handles, block by block."""
    out = []
    for size in layout.block_sizes.tolist():
        for p in range(programs_per_block):
            out.append(max(0, min((p + 1) * tokens_per_program, size) - p * tokens_per_program))
    return out


def _elem(t) -> int:
    return t.element_size()


def _order(tokens, bh) -> Access:
    """The block-major token order (int32 ``[N]``), read by every (batch, head) program: under 1 MiB, once per launch."""
    return Access("order", "small", False, float(tokens * bh * 4), float(tokens * 4))


def _rows(name, kind, width_bytes, tokens, bh, write=False) -> Access:
    """A per-token tensor read or written once per (token, batch x head): ``tokens x bh`` rows of ``width_bytes``."""
    total = float(tokens * bh * width_bytes)
    return Access(name, kind, write, total, total)


def _tables(launch, tokens, bh, head_dim, cos) -> list[Access]:
    """The RoPE cos / sin tables ``[N, d/2]``, read per token by every (batch, head) program."""
    if not launch.meta.get("ROTARY"):
        return []
    row = head_dim // 2 * _elem(cos)
    return [Access(t, "table", False, float(tokens * bh * row), float(tokens * row)) for t in ("cos", "sin")]


def _per_block(name, kind, programs, unique_rows, row_bytes, write=False) -> Access:
    """A ``[M, B*H, ...]`` summary read (or written) whole by each of ``programs`` programs."""
    return Access(name, kind, write, float(programs * row_bytes), float(unique_rows * row_bytes))


def _split_grid(launch, layout) -> tuple[int, int, int]:
    """``(M, programs per block, B*H)`` of a ``(M x per_block, B*H)`` grid."""
    m = layout.num_blocks
    return m, launch.grid[0] // m, launch.grid[1]


def _traffic_fwd_summaries(launch, layout):
    k, v, order, _, _, s, z, cos = launch.args[:8]
    m, parts, bh = _split_grid(launch, layout)
    n, d, dv = layout.num_tokens, k.shape[-1], v.shape[-1]
    out = [_rows("k", "stream", d * _elem(k), n, bh), _rows("v", "stream", dv * _elem(v), n, bh),
           _order(n, bh), *_tables(launch, n, bh, d, cos),
           _per_block("S parts", "summary", m * parts * bh, m * parts * bh, d * dv * _elem(s), write=True)]
    if launch.meta["NORMALIZE"]:
        out.append(_per_block("z parts", "summary", m * parts * bh, m * parts * bh, d * _elem(z), write=True))
    tokens = launch.args[15]
    return out, _tokens_per_program(layout, parts, tokens)


def _traffic_fwd_output(launch, layout):
    q, st, zt, _, o, _, _, _, cos = launch.args[:9]
    m, tiles, bh = _split_grid(launch, layout)
    n, d, dv, programs = layout.num_tokens, q.shape[-1], o.shape[-1], m * tiles * bh
    out = [_rows("q", "stream", d * _elem(q), n, bh), _order(n, bh), *_tables(launch, n, bh, d, cos),
           _per_block("S~", "summary", programs, m * bh, d * dv * _elem(st)),
           _rows("out", "stream", dv * _elem(o), n, bh, write=True)]
    if launch.meta["NORMALIZE"]:
        out.append(_per_block("z~", "summary", programs, m * bh, d * _elem(zt)))
    return out, _tokens_per_program(layout, tiles, launch.meta["BLOCK_T"])


def _traffic_bwd_query(launch, layout):
    q, g, st, zt, _, dq, dst, dzt, _, _, _, cos = launch.args[:12]
    m, parts, bh = _split_grid(launch, layout)
    n, d, dv, programs = layout.num_tokens, q.shape[-1], g.shape[-1], m * parts * bh
    out = [_rows("q", "stream", d * _elem(q), n, bh), _rows("grad out", "stream", dv * _elem(g), n, bh),
           _order(n, bh), *_tables(launch, n, bh, d, cos),
           _per_block("S~", "summary", programs, m * bh, d * dv * _elem(st)),
           _per_block("dS~ parts", "summary", programs, programs, d * dv * _elem(dst), write=True)]
    if launch.meta["STORE_DQ"]:
        out.append(_rows("dq", "stream", d * _elem(dq), n, bh, write=True))
    if launch.meta["NORMALIZE"]:
        out += [_per_block("z~", "summary", programs, m * bh, d * _elem(zt)),
                _per_block("dz~ parts", "summary", programs, programs, d * _elem(dzt), write=True)]
    return out, _tokens_per_program(layout, parts, launch.args[19])


def _traffic_bwd_key(launch, layout):
    k, v, ds, dz, dk, dvv, _, _, _, cos = launch.args[:10]
    m, tiles, bh = _split_grid(launch, layout)
    n, d, dv, programs = layout.num_tokens, k.shape[-1], v.shape[-1], m * tiles * bh
    out = [_rows("k", "stream", d * _elem(k), n, bh), _order(n, bh), *_tables(launch, n, bh, d, cos),
           _per_block("dS", "summary", programs, m * bh, d * dv * _elem(ds))]
    if launch.meta["NEED_DV"]:
        out.append(_rows("dv", "stream", dv * _elem(dvv), n, bh, write=True))
    if launch.meta["NEED_DK"]:
        out += [_rows("v", "stream", dv * _elem(v), n, bh), _rows("dk", "stream", d * _elem(dk), n, bh, write=True)]
        if launch.meta["NORMALIZE"]:
            out.append(_per_block("dz", "summary", programs, m * bh, d * _elem(dz)))
    return out, _tokens_per_program(layout, tiles, launch.meta["BLOCK_T"])


def _traffic_mix_gemm(launch, layout):
    """``C = A @ B`` per column strip: each program loops over row tiles, each re-reading its strip of B."""
    a, b, c, rows, depth, ncol = launch.args[:6]
    row_tiles = -(-rows // launch.meta["BLOCK_R"])
    strips, item = launch.grid[0] * launch.grid[1], _elem(b)
    a_bytes = rows * depth * _elem(a)
    out = [Access("Mc", "small" if a_bytes < SMALL_BYTES else "summary", False, float(strips * a_bytes), float(a_bytes)),
           Access("B", "summary", False, float(row_tiles * depth * ncol * item), float(depth * ncol * item)),
           Access("C", "summary", True, float(rows * ncol * item), float(rows * ncol * item))]
    return out, None


_TRAFFIC = {
    "fwd_summaries": _traffic_fwd_summaries,
    "fwd_output": _traffic_fwd_output,
    "bwd_query": _traffic_bwd_query,
    "bwd_key": _traffic_bwd_key,
    "mix_gemm": _traffic_mix_gemm,
}


def launch_traffic(launch: Launch, layout) -> dict:
    """One launch's HBM bytes under each scenario, its accesses, and its programs (and how many handle no token)."""
    accesses, tokens = _TRAFFIC[launch.name](launch, layout)
    bh = launch.grid[1] if launch.name != "mix_gemm" else 1
    return {
        "kernel": launch.name,
        "role": launch.role,
        "phase": launch.phase,
        "grid": list(launch.grid),
        "programs": launch.programs,
        "empty_programs": None if tokens is None else bh * sum(1 for t in tokens if t == 0),
        "bytes": {s: sum(a.bytes(s) for a in accesses) for s in SCENARIOS},
        "accesses": [{"tensor": a.tensor, "kind": a.kind, "write": a.write, **{s: a.bytes(s) for s in SCENARIOS}} for a in accesses],
    }


def _ops_bytes(ops: list[OpRecord], scenario: str) -> float:
    """HBM bytes of the launcher's torch ops: all fp32 summaries here; tensors under 1 MiB count once."""
    if scenario == "summaries_on_chip":
        return float(sum(o.small for o in ops))
    return float(sum(o.read + o.written for o in ops))


def _pass_bytes(launches: list[Launch], ops: list[OpRecord], layout) -> dict:
    kernels = [launch_traffic(launch, layout) for launch in launches]
    totals = {s: sum(k["bytes"][s] for k in kernels) + _ops_bytes(ops, s) for s in SCENARIOS}
    torch_ops = {"ops": len(ops), "bytes": float(sum(o.read + o.written for o in ops)), "names": sorted({o.name for o in ops})}
    return {"bytes": totals, "kernels": kernels, "torch_ops": torch_ops}


def floor_bytes(batch, heads, tokens, head_dim, dtype, head_dim_v=None) -> dict:
    """Compulsory HBM bytes: forward = read q, k, v + write the output; backward = read q, k, v and the output
    gradient + write dq, dk, dv (the output is not needed: the kernels recompute what they need). Input dtype."""
    dv = head_dim if head_dim_v is None else head_dim_v
    item = _torch_dtype(dtype).itemsize
    rows = batch * heads * tokens * item
    return {"forward": rows * (2 * head_dim + 2 * dv), "backward": rows * (4 * head_dim + 3 * dv)}


def _assumes(rope: bool) -> str:
    text = (f"bytes from each kernel's loads and stores (masked loads of padded rows and tails cost nothing) plus the "
            f"launcher's torch ops between kernels; '{DEFAULT_SCENARIO}' scenario: {SCENARIOS[DEFAULT_SCENARIO]}; "
            f"useful bytes, not 32-byte sectors; the floor excludes the RoPE tables")
    return text + ("; RoPE tables fp32 [N, d/2], computed once per forward outside the operator" if rope else "")


def bytes_model(batch, heads, grid, head_dim, block_grid, dtype, rope) -> dict:
    """Modelled HBM bytes of the Triton backend's forward and backward against the compulsory floor.

    Args:
        batch: samples. heads: attention heads. grid: token grid (T, H, W) or (H, W). head_dim: d (= d_v).
        block_grid: (bt, bh, bw) or (bh, bw); None: ``choose_block_grid(grid)``.
        dtype: q, k, v dtype (torch dtype or name: "bfloat16", "float16", "float32").
        rope: Wan's RoPE fused into the kernels (fp32 cos / sin tables).

    Returns:
        ``forward_bytes`` (an inference forward) and ``backward_bytes`` (the backward pass alone) under the
        ``"shared_in_l2"`` scenario, ``floor_bytes`` (forward: read q, k, v + write the output) and
        ``backward_floor_bytes``, their ratios, ``scenarios`` (all three: :data:`SCENARIOS`),
        ``estimated_us`` at the H200's nominal 4.8 TB/s, per-kernel ``kernels``, and ``assumes`` (text).
        Bytes are ints; nothing is measured.
    """
    rec = record(batch, heads, grid, head_dim, block_grid, dtype, rope)
    return _model_from_recording(rec, heads, head_dim, dtype, rope)


def _model_from_recording(rec: Recording, heads, head_dim, dtype, rope) -> dict:
    layout = rec.layout
    fwd = _pass_bytes(rec.forward, rec.forward_ops, layout)
    train = _pass_bytes(rec.train_forward, rec.train_forward_ops, layout)
    bwd = _pass_bytes(rec.backward, rec.backward_ops, layout)
    floor = floor_bytes(rec.batch, heads, layout.num_tokens, head_dim, dtype)
    scenarios = {s: {"forward_bytes": int(fwd["bytes"][s]), "train_forward_bytes": int(train["bytes"][s]),
                     "backward_bytes": int(bwd["bytes"][s]),
                     "forward_ratio": round(fwd["bytes"][s] / floor["forward"], 3),
                     "backward_ratio": round(bwd["bytes"][s] / floor["backward"], 3)} for s in SCENARIOS}
    main = scenarios[DEFAULT_SCENARIO]
    return {
        "batch": rec.batch, "heads": heads, "head_dim": head_dim, "tokens": layout.num_tokens,
        "grid": list(layout.grid), "block_grid": list(layout.block_grid), "num_blocks": layout.num_blocks,
        "max_block_size": layout.max_block_size, "dtype": str(_torch_dtype(dtype)).replace("torch.", ""), "rope": bool(rope),
        "forward_bytes": main["forward_bytes"], "backward_bytes": main["backward_bytes"],
        "floor_bytes": floor["forward"], "backward_floor_bytes": floor["backward"],
        "forward_ratio": main["forward_ratio"], "backward_ratio": main["backward_ratio"],
        "estimated_us": {"forward": round(main["forward_bytes"] / H200_BYTES_PER_S * 1e6, 1),
                         "backward": round(main["backward_bytes"] / H200_BYTES_PER_S * 1e6, 1),
                         "forward_floor": round(floor["forward"] / H200_BYTES_PER_S * 1e6, 1),
                         "backward_floor": round(floor["backward"] / H200_BYTES_PER_S * 1e6, 1),
                         "bandwidth": "H200 nominal 4.8 TB/s; not yet measured on a GPU"},
        "scenario": DEFAULT_SCENARIO,
        "scenarios": scenarios,
        "kernels": {"forward": fwd["kernels"], "train_forward": train["kernels"], "backward": bwd["kernels"]},
        "torch_ops": {"forward": fwd["torch_ops"], "train_forward": train["torch_ops"], "backward": bwd["torch_ops"]},
        "assumes": _assumes(rope),
    }


# ---------------------------------------------------------------------------------------------
# The torch backend's CUDA code path, counted


def torch_backend_traffic(batch, heads, grid, head_dim, block_grid, dtype, rope, memory="bnhd") -> dict:
    """ATen ops and bytes of ``mhla_attention(..., backend="torch")`` on its CUDA code path, on ``meta`` tensors.

    A warm call (caches filled by a first call, its backward included) is counted: ``forward`` under ``torch.no_grad``;
    ``forward_backward``: a forward with gradients of q, k, v and the mixing matrix, then the backward.
    Bytes: every op's tensor inputs plus outputs (views and allocations move none; ``out=`` and ``copy_``
    destinations count as outputs only). ``memory``: ``"bnhd"`` (diffusers' ``[B, N, H, d]`` viewed as
    ``[B, H, N, d]``) or ``"bhnd"`` (contiguous). With ``rope`` the rotation is composed around the backend
    (two backend calls), as ``mhla_attention`` does for the torch backend.
    """
    import torch

    from mhla_diffusers.ops import mhla_attention

    layout = _layout(grid, block_grid)
    dtype = _torch_dtype(dtype)
    rot = _rotary(layout, head_dim) if rope else None
    floor = floor_bytes(batch, heads, layout.num_tokens, head_dim, dtype)

    def count(train: bool):
        q, k, v, mixing = _inputs(batch, heads, layout, head_dim, dtype, memory, requires_grad=train)
        grad = torch.empty(batch, heads, layout.num_tokens, head_dim, dtype=dtype, device="meta")
        with torch.set_grad_enabled(train):
            warm = mhla_attention(q, k, v, mixing, layout, backend="torch", rotary=rot)  # warm: plan, chunks, tables
            if train:  # and the backward's caches
                torch.autograd.grad(warm, (q, k, v, mixing), grad)
            counter = op_counter()
            with counter:
                out = mhla_attention(q, k, v, mixing, layout, backend="torch", rotary=rot)
                if train:  # gradients returned, not accumulated into .grad (a model's q, k, v are not leaves)
                    torch.autograd.grad(out, (q, k, v, mixing), grad)
        return _op_summary(counter.ops, counter.views, counter.allocations)

    fwd, both = count(False), count(True)
    fwd["floor_ratio"] = round(fwd["bytes"] / floor["forward"], 2)
    both["floor_ratio"] = round(both["bytes"] / (floor["forward"] + floor["backward"]), 2)
    fwd["estimated_us"] = round(fwd["bytes"] / H200_BYTES_PER_S * 1e6, 1)
    both["estimated_us"] = round(both["bytes"] / H200_BYTES_PER_S * 1e6, 1)
    return {"memory": memory, "rope": bool(rope), "floor_bytes": floor["forward"], "backward_floor_bytes": floor["backward"],
            "forward": fwd, "forward_backward": both}
