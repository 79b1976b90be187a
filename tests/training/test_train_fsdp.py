"""FSDP2: the trainer on 2 CPU processes over gloo under accelerate's FSDP2 plugin, launched with the
shipped ``finetune/accelerate/fsdp.yaml``, equals one process on the concatenated batch.

tests/training/fsdp_check.py runs the cases (Wan all-MHLA full fine-tuning, Wan hybrid LoRA + mixing,
DiT hybrid; a checkpointed and resumed Wan run; SANA's units) in one ``accelerate launch`` (process
start costs ~10 s); the one-process references run here through the same probes. Compared, step by
step: the loss, every gradient (mixing matrices included; before clipping), every parameter after
the clamp of the mixing matrices, and the exported checkpoint.

Tolerances: the same samples, noise, timesteps and posterior draws reach both runs; only reduction
orders differ (FSDP's reduce-scatter of two per-rank means vs one mean, sharded gradient norms).
Measured: gradients within 1.4e-5 of the step's largest gradient entry, parameters and exported
tensors within 2e-6 (absolute; weights O(1), lr 1e-3), losses equal to the 6 digits of loss.csv.
The bounds below are 10x those; one different sample or noise draw moves the loss by > 1e-2 and the
weights by ~lr. Adam turns the zero true gradient of a softmax layer's key bias (rounding noise,
~1e-10) into updates of up to lr * 1e-10 / eps ~ 1e-5: the absolute weight bound covers them.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import yaml
from helpers import load_script
from helpers_parallel import accelerate_launch, assert_same_probes, exported_tensors, max_error
from safetensors.torch import load_file

from mhla_diffusers.training import read_grad_norms, read_loss_csv
from mhla_diffusers.training.fsdp import check_fsdp_setup, set_fsdp_wrap, transformer_block_classes

ROOT = Path(__file__).resolve().parents[2]
GRAD_TOL = 2e-4  # of the step's largest gradient entry
WEIGHT_TOL = 2e-5  # absolute
CASES = ("wan_all", "wan_lora", "dit_hybrid")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """``(root, check module)``: root/fsdp/<case> from the 2-process launch, root/one/<case> from one process."""
    from helpers_wan import tiny_wan_pipeline

    root = tmp_path_factory.mktemp("fsdp")
    tiny_wan_pipeline(num_layers=3).save_pretrained(root / "base")
    accelerate_launch("fsdp.yaml", 2, "tests/training/fsdp_check.py", str(root / "fsdp"), str(root / "base"))
    check = load_script("tests/training/fsdp_check.py")
    for name in CASES:
        check.run_case(name, root / "one" / name, root / "base", batch_size=2)
    return root, check


def test_fsdp_yaml_is_fsdp2_and_shards_one_unit_per_block(runs):
    """The shipped config is FSDP2 and names no block class; accelerate's launcher and plugin read it so;
    the trainer's units: one per Wan block (+ accelerate's final-norm unit and the root), the whole DiT
    (its root calls transformer_blocks[0].norm1.emb); each rank holds about half of every model."""
    root, _ = runs
    shipped = yaml.safe_load((ROOT / "finetune/accelerate/fsdp.yaml").read_text())
    assert shipped["distributed_type"] == "FSDP" and shipped["fsdp_config"]["fsdp_version"] == 2
    assert "fsdp_transformer_layer_cls_to_wrap" not in shipped["fsdp_config"]
    units = {"wan_all": ["<root>", "blocks.0", "blocks.1", "blocks.2", "norm_out"], "dit_hybrid": ["<root>", "norm_out"]}
    for name in CASES:
        layout = json.loads((root / "fsdp" / name / "fsdp.json").read_text())
        assert layout["fsdp_version"] == 2 and layout["reshard_after_forward"] is True
        assert layout["state_dict_type"].endswith("FULL_STATE_DICT") and layout["per_group_clip"] is True
        assert layout["units"] == units.get(name, units["wan_all"]), layout["units"]
        assert layout["sharded"] == layout["parameters"]  # every parameter is a DTensor shard
        shares = layout["elements_per_rank"]
        assert sum(shares) == layout["elements"] and max(shares) < 0.52 * layout["elements"], shares
    assert layout["wrap"] == []  # DiT: no block class
    sana = json.loads((root / "fsdp" / "sana.json").read_text())
    assert sana["units"] == ["<root>", "transformer_blocks.0", "transformer_blocks.1", "transformer_blocks.2", "norm_out"]
    assert "SanaTransformerBlock" in sana["wrap"] and sana["grads"] == 75
    assert sana["output"] < 1e-5 and sana["grad_error"] < 1e-5, sana  # measured 0 and 1.1e-7


@pytest.mark.parametrize("name", CASES)
def test_fsdp_two_processes_equal_one_process(runs, name):
    """Loss, gradients (mixing matrices included), clamped parameters after each of 3 steps, and the export."""
    root, check = runs
    two, one = root / "fsdp" / name, root / "one" / name
    la, lb = read_loss_csv(one / "loss.csv"), read_loss_csv(two / "loss.csv")
    assert [r[0] for r in la] == [r[0] for r in lb] == [1, 2, 3]
    assert [r[1] for r in la] == [r[1] for r in lb]
    # clipping active: some group's norm above train.grad_clip (0.02) at every step
    norms = [values for _, values in read_grad_norms(one / "loss.csv").values()]
    assert len(norms) > 1 and all(max(step) > 0.02 for step in zip(*norms)), norms
    a, b = load_file(one / "probe.safetensors"), load_file(two / "probe.safetensors")
    assert_same_probes(a, b, GRAD_TOL, WEIGHT_TOL)
    mixing = [k for k in a if k.startswith("weight.3.") and "mhla.mixing" in k]
    assert all(float(b[k].min()) >= 0.0 and float(b[k].max()) <= 1.0 for k in mixing)
    assert sum(int((b[k] == 0).sum()) for k in mixing) > 0  # the clamp acted (mixing_lr 0.3 pushed entries below 0)
    ea, eb = exported_tensors(one), exported_tensors(two)
    assert ea.keys() == eb.keys() and len(ea) > 50
    for k in ea:
        assert max_error(ea[k], eb[k]) < WEIGHT_TOL, (k, max_error(ea[k], eb[k]))
    if name == "wan_lora":  # merged: no adapter keys, the base weights changed by the merge
        assert not any("lora" in k for k in eb) and not (two / "final" / "transformer_lora").exists()


def test_fsdp_checkpoint_and_resume_equal_the_uninterrupted_run(runs):
    """wan_all under FSDP2: 2 steps with a checkpoint, resumed to step 3 == 3 steps in one process."""
    root, _ = runs
    resumed, one = root / "fsdp" / "wan_all_resumed", root / "one" / "wan_all"
    assert (resumed / "checkpoints" / "checkpoint_0" / "train_state.json").is_file()
    assert [r[1] for r in read_loss_csv(resumed / "loss.csv")] == [r[1] for r in read_loss_csv(one / "loss.csv")]
    ea, eb = exported_tensors(one), exported_tensors(resumed)
    assert ea.keys() == eb.keys()
    for k in ea:
        assert max_error(ea[k], eb[k]) < WEIGHT_TOL, (k, max_error(ea[k], eb[k]))


# -- the trainer's FSDP rules, in process ------------------------------------------------------------
def _accelerator(kind: str = "MULTI_CPU", version: int = 2, policy=None, classes=None):
    from accelerate.utils import DistributedType

    plugin = SimpleNamespace(fsdp_version=version, auto_wrap_policy=policy, transformer_cls_names_to_wrap=classes)
    return SimpleNamespace(distributed_type=DistributedType[kind], num_processes=2, state=SimpleNamespace(fsdp_plugin=plugin))


def test_an_fsdp_launch_that_would_not_shard_is_refused(monkeypatch, tmp_path, capsys):
    """accelerate on CPU processes (or one process) turns an FSDP config into DDP / nothing: refused, by name,
    before anything is written; so is FSDP1. train.py says it in one line (exit 2)."""
    from helpers_train import tiny_config

    monkeypatch.delenv("ACCELERATE_USE_FSDP", raising=False)
    check_fsdp_setup(_accelerator())  # no FSDP asked: nothing to say
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    with pytest.raises(ValueError, match="asks for FSDP, but accelerate set up .*MULTI_CPU.*multi_cpu.yaml"):
        check_fsdp_setup(_accelerator())
    with pytest.raises(ValueError, match="FSDP version 1; the trainer runs FSDP2: set fsdp_config.fsdp_version: 2"):
        check_fsdp_setup(_accelerator("FSDP", version=1))
    check_fsdp_setup(_accelerator("FSDP"))

    cfg = tiny_config(tmp_path / "run")
    code = load_script("finetune/train.py").main(["--config", str(cfg)])
    err = capsys.readouterr().err
    assert code == 2 and "asks for FSDP, but accelerate set up" in err, err
    assert not (tmp_path / "run").exists()


def test_fsdp_units_per_family():
    """The block classes of DiT, SANA, Wan; set_fsdp_wrap fills them in, keeps DiT whole, refuses a class the
    model lacks or DiT's block."""
    from helpers import tiny_dit
    from helpers_sana import tiny_sana
    from helpers_wan import tiny_wan
    from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy

    dit, sana, wan = tiny_dit(num_layers=2), tiny_sana(), tiny_wan()
    assert transformer_block_classes(dit) == ["BasicTransformerBlock"]
    assert transformer_block_classes(sana) == ["SanaTransformerBlock"]
    assert transformer_block_classes(wan) == ["WanTransformerBlock"]
    assert set_fsdp_wrap(_accelerator(), wan) is None  # not FSDP
    acc = _accelerator("FSDP", policy=transformer_auto_wrap_policy)
    assert "WanTransformerBlock" in set_fsdp_wrap(acc, wan)
    assert acc.state.fsdp_plugin.transformer_cls_names_to_wrap == ["WanTransformerBlock"]
    acc = _accelerator("FSDP", policy=transformer_auto_wrap_policy)
    assert "whole DiTTransformer2DModel is one unit" in set_fsdp_wrap(acc, dit)
    assert acc.state.fsdp_plugin.transformer_cls_names_to_wrap == []
    lacks = "names WanTransformerBlock, which SanaTransformer2DModel does not have: its transformer blocks are SanaTransformerBlock"
    with pytest.raises(ValueError, match=lacks):
        set_fsdp_wrap(_accelerator("FSDP", policy=transformer_auto_wrap_policy, classes=["WanTransformerBlock"]), sana)
    with pytest.raises(ValueError, match="BasicTransformerBlock cannot be an FSDP unit"):
        set_fsdp_wrap(_accelerator("FSDP", policy=transformer_auto_wrap_policy, classes=["BasicTransformerBlock"]), dit)
    acc = _accelerator("FSDP", policy=None)  # NO_WRAP / size-based: accelerate's own
    assert set_fsdp_wrap(acc, wan) is None and acc.state.fsdp_plugin.transformer_cls_names_to_wrap is None


def test_posterior_draws_are_the_global_batch_sliced():
    """A VAE posterior sampled by 2 processes (batch 2 each) gives the samples one process draws for the batch
    of 4 (rank r, sample j: global position 2 j + r); one process: exactly ``latent_dist.sample``."""
    from diffusers.models.autoencoders.vae import DiagonalGaussianDistribution

    from mhla_diffusers.autoencoder import PointLatentDistribution
    from mhla_diffusers.training.recipes import posterior_sample

    params = torch.randn(4, 6, 3, 3, generator=torch.Generator().manual_seed(1))
    posterior = DiagonalGaussianDistribution(params)
    one = posterior_sample(posterior, torch.Generator().manual_seed(5))
    assert torch.equal(one, posterior.sample(torch.Generator().manual_seed(5)))
    for rank in (0, 1):
        local = DiagonalGaussianDistribution(params[rank::2])
        got = posterior_sample(local, torch.Generator().manual_seed(5), rank=rank, world_size=2)
        torch.testing.assert_close(got, one[rank::2], rtol=0, atol=1e-6)  # measured: bitwise equal (elementwise ops)
    point = PointLatentDistribution(params[:2, :3])
    assert posterior_sample(point, torch.Generator(), rank=1, world_size=2) is point.mean


def test_train_help_names_the_families_and_loaders_the_readme_names(capsys):
    """finetune/train.py --help: Wan 2.1 and 2.2; every mhla_diffusers name it gives is one its page (docs/training.md)
    gives."""
    import re

    with pytest.raises(SystemExit):
        load_script("finetune/train.py").parse_args(["--help"])
    text = capsys.readouterr().out
    assert "Wan (2.1; 2.2" in text and "fsdp.yaml: FSDP2" in text
    page = (ROOT / "docs" / "training.md").read_text()
    names = set(re.findall(r"mhla_diffusers(?:\.\w+)+", text))
    assert names and all(n.rsplit(".", 1)[-1] in page for n in names), names
    assert "load_mhla_pipeline_with_lora" not in text
