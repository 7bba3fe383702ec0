"""Qwen-Image presets: the text-to-image and edit models as published, and a tiny model for the demo and tests."""

from __future__ import annotations

from typing import Any

from paradit.families.qwen_image.edit import EDIT, EDIT_PLUS
from paradit.spec import ModelSpec, read_configs

CONFIGS = read_configs(__file__)
DEFAULTS = CONFIGS["presets"]
# Dynamic shifting with mu from the image size (up to 8192 tokens), the sigmas stretched to end at 0.02.
QWEN_IMAGE_SCHEDULER = CONFIGS["scheduler"]
# AutoencoderKLQwenImage as published (its defaults, the Wan 2.1 VAE): 16 channels, 8x spatial stride.
QWEN_IMAGE_VAE = CONFIGS["vae"]
# Qwen2.5-VL-7B-Instruct (8,292,166,656 parameters with vision); text-to-image's dummy builds its text config alone.
QWEN25_VL_7B = CONFIGS["qwen25_vl_7b"]
_QWEN_IMAGE = CONFIGS["transformer"]

QWEN_IMAGE_TINY_TRANSFORMER = {**_QWEN_IMAGE, **CONFIGS["tiny_transformer_changes"]}
QWEN_IMAGE_TINY_TEXT_ENCODER = {
    "model_type": "qwen2_5_vl",
    **{tower: {**QWEN25_VL_7B[tower], **changes} for tower, changes in CONFIGS["tiny_text_encoder_changes"].items()},
    "tie_word_embeddings": False,
}


def preset(name: str, **configs: Any) -> ModelSpec:
    full_size = {"text_encoder": QWEN25_VL_7B, "vae": QWEN_IMAGE_VAE}
    return ModelSpec(
        name=name, family="qwen_image", scheduler=QWEN_IMAGE_SCHEDULER, **{**full_size, **configs}, **DEFAULTS[name]
    )


PRESETS: list[ModelSpec] = [
    preset("qwen-image", transformer=_QWEN_IMAGE),
    preset("qwen-image-edit-2511", transformer={**_QWEN_IMAGE, "zero_cond_t": True}, details=EDIT_PLUS),
    preset("qwen-image-edit-2509", transformer=_QWEN_IMAGE, details=EDIT_PLUS),
    preset("qwen-image-edit", transformer=_QWEN_IMAGE, details=EDIT),
    preset(
        "qwen-image-tiny",
        transformer=QWEN_IMAGE_TINY_TRANSFORMER,
        text_encoder=QWEN_IMAGE_TINY_TEXT_ENCODER,
        vae={**QWEN_IMAGE_VAE, "base_dim": 8, "dim_mult": [1, 2, 2, 2], "num_res_blocks": 1},
    ),
]
