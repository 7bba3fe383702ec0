"""Stable Diffusion 3.5 presets: large and medium as published, and a tiny model for the demo and tests."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from paradit.spec import ModelSpec, read_configs


@dataclass(frozen=True)
class SD3TextEncoders:
    clip_l: dict[str, Any]
    clip_g: dict[str, Any]
    t5: dict[str, Any]
    max_sequence_length: int = 256


CONFIGS = read_configs(__file__)
DEFAULTS = CONFIGS["presets"]
# The published configs keep CLIP's legacy token ids (eos 2: pooling takes the highest token id, which is the eos).
CLIP_L = CONFIGS["clip_l"]
OPENCLIP_BIGG = {**CLIP_L, **CONFIGS["openclip_bigg_changes"]}
T5_V1_1_XXL = CONFIGS["t5_v1_1_xxl"]
SD3_TEXT_ENCODERS = SD3TextEncoders(clip_l=CLIP_L, clip_g=OPENCLIP_BIGG, t5=T5_V1_1_XXL)

SD3_VAE = CONFIGS["vae"]
SD3_SCHEDULER = CONFIGS["scheduler"]

SD35_LARGE = CONFIGS["sd35_large"]
SD35_MEDIUM = {**SD35_LARGE, **CONFIGS["sd35_medium_changes"]}

_TINY_CLIP = CONFIGS["tiny_clip"]


def preset(name: str, **configs: Any) -> ModelSpec:
    full_size = {"text_encoder": SD3_TEXT_ENCODERS, "vae": SD3_VAE}
    return ModelSpec(name=name, family="sd3", scheduler=SD3_SCHEDULER, **{**full_size, **configs}, **DEFAULTS[name])


PRESETS: list[ModelSpec] = [
    preset("sd3.5-large", transformer=SD35_LARGE),
    preset("sd3.5-medium", transformer=SD35_MEDIUM),
    preset(
        "sd3.5-tiny",
        transformer={**SD35_MEDIUM, **CONFIGS["tiny_transformer_changes"]},
        text_encoder=SD3TextEncoders(
            clip_l=_TINY_CLIP, clip_g={**_TINY_CLIP, "hidden_size": 24, "hidden_act": "gelu"}, t5=CONFIGS["tiny_t5"]
        ),
        vae={**SD3_VAE, **CONFIGS["tiny_vae_changes"]},
    ),
]
