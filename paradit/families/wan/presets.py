"""Wan 2.2 presets: T2V-A14B, I2V-A14B and TI2V-5B as published, and a tiny model for the demo and tests."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from paradit.spec import ModelSpec, read_configs


@dataclass(frozen=True)
class WanTextEncoder:
    """umT5's ``UMT5EncoderModel`` config; prompts padded to ``max_length`` (diffusers' max_sequence_length)."""

    config: dict[str, Any]
    max_length: int = 512


CONFIGS = read_configs(__file__)
DEFAULTS = CONFIGS["presets"]
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
# The Wan 2.2 VAE (4x16x16, 48 channels); random weights take neutral latents_mean/std (a checkpoint's are read).
WAN22_VAE = {**CONFIGS["wan22_vae"], "latents_mean": [0.0] * 48, "latents_std": [1.0] * 48}


@dataclass(frozen=True)
class WanDetails:
    """The timestep fraction below which the low-noise expert predicts (None: one transformer); TI2V-5B's timesteps."""

    boundary_ratio: float | None = None
    expand_timesteps: bool = False


def preset(name: str, transformer: dict, flow_shift: float, details: WanDetails, **configs: Any) -> ModelSpec:
    return ModelSpec(
        name=name,
        family="wan",
        transformer=transformer,
        experts={"transformer_2": transformer} if details.boundary_ratio is not None else {},
        scheduler={**UNIPC_FLOW, "flow_shift": flow_shift},
        details=details,
        **{"text_encoder": WanTextEncoder(UMT5_XXL), "vae": WAN21_VAE, **configs},
        **DEFAULTS[name],
    )


PRESETS: list[ModelSpec] = [
    preset("wan2.2-t2v-a14b", A14B_TRANSFORMER, 3.0, WanDetails(boundary_ratio=0.875)),
    preset("wan2.2-i2v-a14b", I2V_A14B_TRANSFORMER, 5.0, WanDetails(boundary_ratio=0.9)),
    preset("wan2.2-ti2v-5b", TI2V_5B_TRANSFORMER, 5.0, WanDetails(expand_timesteps=True), vae=WAN22_VAE),
    preset(
        "wan-tiny",
        {**A14B_TRANSFORMER, **CONFIGS["tiny_transformer_changes"]},
        3.0,
        WanDetails(boundary_ratio=0.875),
        text_encoder=WanTextEncoder({**UMT5_XXL, **CONFIGS["tiny_text_encoder_changes"]}, max_length=32),
        vae=CONFIGS["tiny_vae"],
    ),
]
