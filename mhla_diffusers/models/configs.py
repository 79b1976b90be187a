"""Published transformer architectures (diffusers config dicts) used by the tests and benchmarks
to build real-size models with random weights, offline."""

__all__ = ["DIT_XL_2", "SANA_600M"]

# DiT-XL/2: the transformer config of facebook/DiT-XL-2-256 (learned sigma: out_channels 8).
DIT_XL_2 = dict(
    num_layers=28,
    num_attention_heads=16,
    attention_head_dim=72,
    in_channels=4,
    out_channels=8,
    patch_size=2,
    sample_size=32,
    num_embeds_ada_norm=1000,
)

# SANA-600M: transformer/config.json of Efficient-Large-Model/Sana_600M_1024px_diffusers, as
# diffusers' scripts/convert_sana_to_diffusers.py writes it for "SanaMS_600M_P1_D28" (qk_norm None).
SANA_600M = dict(
    in_channels=32,
    out_channels=32,
    num_attention_heads=36,
    attention_head_dim=32,
    num_layers=28,
    num_cross_attention_heads=16,
    cross_attention_head_dim=72,
    cross_attention_dim=1152,
    caption_channels=2304,
    mlp_ratio=2.5,
    dropout=0.0,
    attention_bias=False,
    sample_size=32,
    patch_size=1,
    norm_elementwise_affine=False,
    norm_eps=1e-6,
    qk_norm=None,
)
