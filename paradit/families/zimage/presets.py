"""Z-Image presets: Turbo (step-distilled) and base as published, and a tiny model for the demo and tests."""

from __future__ import annotations

import functools
from typing import Any

from paradit.families.encoders import QWEN3_4B
from paradit.spec import ModelSpec, TextEncoderSpec, read_configs

CONFIGS = read_configs(__file__)
# Both checkpoints use a fixed timestep shift (no dynamic shifting): 3.0 for Turbo, 6.0 for the base model.
TURBO_SCHEDULER = CONFIGS["turbo_scheduler"]
BASE_SCHEDULER = CONFIGS["base_scheduler"]
FLUX1_VAE = CONFIGS["flux1_vae"]
# Tongyi-MAI/Z-Image-Turbo's transformer/config.json (shared/models/configs.json); the base model shares it.
_ZIMAGE_TRANSFORMER = CONFIGS["transformer"]


def text_encoder_spec(config: dict[str, Any], class_name: str | None = None) -> TextEncoderSpec:
    """The pipeline reads ``hidden_states[-2]``: the output of the second-to-last decoder layer, so the last layer is
    never run. Captions are at most 512 tokens (the reference's max_sequence_length)."""
    return TextEncoderSpec(config, layers=(config["num_hidden_layers"] - 1,), max_length=512, class_name=class_name)


preset = functools.partial(ModelSpec, family="zimage", vae=FLUX1_VAE, guidance_mode="cfg", height=1024, width=1024)
full_size = functools.partial(preset, transformer=_ZIMAGE_TRANSFORMER, text_encoder=text_encoder_spec(QWEN3_4B))
PRESETS: list[ModelSpec] = [
    full_size(
        name="z-image-turbo",
        description="Z-Image-Turbo, 6.2B, step-distilled (8 steps, guidance 0: off); Qwen3-4B text encoder",
        scheduler=TURBO_SCHEDULER,
        steps=8,
        guidance=0.0,
        hub_id="Tongyi-MAI/Z-Image-Turbo",
    ),
    full_size(
        name="z-image",
        description="Z-Image, 6.2B, the non-distilled base model (true CFG, negative prompts); Qwen3-4B text encoder",
        scheduler=BASE_SCHEDULER,
        steps=50,
        guidance=5.0,
        hub_id="Tongyi-MAI/Z-Image",
    ),
    preset(
        name="z-image-tiny",
        description="a few-million-parameter Z-Image (base layout, true CFG), random weights, for demos and tests",
        transformer={**_ZIMAGE_TRANSFORMER, **CONFIGS["tiny_transformer_changes"]},
        text_encoder=text_encoder_spec({**QWEN3_4B, **CONFIGS["tiny_text_encoder_changes"]}),
        vae={**FLUX1_VAE, "block_out_channels": [16, 16, 16, 16], "layers_per_block": 1, "norm_num_groups": 4},
        scheduler=BASE_SCHEDULER,
        steps=8,
        guidance=5.0,
        height=128,
        width=128,
    ),
]
