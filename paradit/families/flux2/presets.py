"""FLUX.2 presets: dev and klein as published, and a tiny model for the demo and tests."""

from __future__ import annotations

from typing import Any

from paradit.families.encoders import MISTRAL_SMALL_31, QWEN3_4B, QWEN3_8B, QWEN3_COMMON
from paradit.spec import ModelSpec, TextEncoderSpec, read_configs

CONFIGS = read_configs(__file__)
DEFAULTS = CONFIGS["presets"]
# The scheduler config FLUX.2 ships: dynamic shifting, with mu computed by the pipeline from the image size.
FLUX2_SCHEDULER = CONFIGS["scheduler"]
# The published VAE is AutoencoderKLFlux2's default; the stride is stated because requests are checked against it.
FLUX2_VAE = CONFIGS["vae"]
_FLUX2_DEV = CONFIGS["dev_transformer"]

FLUX2_TINY_TRANSFORMER = {**_FLUX2_DEV, **CONFIGS["tiny_transformer_changes"]}


def preset(name: str, vae: dict = FLUX2_VAE, **configs: Any) -> ModelSpec:
    return ModelSpec(name=name, family="flux2", vae=vae, scheduler=FLUX2_SCHEDULER, **configs, **DEFAULTS[name])


PRESETS: list[ModelSpec] = [
    preset("flux2-dev", transformer=_FLUX2_DEV, text_encoder=TextEncoderSpec(MISTRAL_SMALL_31, layers=(10, 20, 30))),
    preset(
        "flux2-klein-4b",
        transformer={**_FLUX2_DEV, **CONFIGS["klein_4b_transformer_changes"]},
        text_encoder=TextEncoderSpec(QWEN3_4B, layers=(9, 18, 27)),
    ),
    preset(
        "flux2-klein-9b",
        transformer={**_FLUX2_DEV, **CONFIGS["klein_9b_transformer_changes"]},
        text_encoder=TextEncoderSpec(QWEN3_8B, layers=(9, 18, 27)),
    ),
    preset(
        "flux2-tiny",
        transformer=FLUX2_TINY_TRANSFORMER,
        text_encoder=TextEncoderSpec({**QWEN3_COMMON, **CONFIGS["tiny_text_encoder_changes"]}, layers=(9, 18, 27)),
        vae=CONFIGS["tiny_vae"],
    ),
]
