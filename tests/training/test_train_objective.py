"""The training objectives (epsilon, flow matching) and the trainer's random draws."""

import pytest
import torch

from mhla_diffusers.training.flow import Objective, flow_match_scheduler


def test_flow_matching_inputs_follow_the_rectified_flow_formulas():
    table = flow_match_scheduler(shift=3.0)
    obj = Objective("flow", table, loss_weighting="sigma_sqrt")
    x0, noise = torch.randn(4, 3, 5, 5), torch.randn(4, 3, 5, 5)
    u = torch.tensor([0.0, 0.25, 0.5, 0.999])
    noisy, timesteps, target, weights = obj.inputs(x0, noise, u)
    s = 1 - torch.floor(u * 1000) / 1000  # the unshifted table sigma at index floor(u T)
    sigma = 3.0 * s / (1 + 2.0 * s)  # shift: sigma = shift s / (1 + (shift - 1) s)
    torch.testing.assert_close(timesteps, sigma * 1000, rtol=1e-5, atol=1e-3)
    view = sigma.view(-1, 1, 1, 1)
    torch.testing.assert_close(noisy, (1 - view) * x0 + view * noise, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(target, noise - x0)
    torch.testing.assert_close(weights, sigma ** -2.0, rtol=1e-3, atol=0)
    pred = target + 1.0
    assert Objective.loss(pred, target) == pytest.approx(1.0)
    assert Objective.loss(pred, target, weights) == pytest.approx(float(weights.mean()), rel=1e-5)


def test_flow_draws_are_logit_normal_and_seeded():
    obj = Objective("flow", flow_match_scheduler(1.0))
    a = obj.draw(20000, torch.Generator().manual_seed(0))
    b = obj.draw(20000, torch.Generator().manual_seed(0))
    assert torch.equal(a, b) and 0 < float(a.min()) and float(a.max()) < 1
    logit = torch.log(a / (1 - a))
    assert abs(float(logit.mean())) < 0.03 and abs(float(logit.std()) - 1) < 0.03
    u = obj.evenly_spaced(torch.arange(4), 4)
    torch.testing.assert_close(u, torch.tensor([0.125, 0.375, 0.625, 0.875], dtype=torch.float64))
    uniform = Objective("flow", flow_match_scheduler(1.0), timestep_sampling="uniform").draw(5000, torch.Generator().manual_seed(0))
    assert abs(float(uniform.mean()) - 0.5) < 0.02


def test_epsilon_objective_matches_ddpm():
    from diffusers import DDPMScheduler

    sched = DDPMScheduler()
    obj = Objective("epsilon", sched)
    x0, noise = torch.randn(3, 2, 4, 4), torch.randn(3, 2, 4, 4)
    t = obj.draw(3, torch.Generator().manual_seed(0))
    assert t.dtype == torch.long and int(t.max()) < 1000
    noisy, timesteps, target, weights = obj.inputs(x0, noise, t)
    assert torch.equal(noisy, sched.add_noise(x0, noise, t)) and target is noise and weights is None
    assert obj.evenly_spaced(torch.arange(3), 3).tolist() == [0, 500, 999]
    with pytest.raises(ValueError, match="objective must be one of"):
        Objective("v", sched)
    with pytest.raises(ValueError, match="shift must be > 0"):
        flow_match_scheduler(0.0)


def test_step_draws_are_shared_by_ranks():
    """Ranks slice one global draw: rank r, sample j == global position j * world + r."""
    from diffusers import DDPMScheduler

    from mhla_diffusers.training import TrainingParts
    from mhla_diffusers.training.losses import _step_draws

    parts = TrainingParts("dit", None, None, DDPMScheduler(), Objective("epsilon", DDPMScheduler()))
    latents = torch.zeros(4, 2, 3, 3)
    full = _step_draws(parts, torch.zeros(8, 2, 3, 3), torch.Generator().manual_seed(5), rank=0, world_size=1,
                       dropout=0.5, condition="random", num_classes=10)
    for rank in range(2):
        part = _step_draws(parts, latents, torch.Generator().manual_seed(5), rank=rank, world_size=2,
                           dropout=0.5, condition="random", num_classes=10)
        for got, want in zip(part, full):
            assert torch.equal(got, want[rank::2])
