"""Z-Image presets: Turbo (step-distilled) and base as published, and a tiny model for the demo and tests."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from paradit.families.encoders import QWEN3_4B
from paradit.spec import ModelSpec, TextEncoderSpec, read_configs

CONFIGS = read_configs(__file__)
DEFAULTS = CONFIGS["presets"]
# Both checkpoints use a fixed timestep shift (no dynamic shifting): 3.0 for Turbo, 6.0 for the base model.
TURBO_SCHEDULER = CONFIGS["turbo_scheduler"]
BASE_SCHEDULER = CONFIGS["base_scheduler"]
FLUX1_VAE = CONFIGS["flux1_vae"]
# Tongyi-MAI/Z-Image-Turbo's transformer/config.json (shared/models/configs.json); the base model shares it.
_ZIMAGE_TRANSFORMER = CONFIGS["transformer"]


@dataclass(frozen=True)
class OmniEncoders:
    """An Omni checkpoint's prompt encoders: Qwen3 read as Z-Image reads it, and the ``siglip`` folder's config."""

    captions: TextEncoderSpec
    siglip: dict[str, Any]


def text_encoder_spec(config: dict[str, Any], class_name: str | None = None) -> TextEncoderSpec:
    """The pipeline reads ``hidden_states[-2]`` (the last layer never runs) of at most 512 tokens, as the reference."""
    return TextEncoderSpec(config, layers=(config["num_hidden_layers"] - 1,), max_length=512, class_name=class_name)


def preset(name: str, scheduler: dict, **configs: Any) -> ModelSpec:
    full_size = {"transformer": _ZIMAGE_TRANSFORMER, "text_encoder": text_encoder_spec(QWEN3_4B), "vae": FLUX1_VAE}
    return ModelSpec(name=name, family="zimage", scheduler=scheduler, **{**full_size, **configs}, **DEFAULTS[name])


PRESETS: list[ModelSpec] = [
    preset("z-image-turbo", TURBO_SCHEDULER),
    preset("z-image", BASE_SCHEDULER),
    preset(
        "z-image-tiny",
        BASE_SCHEDULER,
        transformer={**_ZIMAGE_TRANSFORMER, **CONFIGS["tiny_transformer_changes"]},
        text_encoder=text_encoder_spec({**QWEN3_4B, **CONFIGS["tiny_text_encoder_changes"]}),
        vae={**FLUX1_VAE, "block_out_channels": [16, 16, 16, 16], "layers_per_block": 1, "norm_num_groups": 4},
    ),
]
