"""Wan 2.2 presets: T2V-A14B (two 14B experts, high-noise then low-noise, switched at ``boundary_ratio``), I2V-A14B (the
same with the image's latents as extra input channels), and TI2V-5B (one transformer, per-token timesteps, the 2.2 VAE;
text or text and image), with the umT5-XXL prompt encoder, the schedulers as published, and a tiny model for tests."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

from paradit.spec import ModelSpec


@dataclass(frozen=True)
class WanTextEncoder:
    """umT5 (``UMT5EncoderModel`` config): prompts padded to ``max_length`` tokens (diffusers' max_sequence_length),
    the features past each prompt's length zeroed."""

    config: dict[str, Any]
    max_length: int = 512


# google/umt5-xxl's encoder, as the Wan 2.2 checkpoints' text_encoder/config.json holds it.
UMT5_XXL: dict[str, Any] = {
    "model_type": "umt5",
    "vocab_size": 256384,
    "d_model": 4096,
    "d_kv": 64,
    "d_ff": 10240,
    "num_layers": 24,
    "num_heads": 64,
    "relative_attention_num_buckets": 32,
    "relative_attention_max_distance": 128,
    "feed_forward_proj": "gated-gelu",
    "dense_act_fn": "gelu_new",
    "is_gated_act": True,
    "layer_norm_epsilon": 1e-6,
    "tie_word_embeddings": False,
}

# The UniPC flow-matching schedulers of the published checkpoints (flow_shift 3.0 for T2V-A14B, 5.0 for TI2V-5B).
UNIPC_FLOW = {
    "_class_name": "UniPCMultistepScheduler",
    "num_train_timesteps": 1000,
    "prediction_type": "flow_prediction",
    "use_flow_sigmas": True,
    "solver_order": 2,
    "predict_x0": True,
    "solver_type": "bh2",
    "lower_order_final": True,
    "final_sigmas_type": "zero",
    "timestep_spacing": "linspace",
}

# Wan-AI/Wan2.2-T2V-A14B-Diffusers' transformer/config.json (transformer_2 is the same architecture).
A14B_TRANSFORMER: dict[str, Any] = {
    "patch_size": [1, 2, 2],
    "num_attention_heads": 40,
    "attention_head_dim": 128,
    "in_channels": 16,
    "out_channels": 16,
    "text_dim": 4096,
    "freq_dim": 256,
    "ffn_dim": 13824,
    "num_layers": 40,
    "cross_attn_norm": True,
    "qk_norm": "rms_norm_across_heads",
    "eps": 1e-6,
    "image_dim": None,
    "added_kv_proj_dim": None,
    "rope_max_seq_len": 1024,
    "pos_embed_seq_len": None,
}
# Wan-AI/Wan2.2-I2V-A14B-Diffusers': 16 noise channels, 4 first-frame mask channels, 16 image-latent channels in.
I2V_A14B_TRANSFORMER: dict[str, Any] = {**A14B_TRANSFORMER, "in_channels": 36}
TI2V_5B_TRANSFORMER: dict[str, Any] = {
    **A14B_TRANSFORMER,
    "num_attention_heads": 24,
    "in_channels": 48,
    "out_channels": 48,
    "ffn_dim": 14336,
    "num_layers": 30,
}

# The Wan 2.1 VAE (4x8x8, 16 channels) with diffusers' defaults, which are its published latents_mean/std.
WAN21_VAE: dict[str, Any] = {"base_dim": 96, "z_dim": 16, "dim_mult": [1, 2, 4, 4], "num_res_blocks": 2}
# The Wan 2.2 VAE (4x16x16, 48 channels, residual, 2x2 pixel patches). Its 48 published latents_mean/std are read
# from a checkpoint's vae/config.json; a random-weight run takes these neutral ones.
WAN22_VAE: dict[str, Any] = {
    "base_dim": 160,
    "decoder_base_dim": 256,
    "z_dim": 48,
    "dim_mult": [1, 2, 4, 4],
    "num_res_blocks": 2,
    "is_residual": True,
    "in_channels": 12,
    "out_channels": 12,
    "patch_size": 2,
    "scale_factor_spatial": 16,
    "scale_factor_temporal": 4,
    "latents_mean": [0.0] * 48,
    "latents_std": [1.0] * 48,
}

WAN_TINY_TEXT_ENCODER = {
    **UMT5_XXL,
    "vocab_size": 200,
    "d_model": 32,
    "d_kv": 8,
    "d_ff": 48,
    "num_layers": 2,
    "num_heads": 4,
    "relative_attention_num_buckets": 8,
    "relative_attention_max_distance": 16,
}
WAN_TINY_TRANSFORMER = {
    **A14B_TRANSFORMER,
    "num_attention_heads": 2,
    "attention_head_dim": 24,
    "text_dim": 32,
    "freq_dim": 32,
    "ffn_dim": 64,
    "num_layers": 2,
    "rope_max_seq_len": 64,
}
WAN_TINY_VAE = {"base_dim": 8, "z_dim": 16, "dim_mult": [1, 2, 4, 4], "num_res_blocks": 1}


@dataclass(frozen=True)
class WanDetails:
    """What only Wan reads: the timestep fraction below which the low-noise expert predicts (None: one
    transformer), and per-token timesteps (TI2V-5B)."""

    boundary_ratio: float | None = None
    expand_timesteps: bool = False


preset = functools.partial(ModelSpec, family="wan", text_encoder=WanTextEncoder(UMT5_XXL), guidance_mode="cfg")
two_experts = functools.partial(preset, vae=WAN21_VAE, steps=40, height=720, width=1280, frames=81, fps=16)
PRESETS: list[ModelSpec] = [
    two_experts(
        name="wan2.2-t2v-a14b",
        description="Wan 2.2 T2V-A14B text-to-video: two 14B experts (high-noise, low-noise); umT5-XXL",
        transformer=A14B_TRANSFORMER,
        experts={"transformer_2": A14B_TRANSFORMER},
        scheduler={**UNIPC_FLOW, "flow_shift": 3.0},
        guidance=4.0,
        guidance_2=3.0,
        hub_id="Wan-AI/Wan2.2-T2V-A14B-Diffusers",
        details=WanDetails(boundary_ratio=0.875),
    ),
    two_experts(
        name="wan2.2-i2v-a14b",
        description="Wan 2.2 I2V-A14B image-to-video (--image): two 14B experts (high-noise, low-noise); umT5-XXL",
        transformer=I2V_A14B_TRANSFORMER,
        experts={"transformer_2": I2V_A14B_TRANSFORMER},
        scheduler={**UNIPC_FLOW, "flow_shift": 5.0},
        guidance=3.5,
        guidance_2=3.5,
        hub_id="Wan-AI/Wan2.2-I2V-A14B-Diffusers",
        details=WanDetails(boundary_ratio=0.9),
    ),
    preset(
        name="wan2.2-ti2v-5b",
        description="Wan 2.2 TI2V-5B text-to-video, or image-to-video with --image: one 5B transformer, the 2.2 VAE "
        "(4x16x16); umT5-XXL",
        transformer=TI2V_5B_TRANSFORMER,
        vae=WAN22_VAE,
        scheduler={**UNIPC_FLOW, "flow_shift": 5.0},
        steps=50,
        guidance=5.0,
        height=704,
        width=1280,
        frames=121,
        fps=24,
        hub_id="Wan-AI/Wan2.2-TI2V-5B-Diffusers",
        details=WanDetails(expand_timesteps=True),
    ),
    preset(
        name="wan-tiny",
        description="a tiny two-expert Wan 2.2 (T2V layout), random weights, for demos and tests",
        transformer=WAN_TINY_TRANSFORMER,
        experts={"transformer_2": WAN_TINY_TRANSFORMER},
        text_encoder=WanTextEncoder(WAN_TINY_TEXT_ENCODER, max_length=32),
        vae=WAN_TINY_VAE,
        scheduler={**UNIPC_FLOW, "flow_shift": 3.0},
        steps=4,
        guidance=4.0,
        guidance_2=3.0,
        height=64,
        width=64,
        frames=5,
        fps=16,
        details=WanDetails(boundary_ratio=0.875),
    ),
]
