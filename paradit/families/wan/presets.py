"""Wan 2.2 presets: T2V-A14B, I2V-A14B and TI2V-5B as published, and a tiny model for the demo and tests."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

from paradit.spec import ModelSpec, read_configs


@dataclass(frozen=True)
class WanTextEncoder:
    """umT5 (``UMT5EncoderModel`` config): prompts padded to ``max_length`` tokens (diffusers' max_sequence_length),
    the features past each prompt's length zeroed."""

    config: dict[str, Any]
    max_length: int = 512


CONFIGS = read_configs(__file__)
# google/umt5-xxl's encoder, as the Wan 2.2 checkpoints' text_encoder/config.json holds it.
UMT5_XXL = CONFIGS["umt5_xxl"]
# The UniPC flow-matching schedulers of the published checkpoints (flow_shift 3.0 for T2V-A14B, 5.0 for TI2V-5B).
UNIPC_FLOW = CONFIGS["unipc_flow"]
# Wan-AI/Wan2.2-T2V-A14B-Diffusers' transformer/config.json (transformer_2 is the same architecture).
A14B_TRANSFORMER = CONFIGS["a14b_transformer"]
# Wan-AI/Wan2.2-I2V-A14B-Diffusers': 16 noise channels, 4 first-frame mask channels, 16 image-latent channels in.
I2V_A14B_TRANSFORMER = {**A14B_TRANSFORMER, "in_channels": 36}
TI2V_5B_TRANSFORMER = {**A14B_TRANSFORMER, **CONFIGS["ti2v_5b_transformer_changes"]}

# The Wan 2.1 VAE (4x8x8, 16 channels) with diffusers' defaults, which are its published latents_mean/std.
WAN21_VAE = CONFIGS["wan21_vae"]
# The Wan 2.2 VAE (4x16x16, 48 channels, residual, 2x2 pixel patches). Its 48 published latents_mean/std are read
# from a checkpoint's vae/config.json; a random-weight run takes these neutral ones.
WAN22_VAE = {**CONFIGS["wan22_vae"], "latents_mean": [0.0] * 48, "latents_std": [1.0] * 48}

WAN_TINY_TRANSFORMER = {**A14B_TRANSFORMER, **CONFIGS["tiny_transformer_changes"]}


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
        text_encoder=WanTextEncoder({**UMT5_XXL, **CONFIGS["tiny_text_encoder_changes"]}, max_length=32),
        vae=CONFIGS["tiny_vae"],
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
