"""SpaceToDepthAutoencoder: exact, parameter-free, a drop-in `vae` for DiTPipeline (save / load included)."""

import json

import pytest
import torch
from helpers import realign_

from mhla_diffusers import SpaceToDepthAutoencoder
from mhla_diffusers.autoencoder import PointLatentDistribution


def tiny_dit(in_channels=12):
    from diffusers import DiTTransformer2DModel

    torch.manual_seed(0)
    return DiTTransformer2DModel(
        num_attention_heads=2, attention_head_dim=8, in_channels=in_channels, out_channels=in_channels,
        num_layers=1, sample_size=8, patch_size=2, num_embeds_ada_norm=1000,
    ).eval()


@pytest.mark.parametrize("factor", [1, 2, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_round_trip_is_bitwise_exact(factor, dtype):
    ae = SpaceToDepthAutoencoder(factor=factor, in_channels=3, scaling_factor=1.8)
    x = (torch.rand(2, 3, 8, 12, dtype=torch.float64) * 2 - 1).to(dtype)
    enc = ae.encode(x)
    z = enc.latent_dist.sample()
    assert z.shape == (2, 3 * factor * factor, 8 // factor, 12 // factor)
    assert z.dtype == dtype
    assert torch.equal(z, enc.latent_dist.mode())
    y = ae.decode(z).sample
    assert y.dtype == dtype and torch.equal(y, x)
    assert torch.equal(ae(x).sample, x)


def test_latents_are_patches_of_pixels():
    ae = SpaceToDepthAutoencoder(factor=2)
    x = torch.arange(3 * 4 * 4, dtype=torch.float32).view(1, 3, 4, 4)
    z = ae.encode(x).latent_dist.mode()
    # channel c*4 + i*2 + j holds pixel (2h + i, 2w + j) of channel c
    assert z[0, 0 * 4 + 1 * 2 + 1, 1, 0] == x[0, 0, 3, 1]
    assert z[0, 2 * 4 + 0 * 2 + 1, 0, 1] == x[0, 2, 0, 3]


def test_interface_details():
    ae = SpaceToDepthAutoencoder(factor=2, scaling_factor=2.0)
    assert sum(p.numel() for p in ae.parameters()) == 0
    assert len(ae.state_dict()) == 0
    assert ae.latent_channels == 12 and ae.config.scaling_factor == 2.0
    assert ae.dtype == torch.float32 and ae.device.type == "cpu"
    x = torch.zeros(1, 3, 4, 4)
    (dist,) = ae.encode(x, return_dict=False)
    assert isinstance(dist, PointLatentDistribution)
    g = torch.Generator().manual_seed(0)
    before = g.get_state()
    assert torch.equal(dist.sample(generator=g), dist.mean)
    assert torch.equal(g.get_state(), before)  # no randomness consumed
    assert torch.equal(dist.std, torch.zeros_like(dist.mean)) and dist.kl().shape == (1,)
    (y,) = ae.decode(dist.mean, return_dict=False)
    assert y.shape == x.shape
    ae64 = ae.to(torch.float64)
    assert ae64.dtype == torch.float64


def test_clear_errors():
    ae = SpaceToDepthAutoencoder(factor=2)
    with pytest.raises(ValueError, match="divisible by factor=2"):
        ae.encode(torch.zeros(1, 3, 5, 4))
    with pytest.raises(ValueError, match="3 channels"):
        ae.encode(torch.zeros(1, 4, 4, 4))
    with pytest.raises(ValueError, match="12 channels"):
        ae.decode(torch.zeros(1, 3, 4, 4))
    with pytest.raises(ValueError, match="4-D"):
        ae.encode(torch.zeros(3, 4, 4))
    for bad in [dict(factor=0), dict(factor=1.5), dict(in_channels=0), dict(scaling_factor=0.0)]:
        with pytest.raises(ValueError):
            SpaceToDepthAutoencoder(**bad)


def test_save_and_load(tmp_path):
    ae = SpaceToDepthAutoencoder(factor=4, in_channels=1, scaling_factor=0.5)
    ae.save_pretrained(tmp_path / "ae")
    assert (tmp_path / "ae" / "diffusion_pytorch_model.safetensors").is_file()
    back = SpaceToDepthAutoencoder.from_pretrained(tmp_path / "ae")
    assert (back.config.factor, back.config.in_channels, back.config.scaling_factor) == (4, 1, 0.5)
    ae.save_pretrained(tmp_path / "v", variant="fp16")
    back = SpaceToDepthAutoencoder.from_pretrained(tmp_path / "v", variant="fp16")
    assert back.config.factor == 4


def test_works_as_the_vae_of_dit_pipeline(tmp_path):
    from diffusers import DDIMScheduler, DiffusionPipeline, DiTPipeline

    ae = SpaceToDepthAutoencoder(factor=2, scaling_factor=1.8)
    pipe = DiTPipeline(transformer=tiny_dit(), vae=ae, scheduler=DDIMScheduler())
    pipe.set_progress_bar_config(disable=True)
    images = pipe([1, 2], num_inference_steps=2, generator=torch.Generator().manual_seed(0), output_type="np").images
    assert images.shape == (2, 16, 16, 3)

    pipe.save_pretrained(tmp_path / "pipe")
    index = json.loads((tmp_path / "pipe" / "model_index.json").read_text())
    assert index["vae"][0].split(".")[0] == "mhla_diffusers" and index["vae"][1] == "SpaceToDepthAutoencoder"
    for cls in (DiTPipeline, DiffusionPipeline):
        loaded = cls.from_pretrained(tmp_path / "pipe")
        assert isinstance(loaded, DiTPipeline) and isinstance(loaded.vae, SpaceToDepthAutoencoder)
        loaded.set_progress_bar_config(disable=True)
        realign_(loaded.transformer), realign_(loaded.vae)  # weights out of the mmapped file: GEMMs see other alignments
        again = loaded([1, 2], num_inference_steps=2, generator=torch.Generator().manual_seed(0), output_type="np").images
        assert (again == images).all()
