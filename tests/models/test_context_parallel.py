"""MHLA under diffusers' context parallelism (models/parallel.py), on CPU processes over gloo.

tests/models/context_parallel_check.py runs every multi-process case under ``torchrun`` with 2 and 3
processes (one launch each: process start costs ~9 s); these tests read its results. Reference: the
single-process run of the same model on the same inputs, outputs and the gradients of a training step
(q, k, v projections and mixing matrices, summed over ranks), within 1e-5 relative. Plus the one-process
parts: plans, errors, the communication formulas, generate.py under torchrun.
"""

from __future__ import annotations

import pytest
import torch
from helpers import tiny_dit
from helpers_parallel import torchrun
from helpers_sana import tiny_sana
from helpers_wan import tiny_wan

import mhla_diffusers
from mhla_diffusers.models.parallel import communication_bytes, context_parallel_plan, cpu_device_mesh, shard_sizes

TOL = 1e-5  # outputs (fp32, relative); gradients sum more terms in another order: GRAD_TOL
GRAD_TOL = 1e-4


# the torchrun launches: tests/helpers_parallel.py; the shared `results` fixture: tests/models/conftest.py
_torchrun = torchrun


def _case(results, name: str) -> dict:
    world, all_results = results
    case = all_results[name]
    assert "exception" not in case, f"P={world}: {case.get('exception')}"
    return case


def _exchanges(case: dict, direction: str, kind: str = "all_reduce") -> list[int]:
    return [e["bytes"] for e in case["exchanges"] if e["direction"] == direction and e["kind"] == kind]


def _check_exact(case: dict, grads: bool = True) -> None:
    assert case["output"] < TOL, case["output"]
    if grads:
        assert case["grads"] and max(case["grads"].values()) < GRAD_TOL, case["grads"]


def test_wan_oneliner_ring_output_gradients_and_bytes(results):
    """Wan, the one-liner, ring mode by diffusers' own enable_parallelism, RoPE: output and gradients exact;
    one all-reduce per layer forward and one backward, each of exactly the bytes the formula gives (B * heads * M * d * (d + 1) * 4)."""
    case = _case(results, "case_wan_oneliner_ring")
    _check_exact(case)
    names = case["grads"]
    assert {n.split(".attn1.")[1] for n in names} == {"to_q.weight", "to_k.weight", "to_v.weight", "mhla.mixing.weight"}
    payload = case["formula"]["mhla_payload"]
    assert payload == 2 * 2 * 12 * 12 * 13 * 4
    assert _exchanges(case, "forward") == [payload] * case["layers"]
    assert _exchanges(case, "backward") == [payload] * case["layers"]


def test_wan_hybrid_ulysses(results):
    """Wan hybrid by apply_mhla under Ulysses: the softmax layer runs diffusers' all-to-alls (q, k, v, output:
    what the formula counts); the two MHLA layers run per head after all-to-alls of the same sizes (6 heads:
    heads mode for P = 2 and 3), the RoPE tables gathered once per forward; output and gradients exact."""
    world, _ = results
    case = _case(results, "case_wan_hybrid_ulysses")
    _check_exact(case)
    assert any("blocks.0.attn1.to_q" in n for n in case["grads"]) and "blocks.0.attn1.mhla.mixing.weight" not in case["grads"]
    shard = 1 * 72 // world * 6 * 8 * 4  # [B, N / P, heads, d] float32
    stock = case["alltoall_bytes"][:4]
    assert stock == [shard] * 4
    assert sum(stock) * (world - 1) / world == pytest.approx(case["formula"]["ulysses"])
    assert _exchanges(case, "forward", "all_to_all") == [shard] * 8  # layers 1, 2: q, k, v, output
    assert len(_exchanges(case, "backward", "all_to_all")) == 8
    assert len(_exchanges(case, "forward", "all_gather")) == 1 and not _exchanges(case, "forward")


def test_wan_uneven_shards_ulysses_heads_mode(results):
    """175 tokens, ulysses_anything: per-head MHLA after all-to-alls of uneven shards, RoPE, gradient checkpointing
    (the recomputation repeats the all-to-alls but reuses the forward's RoPE tables); exact."""
    case = _case(results, "case_wan_uneven_ulysses")
    _check_exact(case)
    assert len(_exchanges(case, "forward", "all_to_all")) == 16 and len(_exchanges(case, "forward", "all_gather")) == 1


def test_wan_uneven_shards_numerator_only(results):
    """175 tokens over 2 or 3 ranks (ring_anything): shards of different lengths cutting blocks; numerator only
    with the output RMSNorm; gradient checkpointing (each layer's exchange runs again in the recomputation);
    output and gradients exact."""
    case = _case(results, "case_wan_uneven_numerator")
    _check_exact(case)
    assert len(_exchanges(case, "forward")) == 4 and len(_exchanges(case, "backward")) == 2


def test_sana_and_dit(results):
    """SANA (one-liner, ring; inference) and DiT (apply_mhla, Ulysses mode, a training step): exact. DiT's 2 heads:
    heads mode over 2 ranks, the summary exchange over 3."""
    sana = _case(results, "case_sana_oneliner_ring")
    _check_exact(sana, grads=False)
    assert len(_exchanges(sana, "forward")) == 2
    world, _ = results
    dit = _case(results, "case_dit_ulysses")
    _check_exact(dit)
    kind, count = ("all_to_all", 8) if world == 2 else ("all_reduce", 2)  # 2 heads: Ulysses degree 3 cannot split them
    assert len(_exchanges(dit, "forward", kind)) == count and len(_exchanges(dit, "backward", kind)) == count


def test_pipeline_generation(results):
    """generate_videos(context_parallel="ring"): the single-process video (2 steps x 2 CFG calls x 2 layers exchanges)."""
    case = _case(results, "case_wan_pipeline_generate")
    assert case["output"] < TOL and len(_exchanges(case, "forward")) == 8


def test_clear_errors_under_torchrun(results):
    world, _ = results
    tokens = _case(results, "case_wan_indivisible_refused")["error"]
    assert tokens and "175 tokens" in tokens and f"{world} ranks" in tokens and "ring_anything=True" in tokens
    heads = _case(results, "case_ulysses_heads_refused")["error"]
    assert heads and f"{world + 1} heads" in heads and f"ulysses_degree={world}" in heads
    lse = _case(results, "case_hybrid_ring_native_refused")["error"]
    assert lse and "log-sum-exp" in lse and "'native'" in lse and "set_attention_backend" in lse and "ulysses" in lse


def test_processor_changed_after_enable(results):
    """remove_mhla under context parallelism: Wan's stock attention put back runs diffusers' context parallelism (the
    stock output, not one shard's attention); DiT's, which has none, is refused at the next forward, never run on a shard."""
    case = _case(results, "case_processor_changed_after_enable")
    assert case["output"] < TOL
    assert case["error"] and "now run the stock attention" in case["error"] and "transformer_blocks.0.attn1" in case["error"]


# -- one process ------------------------------------------------------------------------------------
def test_plans():
    """Wan: its own plan; DiT: split at the first block, gathered after proj_out_2; SANA: the MHLA layers alone."""
    wan = tiny_wan(num_layers=3)
    mhla_diffusers.apply_mhla(wan, layers="hybrid", block_grid=(1, 2, 2))
    assert context_parallel_plan(wan) == type(wan)._cp_plan
    dit = tiny_dit(num_layers=2)
    mhla_diffusers.apply_mhla(dit, layers="all", block_grid=(2, 2))
    assert sorted(context_parallel_plan(dit)) == ["proj_out_2", "transformer_blocks.0"]
    sana = tiny_sana(num_layers=3)
    mhla_diffusers.apply_mhla(sana, layers="hybrid", block_grid=(2, 2))
    plan = context_parallel_plan(sana)
    assert sorted(plan) == [f"transformer_blocks.{i}.attn1{s}" for i in (1, 2) for s in ("", ".to_out.0")]


def test_plan_errors():
    with pytest.raises(ValueError, match="has no MHLA layer"):
        context_parallel_plan(tiny_wan(num_layers=1))
    dit = tiny_dit(num_layers=3)
    mhla_diffusers.apply_mhla(dit, layers="hybrid", block_grid=(2, 2))
    with pytest.raises(ValueError, match="layers='all'"):
        context_parallel_plan(dit)
    with pytest.raises(ValueError, match="not a supported transformer"):
        context_parallel_plan(torch.nn.Linear(2, 2))


def test_enable_needs_torch_distributed():
    from diffusers import ContextParallelConfig

    model = tiny_wan(num_layers=1)
    mhla_diffusers.apply_mhla(model, block_grid=(1, 2, 2))
    with pytest.raises(RuntimeError, match="torch.distributed initialised"):
        mhla_diffusers.enable_context_parallel(model, ContextParallelConfig(ring_degree=2))


def test_cpu_device_mesh_is_scoped():
    """Without an accelerator device_count() is 0 (diffusers divides by it); 1 inside the block only."""
    before = torch.accelerator.device_count()
    with cpu_device_mesh():
        assert torch.accelerator.device_count() == max(before, 1)
    assert torch.accelerator.device_count() == before


def test_shard_sizes_follow_tensor_split():
    for total, world in ((175, 2), (175, 3), (72, 3), (5, 4)):
        sizes = shard_sizes(total, world)
        assert sizes == [len(c) for c in torch.arange(total).tensor_split(world)]


def test_communication_formulas():
    """Wan2.1-1.3B at 480p (32,760 tokens, 12 heads x 128, M = 105), P = 2: the numbers by hand."""
    b = communication_bytes(32760, 12, 128, 105, 2)
    assert b["mhla_payload"] == 12 * 105 * 128 * 129 * 4
    assert b["mhla"] == b["mhla_payload"]  # 2 (P - 1) / P = 1
    assert b["ring"] == 2 * 16380 * 12 * 128 * 2
    assert b["ulysses"] == 4 * 0.5 * 16380 * 12 * 128 * 2
    assert communication_bytes(32760, 12, 128, 105, 2, normalize=False)["mhla_payload"] == 12 * 105 * 128 * 128 * 4
    with pytest.raises(ValueError):
        communication_bytes(32760, 12, 128, 105, 1)


def test_generate_cli_under_torchrun(tmp_path):
    """pipelines/generate.py --context-parallel ulysses under torchrun with 2 gloo processes: rank 0 writes the
    mp4 once; its frames match those of the single-process run (both through the same mp4 encoder)."""
    import imageio.v3 as iio
    from helpers_wan import tiny_wan_pipeline

    from mhla_diffusers.generation import generate_videos, save_video

    pipe = tiny_wan_pipeline(num_layers=2)
    mhla_diffusers.apply_mhla(pipe.transformer, layers="all", block_grid=(1, 2, 2))
    mhla_diffusers.save_mhla_pipeline(pipe, tmp_path / "ckpt")
    args = ["--prompt", "a cat", "--frames", "5", "--height", "48", "--width", "64", "--steps", "2", "--seed", "1"]
    run = _torchrun(2, "pipelines/generate.py", "--checkpoint", str(tmp_path / "ckpt"), *args,
                    "--context-parallel", "ulysses", "--out", str(tmp_path / "cp.mp4"))
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    assert run.stdout.count("wrote 1 video(s)") == 1
    single = generate_videos(tmp_path / "ckpt", ["a cat"], frames=5, height=48, width=64, steps=2, seed=1)[0]
    save_video(single, tmp_path / "single.mp4")
    got, want = (iio.imread(tmp_path / name).astype(float) for name in ("cp.mp4", "single.mp4"))
    assert got.shape == want.shape == (5, 48, 64, 3) and want.std() > 1
    assert abs(got - want).mean() < 0.5


def test_generate_cli_without_torchrun(tmp_path, capsys):
    """--context-parallel outside torchrun: exit 2 naming torchrun, before anything is loaded."""
    from helpers import run_main

    code, err = run_main("pipelines/generate.py", "--checkpoint", str(tmp_path / "none"), "--prompt", "a cat",
                         "--context-parallel", "ring", "--out", str(tmp_path / "x.png"), capsys=capsys)
    assert code == 2 and "torchrun --nproc_per_node" in err


def test_wan_layer_options_under_context_parallelism(results):
    """RoPE before phi / none, the authors' and the neutral gate, numerator only + output norm, feature_eps and
    feature_power: outputs and gradients (the gate's included) exact in ring (summary) and Ulysses (heads) mode."""
    for name in ("case_wan_options_ring", "case_wan_options_ulysses"):
        case = _case(results, name)
        _check_exact(case)
        assert any(n.endswith("mhla.gate.weight") for n in case["grads"]), name


def test_lepe_is_refused_under_context_parallelism(results):
    case = _case(results, "case_lepe_refused")
    assert "['blocks.0.attn1'] have a LePE convolution" in case["enable"]
    assert "LePE is not supported under context parallelism" in case["call"]
