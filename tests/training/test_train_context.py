"""Context parallelism in the trainer (``parallel.context``): CPU processes over gloo equal one process.

tests/training/context_check.py runs the cases in two launches: 2 processes under DDP (one context group: Wan
all-MHLA in ring mode; Wan hybrid with LoRA in Ulysses mode, its softmax layer on diffusers' Ulysses attention,
output matching against the original; DiT all-MHLA on the trunk plan with its EMA exported; a checkpointed and
resumed Wan run), 4 processes under FSDP2 (2 data ranks x 2 context ranks), and a Wan run whose ranks are all
SIGKILLed after a checkpoint, resumed by a third launch. The one-process references run here through the same
probes, on the data rank's batch. Compared, step by step: the loss, every gradient (mixing matrices included;
before clipping), every parameter after the clamp, and the exported checkpoint.

Tolerances: the same samples, noise and timesteps reach both runs; the context ranks' sums (MHLA's block
summaries, the gradients of each rank's tokens) are reduced in another order. Measured: gradients within 5.5e-6 of
the step's largest entry, parameters and exported tensors within 2.4e-6 (absolute; lr 1e-3, mixing_lr 0.3), losses
equal to the 6 digits of loss.csv. The bounds are 10x those. A context group whose gradients were averaged instead
of summed, or whose ranks drew different noise, misses them by orders of magnitude (gradients off by 50%).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers import load_script
from helpers_parallel import accelerate_launch, assert_same_probes, exported_tensors, max_error
from safetensors.torch import load_file

from mhla_diffusers.training import load_config, read_loss_csv
from mhla_diffusers.training.context import DataLayout, context_loss_scale, data_layout

ROOT = Path(__file__).resolve().parents[2]
GRAD_TOL = 6e-5  # of the step's largest gradient entry
WEIGHT_TOL = 3e-5  # absolute
CASES = ("wan_all_ring", "wan_lora_ulysses", "dit_all_ring")
SCRIPT = "tests/training/context_check.py"


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """``root``: root/context/<case> (2 processes), root/fsdp/<case> (4), root/one/<case> (one process)."""
    from helpers_wan import tiny_wan_pipeline

    root = tmp_path_factory.mktemp("context")
    tiny_wan_pipeline(num_layers=3).save_pretrained(root / "base")
    accelerate_launch("multi_cpu.yaml", 2, SCRIPT, str(root / "context"), str(root / "base"))
    accelerate_launch("fsdp.yaml", 4, SCRIPT, str(root / "fsdp"), str(root / "base"), "--fsdp")
    killed = str(root / "context" / "wan_all_ring_killed")
    accelerate_launch("multi_cpu.yaml", 2, SCRIPT, killed, str(root / "base"), "--kill", fails=True)
    accelerate_launch("multi_cpu.yaml", 2, SCRIPT, killed, str(root / "base"), "--resume-killed")
    check = load_script(SCRIPT)
    for name in CASES:
        check.run_case(name, root / "one" / name, root / "base", context=False)
    # 2 data ranks x batch 1 under FSDP = one process on the batch of 2
    check.run_case("wan_all_ring_fsdp", root / "one" / "wan_all_ring_fsdp", root / "base", context=False, batch=2)
    return root


def _probes(folder: Path) -> dict:
    """The probe tensors, named as on the bare model (DDP's ``module.`` dropped)."""
    return {k.replace(".module.", ".", 1): v for k, v in load_file(folder / "probe.safetensors").items()}


def _assert_same_run(one: Path, parallel: Path) -> None:
    la, lb = read_loss_csv(one / "loss.csv"), read_loss_csv(parallel / "loss.csv")
    assert [r[0] for r in la] == [r[0] for r in lb] == [1, 2, 3]
    assert all(abs(x[1] - y[1]) <= 2e-5 for x, y in zip(la, lb)), (la, lb)
    a, b = _probes(one), _probes(parallel)
    assert_same_probes(a, b, GRAD_TOL, WEIGHT_TOL)
    ea, eb = exported_tensors(one), exported_tensors(parallel)
    assert ea.keys() == eb.keys() and len(ea) > 50
    for k in ea:
        assert max_error(ea[k], eb[k]) < WEIGHT_TOL, (k, max_error(ea[k], eb[k]))


@pytest.mark.parametrize("name", CASES)
def test_a_context_group_of_two_equals_one_process(runs, name):
    """Loss, gradients (mixing matrices included), clamped parameters after each of 3 steps, and the export."""
    _assert_same_run(runs / "one" / name, runs / "context" / name)
    one, two = (json.loads((runs / run / name / "train_summary.json").read_text()) for run in ("one", "context"))
    assert two["context_degree"] == 2 and two["batch_size"] == 2 and one["context_degree"] == 1
    returned = [json.loads((runs / "context" / name / f"returned_{r}.json").read_text()) for r in (0, 1)]
    assert returned[0] == returned[1] == json.loads(json.dumps(two, sort_keys=True))  # train() returns it on every rank
    if name == "dit_all_ring":  # held-out losses, evaluated by the context group before and after training
        for key in ("eval_loss_start", "eval_loss"):
            assert one[key] is not None and abs(one[key] - two[key]) < 1e-6 * one[key], (key, one[key], two[key])  # 5.2e-8


def test_context_times_fsdp_on_four_processes_equals_one_process(runs):
    """2 data ranks x 2 context ranks, FSDP2 over all 4: the one-process run on the 2 data ranks' batch."""
    _assert_same_run(runs / "one" / "wan_all_ring_fsdp", runs / "fsdp" / "wan_all_ring_fsdp")
    layout = json.loads((runs / "fsdp" / "wan_all_ring_fsdp" / "fsdp.json").read_text())
    shares = layout["elements_per_rank"]
    assert len(shares) == 4 and sum(shares) == layout["elements"] and max(shares) < 0.3 * layout["elements"], shares


@pytest.mark.parametrize("run", ["wan_all_ring_resumed", "wan_all_ring_killed"])
def test_a_resume_under_context_parallelism_is_exact(runs, run):
    """Stopped (2 steps, then resumed to 3 in the same launch) or killed (every rank SIGKILLed after the step-2
    checkpoint, resumed by a new launch): the 3 steps equal the uninterrupted one-process run."""
    resumed, one = runs / "context" / run, runs / "one" / "wan_all_ring"
    assert (resumed / "checkpoints" / "checkpoint_0" / "train_state.json").is_file()
    la, lb = read_loss_csv(one / "loss.csv"), read_loss_csv(resumed / "loss.csv")
    assert all(abs(x[1] - y[1]) <= 2e-5 for x, y in zip(la, lb)) and len(lb) == 3
    ea, eb = exported_tensors(one), exported_tensors(resumed)
    assert ea.keys() == eb.keys()
    for k in ea:
        assert max_error(ea[k], eb[k]) < WEIGHT_TOL, (k, max_error(ea[k], eb[k]))


# -- the layout and the refusals, in process ----------------------------------------------------------
def test_the_layout_puts_a_context_group_on_consecutive_ranks():
    layouts = [data_layout({"ring_degree": 2}, rank, 4) for rank in range(4)]
    assert [(x.data_rank, x.data_world) for x in layouts] == [(0, 2), (0, 2), (1, 2), (1, 2)]
    assert context_loss_scale(layouts[0]) == 2.0
    assert data_layout(None, 3, 4) == DataLayout(data_rank=3, data_world=4)
    assert data_layout({"ring_degree": 2, "ulysses_degree": 2}, 3, 8).data_rank == 0
    with pytest.raises(ValueError, match="does not divide the 3 launched"):
        data_layout({"ulysses_degree": 2}, 0, 3)


def _dit(tmp_path, *overrides):
    tiny = ("model.init={num_attention_heads: 2, attention_head_dim: 8, in_channels: 12, out_channels: 12, num_layers: 2, "
            "sample_size: 8, patch_size: 2, num_embeds_ada_norm: 1000}")
    return load_config(None, [f"output_dir={tmp_path}", tiny, "model.vae={factor: 2, scaling_factor: 1.8}", *overrides])


@pytest.mark.parametrize("value, message", [
    ("{ring_degree: 0}", "ring_degree must be an integer >= 1"),
    ("{ring: 2}", "must be null or a mapping of"),
    ("2", "must be null or a mapping of"),
    ("{ring_degree: 1}", "ring_degree or ulysses_degree must be greater than 1"),
    ("{ring_degree: 2, ulysses_anything: true}", "ulysses_degree must be greater than 1"),
    ("{ring_degree: 2, ring_anything: 1}", "must be true or false"),
])
def test_a_bad_context_section_is_refused_by_name(tmp_path, value, message):
    with pytest.raises(ValueError, match=message):
        _dit(tmp_path, f"parallel.context={value}")


def test_attention_transfer_under_context_parallelism_is_refused(tmp_path):
    with pytest.raises(ValueError, match="distill.attention_weight: 0"):
        _dit(tmp_path, "parallel.context={ring_degree: 2}", "distill.teacher=original", "distill.attention_weight=1")
    assert _dit(tmp_path, "parallel.context={ulysses_degree: 2}")["parallel"]["context"] == {"ulysses_degree": 2}


def test_a_model_without_a_training_plan_is_refused_before_the_first_step(tmp_path):
    """SANA's plan shards each MHLA layer alone (every rank runs the rest on all tokens): not a training layout.
    LePE: refused as in inference, with the trainer's prefix. Neither needs torch.distributed to say so."""
    import torch
    from helpers_sana import tiny_sana

    import mhla_diffusers
    from mhla_diffusers.training.context import enable_training_context

    model = tiny_sana(num_layers=2)
    mhla_diffusers.apply_mhla(model, layers="all", num_blocks=4)
    layout = data_layout({"ring_degree": 2}, 0, 2)
    with pytest.raises(ValueError, match="no context-parallel training plan .* set parallel.context: null"):
        enable_training_context(model, layout, torch.device("cpu"))
    from helpers_wan import tiny_wan

    wan = tiny_wan(num_layers=2)
    mhla_diffusers.apply_mhla(wan, layers="all", block_grid=(1, 2, 2), lepe=True)
    with pytest.raises(ValueError, match="parallel.context: .*LePE"):
        enable_training_context(wan, layout, torch.device("cpu"))


def test_a_resume_on_another_process_layout_is_refused(tmp_path):
    """A checkpoint records its processes and data ranks: resumed on another layout, the learning-rate schedule's
    position and the samples would silently change. One without them (older runs) is not checked."""
    from mhla_diffusers.training.resume import check_resume_layout

    folder = tmp_path / "checkpoint_0"
    folder.mkdir()
    (folder / "train_state.json").write_text(json.dumps({"step": 2, "processes": 4, "data_world": 2}))
    check_resume_layout(folder, 4, 2)
    for processes, data_world in ((4, 4), (2, 2), (2, 1)):
        with pytest.raises(ValueError, match="trained by 4 process\\(es\\) in 2 data-parallel rank.*Nothing was written"):
            check_resume_layout(folder, processes, data_world)
    (folder / "train_state.json").write_text(json.dumps({"step": 2}))
    check_resume_layout(folder, 1, 1)


def test_a_config_key_newer_than_the_checkpoint_at_its_default_is_no_change(tmp_path):
    """A checkpoint written before parallel.context existed resumes without a change reported for it; set, it is one."""
    from mhla_diffusers.training.resume import check_resume_config

    config = _dit(tmp_path)
    recorded = json.loads(json.dumps(config))
    del recorded["parallel"]
    folder = tmp_path / "checkpoint_0"
    folder.mkdir()
    (folder / "train_state.json").write_text(json.dumps({"step": 1, "config": recorded}))
    assert check_resume_config(tmp_path, folder, config) == {}
    changed = _dit(tmp_path, "parallel.context={ring_degree: 2}")
    assert check_resume_config(tmp_path, folder, changed) == {"parallel.context.ring_degree": ("<unset>", 2)}
