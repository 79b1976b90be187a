"""Data-free training (issue 34): the teacher store on tiny DiT, SANA and Wan pipelines.

What it holds (the teacher's own calls, checked against recomputed predictions), the trajectory pairs and the
samples views, the key (another teacher or setting refused), atomic shards resumed bit for bit after a SIGKILL,
shards split across processes, training on the pairs and the samples, the retrofit recipe on a store."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers_train import tiny_config
from safetensors.torch import load_file

from mhla_diffusers import training
from mhla_diffusers.checkpoint.conversion import convert_checkpoint
from mhla_diffusers.data.store import TeacherPairs, TeacherSamples, shard_path
from mhla_diffusers.training import load_config, read_loss_terms
from mhla_diffusers.training import teacher as teacher_mod

ROOT = Path(__file__).resolve().parents[2]
STORE = {"samples": 4, "steps": 3, "shard_size": 2}


class _OneProcess:
    process_index, num_processes, is_local_main_process = 0, 1, False

    @staticmethod
    def wait_for_everyone():
        pass


@pytest.fixture(scope="module")
def dit_base(tmp_path_factory):
    """A tiny softmax DiT pipeline (3 training steps) and its MHLA conversion."""
    root = tmp_path_factory.mktemp("dit")
    base = training.train(load_config(tiny_config(root / "base")))["final_dir"]
    convert_checkpoint(base, root / "student", family="dit", layers="all", num_blocks=4)
    return base, root / "student"


def dit_config(tmp_path, dit_base, name="run", store=None, **teacher):
    base, student = dit_base
    return tiny_config(
        tmp_path / name, model={"init": None, "pretrained": str(student)},
        data={"kind": "teacher", "teacher": {**STORE, "store_dir": str(store or tmp_path / "store"), **teacher}},
        distill={"teacher": str(base), "data_weight": 0, "output_weight": 1.0},
    )


def _parts(config):
    """The run's models as the trainer builds them, its recipe prepared (the teacher's pipeline needs the null condition)."""
    parts = training.build_models(config)
    parts.recipe.prepare(parts, None, config)
    return parts


def _build(parts, config, folder, trajectories=4, seed=0, **kw):
    return teacher_mod.build_teacher_store(parts, config, folder, trajectories=trajectories, seed=seed, **kw)


def _shard_bytes(folder):
    return {p.name: p.read_bytes() for p in sorted((Path(folder) / "shards").glob("*.safetensors"))}


def _check_pairs_are_the_teachers(parts, folder, trajectories, atol=1e-5):
    """Every stored pair: the teacher's prediction at the stored latent and timestep, recomputed alone (conditional and
    null condition), and the stored clean latent is the end of the trajectory's sampler."""
    pairs, samples = TeacherPairs(folder, trajectories), TeacherSamples(folder, trajectories)
    assert len(pairs) == trajectories * pairs.steps and len(samples) == trajectories and pairs.steps == 3
    recipe = parts.recipe
    for i in range(len(pairs)):
        item = {k: v.unsqueeze(0) for k, v in pairs[i].items()}
        keep = torch.zeros(1, dtype=torch.bool)
        with torch.no_grad():
            cond = recipe.condition(parts, item, keep)
            pred = recipe.predict(parts.teacher, item["noisy"], item["timesteps"], cond)
            null = recipe.predict(parts.teacher, item["noisy"], item["timesteps"], recipe.condition(parts, item, keep, "null"))
        assert torch.allclose(pred, item["teacher_pred"], atol=atol), (i, (pred - item["teacher_pred"]).abs().max())
        assert torch.allclose(null, item["teacher_null_pred"], atol=atol), i
        assert torch.equal(item["latents"][0], samples[i // pairs.steps]["latents"])
    first, last = pairs[0], pairs[pairs.steps - 1]
    assert not torch.equal(first["noisy"], last["noisy"]) and first["timesteps"] != last["timesteps"]


# -- what a store holds ------------------------------------------------------------------------------
def test_dit_store_holds_the_teachers_trajectories_and_samples(tmp_path, dit_base):
    config = load_config(dit_config(tmp_path, dit_base))
    parts = _parts(config)
    folder = _build(parts, config, tmp_path / "store")
    _check_pairs_are_the_teachers(parts, folder, 4)
    shard = load_file(shard_path(folder, 0))
    assert shard["class_labels"].tolist() == [0, 1] and shard["noisy"].shape == (2, 3, 12, 8, 8)
    assert load_file(shard_path(folder, 1))["class_labels"].tolist() == [2, 0]  # the 3 trained classes in turn
    # the clean latents are what the stock pipeline decodes, from the same per-trajectory noise
    pipe = teacher_mod.teacher_pipeline(parts, config)
    generators = [torch.Generator().manual_seed(teacher_mod._seed(0, i, 1)) for i in range(2)]
    images = pipe(class_labels=[0, 1], generator=generators, num_inference_steps=3, output_type="pt").images
    decoded = pipe.vae.decode(shard["latents"] / pipe.vae.config.scaling_factor).sample
    assert torch.allclose(images, (decoded / 2 + 0.5).clamp(0, 1), atol=1e-5)
    cost = TeacherSamples(folder, 4).cost
    assert cost["trajectories"] == 4 and cost["transformer_calls"] == 6 and cost["steps"] == 3 and cost["guidance_scale"] == 4.0


def test_a_store_of_another_teacher_or_setting_is_refused_naming_what_differs(tmp_path, dit_base):
    config = load_config(dit_config(tmp_path, dit_base))
    parts = _parts(config)
    folder = _build(parts, config, tmp_path / "store", trajectories=2)
    for override, named in [("data.teacher.guidance_scale=2.0", "guidance_scale: 4.0 (store) vs 2.0"),
                            ("data.teacher.steps=5", "steps: 3 (store) vs 5"), ("data.teacher.shard_size=1", "shard_size"),
                            ("export.sampler=ddim", "scheduler.class"), ("data.teacher.classes=[1]", "conditions.classes")]:
        other = load_config(dit_config(tmp_path, dit_base), [override])
        with pytest.raises(ValueError, match="another teacher or setting") as info:
            _build(parts, other, folder, trajectories=2)
        assert named in str(info.value), (override, str(info.value))
    with pytest.raises(ValueError, match="seed: 0 \\(store\\) vs 1"):
        _build(parts, config, folder, trajectories=2, seed=1)
    with torch.no_grad():  # another teacher: its weights differ
        next(parts.teacher.parameters()).add_(1.0)
    with pytest.raises(ValueError, match="teacher.weights"):
        _build(parts, config, folder, trajectories=2)
    (tmp_path / "junk").mkdir()
    (tmp_path / "junk" / "notes.txt").write_text("mine")
    with pytest.raises(ValueError, match="not empty and holds no teacher store"):
        _build(parts, config, tmp_path / "junk", trajectories=2)


def test_a_larger_store_extends_a_smaller_one_and_processes_split_the_shards(tmp_path, dit_base):
    """Shard j is a function of the key and j: two trajectories then four equal four at once, and two ranks' shares
    (each generating its own shards) make the one-process store, bit for bit."""
    config = load_config(dit_config(tmp_path, dit_base))
    parts = _parts(config)
    whole = _build(parts, config, tmp_path / "whole")
    grown = _build(parts, config, tmp_path / "grown", trajectories=2)
    assert len(_shard_bytes(grown)) == 1
    _build(parts, config, grown)
    _build(parts, config, tmp_path / "ranks", rank=0, world_size=2)
    assert list(_shard_bytes(tmp_path / "ranks")) == ["00000.safetensors"]  # rank 0's share: the even shards
    _build(parts, config, tmp_path / "ranks", rank=1, world_size=2)
    assert _shard_bytes(whole) == _shard_bytes(grown) == _shard_bytes(tmp_path / "ranks")
    assert len(_shard_bytes(whole)) == 2


_KILLER = """
import os, signal, sys
sys.path.insert(0, {tests!r})
from mhla_diffusers.data import store
original = store.save_file
def save_then_die(tensors, path, metadata=None):
    original(tensors, path, metadata=metadata)
    if '"shard": 1' in metadata["teacher_store"]:  # shard 1 written to its temporary name, not yet renamed: the kill
        os.kill(os.getpid(), signal.SIGKILL)
store.save_file = save_then_die
from mhla_diffusers.training import load_config, train
train(load_config({config!r}))
"""


def test_a_store_killed_mid_shard_resumes_to_the_same_shards_and_training_resumes_exactly(tmp_path, dit_base):
    cfg = dit_config(tmp_path, dit_base, store=tmp_path / "cut_store", samples=6)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    script = _KILLER.format(tests=str(ROOT / "tests"), config=str(cfg))
    proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=240, cwd=tmp_path)
    assert proc.returncode == -9, proc.stderr[-2000:]
    shards = sorted(p.name for p in (tmp_path / "cut_store" / "shards").iterdir())  # a dot sorts first
    assert shards[0].startswith(".00001.safetensors.tmp") and shards[1:] == ["00000.safetensors"]
    overrides = ["train.max_steps=4", "train.checkpointing_steps=2"]
    cut = training.train(load_config(cfg, overrides + ["train.max_steps=2"]))  # the store is finished, then 2 steps
    assert cut["steps"] == 2 and not (tmp_path / "cut_store" / "shards" / shards[0]).exists()  # the stale file removed
    training.train(load_config(cfg, overrides + ["train.resume=true"]))
    full_cfg = dit_config(tmp_path, dit_base, name="full", store=tmp_path / "full_store", samples=6)
    full = training.train(load_config(full_cfg, overrides))
    assert _shard_bytes(tmp_path / "cut_store") == _shard_bytes(tmp_path / "full_store")
    assert len(_shard_bytes(tmp_path / "full_store")) == 3
    a, b = (load_file(Path(d) / "transformer" / "mhla.safetensors") for d in (full["final_dir"], tmp_path / "run" / "final"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert training.read_loss_csv(tmp_path / "run" / "loss.csv") == training.read_loss_csv(tmp_path / "full" / "loss.csv")


# -- training on a store ----------------------------------------------------------------------------
def test_distillation_on_pairs_matches_the_stored_predictions_with_dropped_labels_on_null_ones(tmp_path, dit_base, monkeypatch):
    config = load_config(dit_config(tmp_path, dit_base), ["train.class_dropout=0.5"])
    parts = _parts(config)
    folder = _build(parts, config, tmp_path / "store")
    batch = torch.utils.data.default_collate([TeacherPairs(folder, 4)[i] for i in (0, 4, 8, 11)])
    model = parts.transformer.eval()
    drop = torch.tensor([True, False, True, False])
    import mhla_diffusers.training.losses as losses

    original = losses._step_draws

    def fixed(*args, **kwargs):  # the dropout draw fixed to `drop`
        noise, draw, _, labels = original(*args, **kwargs)
        return noise, draw, drop, labels

    monkeypatch.setattr(losses, "_step_draws", fixed)
    loss, terms = training.training_loss(parts, model, batch, generator=torch.Generator().manual_seed(0), dropout=0.5,
                                         data_weight=0.0, output_weight=1.0)
    labels = torch.where(drop, torch.full_like(batch["class_labels"], 1000), batch["class_labels"])
    with torch.no_grad():
        pred = parts.recipe.predict(model, batch["noisy"], batch["timesteps"], {"class_labels": labels})
    target = torch.where(drop.view(-1, 1, 1, 1), batch["teacher_null_pred"], batch["teacher_pred"])
    assert sorted(terms) == ["output"] and torch.allclose(loss, torch.nn.functional.mse_loss(pred, target), rtol=1e-5)
    with pytest.raises(ValueError, match="distill.data_weight must be 0"):
        training.training_loss(parts, model, batch, data_weight=1.0, output_weight=1.0)


def test_train_on_pairs_then_samples_with_a_heldout_store_and_the_retrofit_recipe(tmp_path, dit_base):
    base, student = dit_base
    cfg = dit_config(tmp_path, dit_base)
    s1 = training.train(load_config(cfg, ["eval.samples=2", "eval.batch_size=2"]))
    assert read_loss_terms(tmp_path / "run" / "loss.csv").keys() == {"output"}
    assert s1["teacher_store"]["trajectories"] == 4 and s1["teacher_store"]["transformer_calls"] == 6
    assert (tmp_path / "store" / "heldout" / "shards" / "00000.safetensors").is_file()  # held-out samples, seed eval.seed
    s2 = training.train(load_config(cfg, ["output_dir=" + str(tmp_path / "ft"), "distill.data_weight=1", "eval.samples=2",
                                          "eval.batch_size=2", "eval.data={kind: photos}"]))
    assert read_loss_terms(tmp_path / "ft" / "loss.csv").keys() == {"data", "output"} and s2["eval_loss"] > 0
    r = training.retrofit(cfg, student, base, tmp_path / "retro", distill_steps=2, finetune_steps=1, distill_lr=1e-3)
    assert r["steps"] == {"distill": 2, "finetune": 1} and r["teacher_store"]["trajectories"] == 4
    assert (tmp_path / "store" / "store.json").is_file() and not (tmp_path / "retro" / "teacher_store").exists()
    r = training.retrofit(cfg, student, base, tmp_path / "retro2", distill_steps=1, finetune_steps=1,
                          overrides=["data.teacher.store_dir=null"])
    assert r["teacher_store"]["folder"] == str(tmp_path / "retro2" / "teacher_store")  # one store, both phases
    assert (tmp_path / "retro2" / "teacher_store" / "shards" / "00001.safetensors").is_file()


@pytest.mark.parametrize("overrides, message", [
    (["distill.teacher=null", "distill.data_weight=1", "distill.output_weight=0"], "set distill.teacher"),
    (["data.teacher.use=pairs", "distill.data_weight=1"], "set distill.data_weight=0"),
    (["distill.condition=random"], "distill.condition to dataset or null"),
    (["data.cache=true"], "already holds latents"),
    (["data.teacher.classes=[-1]"], "data.teacher.classes"),
    (["eval.data={kind: nope}"], "eval.data.kind must be one of"),
    (["eval.data={kind: teacher}"], "leave eval.data null"),
    (["eval.data={nope: 1}"], "eval.data must be null or a mapping of data keys"),
    (["data.teacher.guidance_scale=-1"], "data.teacher.guidance_scale"),
    (["data.teacher.use=always"], "data.teacher.use"),
])
def test_bad_teacher_settings_are_refused_naming_the_fix(tmp_path, dit_base, overrides, message):
    with pytest.raises(ValueError, match=message):
        load_config(dit_config(tmp_path, dit_base), overrides)


def test_a_store_without_guidance_refuses_dropped_conditions_on_its_pairs(tmp_path, dit_base):
    config = load_config(dit_config(tmp_path, dit_base, guidance_scale=1.0), ["train.class_dropout=0.5", "train.max_steps=2"])
    with pytest.raises(ValueError, match="no null-condition predictions"):
        training.train(config)
    assert "teacher_null_pred" not in load_file(shard_path(tmp_path / "store", 0))
    summary = training.train(load_config(dit_config(tmp_path, dit_base, name="ok", guidance_scale=1.0),
                                         ["train.class_dropout=0", "train.max_steps=2"]))
    assert summary["steps"] == 2


# -- the text families ------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def sana_base(tmp_path_factory):
    from helpers_sana import tiny_sana_pipeline

    folder = tmp_path_factory.mktemp("sana_store") / "base"
    tiny_sana_pipeline(num_layers=2, sample_size=8, vae_levels=2).save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def wan_base(tmp_path_factory):
    from helpers_wan import tiny_wan_pipeline

    folder = tmp_path_factory.mktemp("wan_store") / "base"
    tiny_wan_pipeline(num_layers=2).save_pretrained(folder)
    return folder


def _text_config(tmp_path, base, family, prompts):
    return load_config(None, _text_args(tmp_path, base, family, prompts))


def _text_args(tmp_path, base, family, prompts):
    common = [f"output_dir={tmp_path / 'run'}", f"model.pretrained={base}", "model.text.max_sequence_length=8",
              "mhla.layers=all", "data.kind=teacher", "data.batch_size=2", "train.max_steps=2", "train.log_every=1",
              f"data.teacher.prompts={prompts}", f"data.teacher.store_dir={tmp_path / 'store'}", "data.teacher.samples=4",
              "data.teacher.steps=3", "data.teacher.shard_size=2", "data.teacher.guidance_scale=3.0",
              "distill.teacher=original", "distill.data_weight=0", "distill.output_weight=1"]
    if family == "sana":
        common += ["model.text.complex_human_instruction=null", "mhla.num_blocks=4", "data.resolution=32"]
    else:
        common += ["mhla.block_grid=[1,2,2]", "data.resolution=32", "data.num_frames=5"]
    return common


def test_a_size_the_pipeline_refuses_names_the_data_keys(tmp_path, sana_base):
    config = load_config(None, [*_text_args(tmp_path, sana_base, "sana", teacher_mod.PROMPTS), "data.resolution=16"])
    with pytest.raises(ValueError, match=r"refused the sampling call, size \{'height': 16, 'width': 16\} \(from data.resolution"):
        _build(_parts(config), config, tmp_path / "store")


@pytest.mark.parametrize("family", ["sana", "wan"])
def test_text_family_store_and_training(tmp_path, sana_base, wan_base, family):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a red cube\n\n  a blue sphere on grass \n")
    config = _text_config(tmp_path, sana_base if family == "sana" else wan_base, family, prompts)
    parts = _parts(config)
    folder = _build(parts, config, tmp_path / "store")
    _check_pairs_are_the_teachers(parts, folder, 4, atol=1e-4)
    shard = load_file(shard_path(folder, 1))
    encoded = parts.recipe.encode_text(parts, ["a blue sphere on grass", "a red cube"], "cpu")  # trajectories 3, 2: prompts 1, 0
    assert torch.equal(shard["prompt_embeds"], encoded["prompt_embeds"].flip(0))
    assert shard["noisy"].shape[:2] == (2, 3) and shard["noisy"].shape[2:] == shard["latents"].shape[1:]
    assert shard["noisy"].ndim == (6 if family == "wan" else 5)  # [S, K, C, (F'), H', W']
    summary = training.train(config)
    # Wan's pipeline calls the transformer once per branch, SANA's once for both
    assert summary["steps"] == 2 and summary["teacher_store"]["transformer_calls"] == (12 if family == "wan" else 6)
    ft = training.train(_finetune(config, tmp_path))
    assert read_loss_terms(tmp_path / "ft" / "loss.csv").keys() == {"data", "output"} and ft["steps"] == 2


def _finetune(config, tmp_path):
    config = json.loads(json.dumps(config))
    config["output_dir"] = str(tmp_path / "ft")
    config["distill"]["data_weight"] = 1.0
    training.validate_config(config)
    return config


def test_shipped_prompts_and_prompt_files():
    prompts = teacher_mod.read_prompts()
    assert len(prompts) == 64 and len(set(prompts)) == 64 and all(p.strip() == p and p for p in prompts)
    with pytest.raises(FileNotFoundError, match="one prompt per line"):
        teacher_mod.read_prompts("/nonexistent/prompts.txt")


def test_pairs_per_trajectory_keeps_evenly_spaced_steps(tmp_path, dit_base):
    assert teacher_mod.kept_steps(5, None) == [0, 1, 2, 3, 4] and teacher_mod.kept_steps(5, 9) == [0, 1, 2, 3, 4]
    assert teacher_mod.kept_steps(5, 3) == [0, 2, 4] and teacher_mod.kept_steps(20, 4) == [0, 6, 13, 19]
    assert teacher_mod.kept_steps(5, 1) == [4]
    config = load_config(dit_config(tmp_path, dit_base), ["data.teacher.steps=5"])
    parts = _parts(config)
    full = load_file(shard_path(_build(parts, config, tmp_path / "all", trajectories=2), 0))
    config = load_config(dit_config(tmp_path, dit_base), ["data.teacher.steps=5", "data.teacher.pairs_per_trajectory=3"])
    some = load_file(shard_path(_build(parts, config, tmp_path / "some", trajectories=2), 0))
    for name in ("noisy", "timesteps", "teacher_pred", "teacher_null_pred"):
        assert torch.equal(some[name], full[name][:, [0, 2, 4]]), name
    assert torch.equal(some["latents"], full["latents"]) and len(TeacherPairs(tmp_path / "some", 2)) == 6


def test_the_teacher_may_be_a_hub_pipeline_read_from_the_local_cache(tmp_path, dit_base, monkeypatch):
    """``distill.teacher: owner/name`` (what retrofit.py --teacher takes): offline, the cached snapshot loads."""
    import shutil

    import huggingface_hub.constants

    from mhla_diffusers.training.distill import load_teacher

    base, _ = dit_base
    cache = tmp_path / "hub"
    repo = cache / "models--someone--tiny-dit"
    shutil.copytree(base, repo / "snapshots" / "abc123")
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("abc123")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    teacher = load_teacher("someone/tiny-dit")
    local = load_teacher(base)
    assert all(torch.equal(a, b) for a, b in zip(teacher.state_dict().values(), local.state_dict().values()))
    with pytest.raises(FileNotFoundError, match="could not be fetched or found in the local cache"):
        load_teacher("someone/absent")


def test_retrofit_cli_runs_both_phases_on_one_store_and_refuses_in_one_line(tmp_path, dit_base, capsys):
    from helpers import load_script

    base, student = dit_base
    cfg = dit_config(tmp_path, dit_base)
    main = load_script("finetune/retrofit.py").main
    common = ["--config", str(cfg), "--pretrained", str(student), "--teacher", str(base), "--distill-steps", "1", "--finetune-steps", "1"]
    code = main(common + ["--output_dir", str(tmp_path / "cli"), "--finetune-data-weight", "0", "--set", "data.teacher.store_dir=null"])
    out = capsys.readouterr().out
    assert code == 0 and "held-out loss" in out and '"trajectories": 4' in out
    assert (tmp_path / "cli" / "finetune" / "final" / "transformer" / "mhla.safetensors").is_file()
    assert read_loss_terms(tmp_path / "cli" / "finetune" / "loss.csv").keys() == {"output"}  # data weight 0: pairs again
    code = main(common + ["--output_dir", str(tmp_path / "cli2"), "--set", "data.teacher.guidance_scale=2.0",
                          "--set", f"data.teacher.store_dir={tmp_path / 'cli' / 'teacher_store'}"])
    last = capsys.readouterr().err.splitlines()[-1]  # after the loading progress bars: one line
    assert code == 2 and last.startswith("retrofit.py: ") and "guidance_scale: 4.0 (store) vs 2.0" in last


def test_retrofit_cli_on_two_processes_splits_the_store_and_runs_both_phases(tmp_path, dit_base):
    """``accelerate launch`` of finetune/retrofit.py on 2 CPU processes: each rank samples its shards (together the
    one-process store, bit for bit), both phases train in one launch (train() leaves the process group up for the
    second), the first process alone prints the result, and the launch exits (no deadlock closing the group)."""
    from helpers_parallel import accelerate_launch

    base, student = dit_base
    cfg = dit_config(tmp_path, dit_base)
    proc = accelerate_launch("multi_cpu.yaml", 2, "finetune/retrofit.py", "--config", str(cfg), "--pretrained", str(student),
                             "--teacher", str(base), "--output_dir", str(tmp_path / "two"), "--distill-steps", "1",
                             "--finetune-steps", "1", "--set", "data.teacher.store_dir=null", "--set", "data.batch_size=2",
                             timeout=400)
    assert proc.stdout.count("done -> ") == 1 and proc.stdout.count("held-out loss") == 1
    for phase in ("distill", "finetune"):
        summary = json.loads((tmp_path / "two" / phase / "train_summary.json").read_text())
        assert summary["steps"] == 1 and summary["batch_size"] == 4  # 2 per process, 2 processes
    assert (tmp_path / "two" / "finetune" / "final" / "transformer" / "mhla.safetensors").is_file()
    config = load_config(cfg)
    one = _build(_parts(config), config, tmp_path / "one")
    assert _shard_bytes(tmp_path / "two" / "teacher_store") == _shard_bytes(one) and len(_shard_bytes(one)) == 2


def test_opening_a_store_keeps_a_live_writers_temporary_shard(tmp_path):
    from mhla_diffusers.data.store import open_store

    folder = open_store(tmp_path / "s", "k", {"a": 1}, 2)
    live = folder / "shards" / f".00003.safetensors.tmp-{os.getpid()}"
    dead = folder / "shards" / ".00004.safetensors.tmp-999999999"
    live.write_bytes(b"being written")
    dead.write_bytes(b"left by a kill")
    open_store(folder, "k", {"a": 1}, 2)
    assert live.is_file() and not dead.exists()
