"""Published transformer architectures (diffusers config dicts) used by the tests and benchmarks
to build real-size models with random weights, offline."""

__all__ = ["DIT_XL_2", "SANA_600M", "SANA_1600M", "WAN_1_3B", "WAN_14B", "WAN_VACE_1_3B", "WAN_VACE_14B", "SANA_VIDEO_2B"]

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

# SANA-1600M: transformer/config.json of Efficient-Large-Model/Sana_1600M_1024px_diffusers ("SanaMS_1600M_P1_D20":
# 20 layers, 70 heads x 32 = 2,240, cross-attention 20 heads x 112 over 2,240).
SANA_1600M = dict(
    SANA_600M,
    num_attention_heads=70,
    attention_head_dim=32,
    num_layers=20,
    num_cross_attention_heads=20,
    cross_attention_head_dim=112,
    cross_attention_dim=2240,
)

# Wan2.1-T2V-1.3B: transformer/config.json of Wan-AI/Wan2.1-T2V-1.3B-Diffusers.
WAN_1_3B = dict(
    patch_size=(1, 2, 2),
    num_attention_heads=12,
    attention_head_dim=128,
    in_channels=16,
    out_channels=16,
    text_dim=4096,
    freq_dim=256,
    ffn_dim=8960,
    num_layers=30,
    cross_attn_norm=True,
    qk_norm="rms_norm_across_heads",
    eps=1e-6,
    image_dim=None,
    added_kv_proj_dim=None,
    rope_max_seq_len=1024,
)

# Wan2.1-T2V-14B: transformer/config.json of Wan-AI/Wan2.1-T2V-14B-Diffusers (40 layers, 40 heads x 128 = 5,120).
WAN_14B = dict(WAN_1_3B, num_attention_heads=40, ffn_dim=13824, num_layers=40)

# Wan2.1-VACE-1.3B / -14B: transformer/config.json of Wan-AI/Wan2.1-VACE-1.3B-diffusers / Wan2.1-VACE-14B-diffusers
# (WanVACETransformer3DModel): the Wan 2.1 T2V trunk plus one VACE block per vace_layers entry, whose hint is added
# after that main block; control latents of 96 channels (16 + 16 video latent channels, the 8 x 8 mask folded in).
WAN_VACE_1_3B = dict(WAN_1_3B, vace_layers=list(range(0, 30, 2)), vace_in_channels=96)  # 15 VACE blocks
WAN_VACE_14B = dict(WAN_14B, vace_layers=list(range(0, 40, 5)), vace_in_channels=96)  # 8 VACE blocks

# SANA-Video 2B 480p: SanaVideoTransformer3DModel's defaults in diffusers 0.42.1, written for the released
# Efficient-Large-Model/SANA-Video_2B_480p_diffusers (2,240 = 20 heads x 112, 20 blocks, Wan 2.1 VAE latents,
# Gemma-2 2B captions); its config.json was not readable here.
SANA_VIDEO_2B = dict(
    in_channels=16,
    out_channels=16,
    num_attention_heads=20,
    attention_head_dim=112,
    num_layers=20,
    num_cross_attention_heads=20,
    cross_attention_head_dim=112,
    cross_attention_dim=2240,
    caption_channels=2304,
    mlp_ratio=2.5,
    patch_size=(1, 2, 2),
    sample_size=30,
    qk_norm="rms_norm_across_heads",
    rope_max_seq_len=1024,
)
