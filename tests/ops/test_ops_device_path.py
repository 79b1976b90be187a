"""The torch backend's GPU code path, run on CPU tensors: the windowed forward (``ops/windows.py``) and the
one-chunk backward that every device but the CPU takes.

``torch_ops._FORCE_DEVICE_PATH`` (private, for tests only) sends CPU tensors down that branch; there the GEMMs
of 16-bit keys and values are upcast (a GPU multiplies them into fp32 directly: the same products, exact in
fp32, and the same sums). The correctness tests imported below from ``test_ops.py``, ``test_ops_rotary.py`` and
``test_ops_features.py`` run again on that path (outputs and gradients against the dense float64 reference,
uneven blocks, fp64 / fp32 / fp16 / bf16, diffusers' memory layout, RoPE, batch invariance bit for bit), with
the chunked forward refused, so a case that fell back to it would fail. Then the windows themselves, and the
cost of the path as ``benchmarks/kernel_costs.py`` counts it on ``meta`` tensors at Wan2.1-1.3B 480p.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import test_ops
import test_ops_features
import test_ops_rotary
import torch
from helpers import benchmark_module
from test_ops import TOL, make_inputs, make_mixing, rel_err

from mhla_diffusers import BlockLayout, mhla_attention, mhla_attention_reference
from mhla_diffusers.ops import torch_ops, windows
from mhla_diffusers.ops.windows import WindowForward, axis_groups, key_bounds, token_slots, window_plan

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
_CHUNKED_FORWARD = torch_ops._forward_chunks  # the real one (the fixture below replaces the module's name)


@pytest.fixture(autouse=True)
def device_path(monkeypatch):
    """Every test here runs the GPU code path on CPU tensors, never the chunked forward."""
    monkeypatch.setattr(torch_ops, "_FORCE_DEVICE_PATH", True)

    def refused(*args, **kwargs):
        raise AssertionError("the chunked forward ran: the windowed forward was expected")

    monkeypatch.setattr(torch_ops, "_forward_chunks", refused)


# The operator's correctness tests, again on this path (pytest collects them under this module).
test_matches_reference_on_grids_fp64 = test_ops.test_matches_reference_on_grids_fp64
test_matches_reference_on_grids_fp32 = test_ops.test_matches_reference_on_grids_fp32
test_head_dims = test_ops.test_head_dims
test_value_head_dim_differs_from_query = test_ops.test_value_head_dim_differs_from_query
test_dtypes = test_ops.test_dtypes
test_mixed_dtypes_are_cast = test_ops.test_mixed_dtypes_are_cast
test_one_block_is_plain_linear_attention = test_ops.test_one_block_is_plain_linear_attention
test_identity_mixing_is_attention_inside_each_block = test_ops.test_identity_mixing_is_attention_inside_each_block
test_c01_fp16_large_values_one_block_finite_and_accurate = test_ops.test_c01_fp16_large_values_one_block_finite_and_accurate
test_c02_fp16_all_negative_query_and_block_no_nan_exact_zero = test_ops.test_c02_fp16_all_negative_query_and_block_no_nan_exact_zero
test_c03_sample_results_independent_of_batch = test_ops.test_c03_sample_results_independent_of_batch
test_c04_wan_grids_against_blockwise_loop = test_ops.test_c04_wan_grids_against_blockwise_loop
test_c04_wan_grid_gradients_against_blockwise_loop = test_ops.test_c04_wan_grid_gradients_against_blockwise_loop
test_c07_tiny_inputs = test_ops.test_c07_tiny_inputs
test_non_contiguous_inputs = test_ops.test_non_contiguous_inputs
test_inputs_sliced_out_of_a_larger_buffer = test_ops.test_inputs_sliced_out_of_a_larger_buffer
test_inputs_not_modified = test_ops.test_inputs_not_modified
test_eps_is_added_to_the_denominator = test_ops.test_eps_is_added_to_the_denominator
test_empty_batch = test_ops.test_empty_batch
test_gradcheck_float64_uneven_layout = test_ops.test_gradcheck_float64_uneven_layout
test_first_call_under_inference_mode_then_training = test_ops.test_first_call_under_inference_mode_then_training
test_rotary_matches_reference = test_ops_rotary.test_rotary_matches_reference
test_rotary_low_precision_inputs = test_ops_rotary.test_rotary_low_precision_inputs
test_rotary_non_contiguous_diffusers_layout = test_ops_rotary.test_rotary_non_contiguous_diffusers_layout
test_gradcheck_rotary_float64 = test_ops_rotary.test_gradcheck_rotary_float64
test_interleaved_rotary_in_the_operator_matches_reference = test_ops_rotary.test_interleaved_rotary_in_the_operator_matches_reference
test_feature_map_none_gradients_have_no_relu_mask = test_ops_rotary.test_feature_map_none_gradients_have_no_relu_mask
test_feature_power_dtypes = test_ops_features.test_feature_power_dtypes


# ----------------------------------------------------------------------------------------------
# The windows


LAYOUTS = [
    ((21, 30, 52), (3, 5, 7)),  # Wan2.1 480p, M = 105: W uneven (three groups)
    ((21, 30, 52), (3, 4, 7)),  # H and W uneven
    ((21, 30, 52), (4, 4, 4)),  # T and H uneven
    ((1, 16, 16), (1, 3, 3)),  # DiT-XL/2 256 px
    ((7, 9), (2, 3)),
    ((13,), (4,)),
    ((8, 8), (2, 2)),  # even: one piece, no pad
    ((1, 1), (1, 1)),
]


def _slot_tokens(layout):
    """``[M, L]``: the token in each slot of the windowed buffer (windows, pads included), and whether it is the block's own."""
    plan = window_plan(layout)
    ids = torch.arange(layout.num_tokens, dtype=torch.float64).view(1, -1, 1)  # one head, one channel
    buf = torch.full(plan.buffer_shape(1, 1), -1.0, dtype=torch.float64)
    own = torch.zeros(plan.buffer_shape(1, 1), dtype=torch.bool)
    for piece in plan.pieces:
        plan.blocks(buf, piece).copy_(plan.window(ids, piece))
        plan.blocks(own, piece, real=True).fill_(True)
    return plan, buf.view(plan.num_blocks, plan.length).long(), own.view(plan.num_blocks, plan.length)


@pytest.mark.parametrize("grid,block_grid", LAYOUTS, ids=[f"{g}-{b}" for g, b in LAYOUTS])
def test_windows_hold_each_token_once_in_its_block(grid, block_grid):
    """Every slot holds a token (windows stay inside the grid); a block's own slots hold its tokens, each token once;
    pads hold tokens of other blocks and are exactly where the key bounds zero phi(k); token_slots agrees."""
    layout = BlockLayout(grid, block_grid)
    plan, tokens, own = _slot_tokens(layout)
    assert plan.length == layout.max_block_size and (tokens >= 0).all()
    blocks = torch.arange(plan.num_blocks)[:, None].expand_as(tokens)
    assert torch.equal(layout.block_index[tokens[own]], blocks[own])
    assert torch.equal(torch.sort(tokens[own]).values, torch.arange(layout.num_tokens))
    assert (layout.block_index[tokens[~own]] != blocks[~own]).all()
    lo, hi = key_bounds(plan, torch.device("cpu"), torch.float32, True)
    assert torch.equal(hi.reshape(plan.num_blocks, plan.length) == 0, ~own) and (lo == 0).all()
    slots = token_slots(plan, torch.device("cpu"))
    assert torch.equal(tokens.view(-1)[slots], torch.arange(layout.num_tokens))
    assert plan.padded == bool((~own).any())


def test_axis_groups_of_wan_480p():
    """W = 52 in 7 runs (8, 7, 8, 7, 8, 7, 7): long runs at 0, 15, 30; short ones at 8, 23, 38 and 45."""
    groups = axis_groups(52, 7)
    assert [(g.first, g.step, g.count, g.start, g.stride, g.short) for g in groups] == [
        (0, 2, 3, 0, 15, False), (1, 2, 3, 8, 15, True), (6, 1, 1, 45, 0, True)]
    assert [len(axis_groups(n, b)) for n, b in ((21, 3), (30, 5), (30, 4), (21, 4), (52, 4))] == [1, 1, 2, 2, 1]
    assert len(window_plan(BlockLayout((21, 30, 52), (3, 5, 7))).pieces) == 3


def test_beyond_max_pieces_the_chunked_forward_runs(monkeypatch):
    """A layout of more pieces than ``_MAX_PIECES`` takes the chunked forward (here: any layout, the cap set to 0)."""
    calls = []
    monkeypatch.setattr(torch_ops, "_MAX_PIECES", 0)
    monkeypatch.setattr(torch_ops, "_forward_chunks", lambda *a: calls.append(1) or _CHUNKED_FORWARD(*a))
    layout = BlockLayout((7, 9), (2, 3))
    q, k, v = make_inputs(1, 2, layout.num_tokens, 8, dtype=torch.float64)
    mixing = make_mixing(layout, "rand", torch.float64)
    out = mhla_attention(q, k, v, mixing, layout, backend="torch")
    assert calls and rel_err(out, mhla_attention_reference(q, k, v, mixing, layout)) < TOL[torch.float64]


def test_bf16_keys_and_values_stay_bf16_with_an_fp32_accumulator():
    """bf16 k, v: the key and value buffers are bf16 (the GEMM accumulates into fp32); a bf16 q still gets an fp32
    phi(Q) and result; fp32 k with bf16 v: both cast into fp32 buffers."""
    layout = BlockLayout((7, 9), (2, 3))
    q, k, v = make_inputs(1, 2, layout.num_tokens, 8, dtype=torch.bfloat16)
    run = WindowForward(window_plan(layout), q, k, v, torch.float32, True, True)
    assert (run.keys.dtype, run.values.dtype, run.queries.dtype, run.result.dtype) == (torch.bfloat16,) * 2 + (torch.float32,) * 2
    assert run.values.shape[-1] % windows._COLUMNS == 0 and run.summary.shape[-1] == 9  # [S | z]
    run = WindowForward(window_plan(layout), q, k.float(), v, torch.float32, True, True)
    assert run.keys.dtype == run.values.dtype == torch.float32


def test_16_bit_buffers_only_where_the_device_gives_fp32_products(monkeypatch):
    """The GPU path keeps 16-bit key / value buffers only where bmm(out_dtype=fp32, out=<strided>) runs and gives the
    fp32 products (probed once per device and dtype): a device where it raises gets fp32 buffers (the same sums).
    Here: the CPU has no bmm.dtype kernel, so its probe says no; a device whose probe says no casts into fp32."""
    assert windows._fp32_products_work(torch.device("cpu"), torch.bfloat16) is False
    layout = BlockLayout((7, 9), (2, 3))
    q, k, v = make_inputs(1, 2, layout.num_tokens, 8, dtype=torch.bfloat16)
    cuda_like = k.to("meta")
    assert windows._key_value_dtype(cuda_like, cuda_like, torch.float32) == torch.bfloat16  # meta: counted as CUDA
    fake = type("FakeCuda", (), {"dtype": torch.bfloat16, "device": torch.device("cuda")})()
    for works, dtype in ((False, torch.float32), (True, torch.bfloat16)):
        monkeypatch.setattr(windows, "_fp32_products_work", lambda device, kind, works=works: works)
        assert windows._key_value_dtype(fake, fake, torch.float32) == dtype


# ----------------------------------------------------------------------------------------------
# The cost of the path, counted (benchmarks/kernel_costs.py: ATen ops on meta tensors, inputs plus outputs)


def _kernel_costs():
    return benchmark_module("kernel_costs")


@pytest.mark.parametrize("memory", ["bhnd", "bnhd"])
def test_wan_forward_ops_and_bytes_on_the_gpu_path(memory):
    """Wan2.1-1.3B 480p (12 x 128, M = 105), bf16, batch 1: 17 ATen ops, at most 5.1x the floor in bytes, no gather
    or scatter (index ops) and no fp32 copy of a whole input, in either memory layout (2026-12-04: 17 ops, 5.04x)."""
    costs = _kernel_costs()
    report = costs.torch_backend_traffic(1, 12, (21, 30, 52), 128, (3, 5, 7), "bfloat16", False, memory)
    fwd = report["forward"]
    assert fwd["ops"] <= 17 and fwd["floor_ratio"] <= 5.1, (fwd["ops"], fwd["floor_ratio"])
    assert not any(name.startswith(("index", "_to_copy")) for name in fwd["by_op"]), sorted(fwd["by_op"])
