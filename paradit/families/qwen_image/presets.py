"""Qwen-Image presets: the text-to-image and edit models as published, and a tiny model for the demo and tests."""

from __future__ import annotations

import functools

from paradit.families.qwen_image.edit import EDIT, EDIT_PLUS
from paradit.spec import ModelSpec, read_configs

CONFIGS = read_configs(__file__)
# The published scheduler config: dynamic shifting with mu from the image size (up to 8192 tokens), and the sigma
# ladder stretched so that its last step lands at 0.02.
QWEN_IMAGE_SCHEDULER = CONFIGS["scheduler"]
# AutoencoderKLQwenImage as published (its defaults, the Wan 2.1 VAE): 16 channels, 8x spatial stride.
QWEN_IMAGE_VAE = CONFIGS["vae"]
# Qwen2.5-VL-7B-Instruct (8,292,166,656 parameters with its vision tower). Text-to-image reads only the language
# model's last hidden states, so its dummy mode builds the text config alone; the edit models read images too.
QWEN25_VL_7B = CONFIGS["qwen25_vl_7b"]
_QWEN_IMAGE = CONFIGS["transformer"]

QWEN_IMAGE_TINY_TRANSFORMER = {**_QWEN_IMAGE, **CONFIGS["tiny_transformer_changes"]}
_TINY_TOWERS = CONFIGS["tiny_text_encoder_changes"]  # of the 7B's text and vision configs
QWEN_IMAGE_TINY_TEXT_ENCODER = {
    "model_type": "qwen2_5_vl",
    "text_config": {**QWEN25_VL_7B["text_config"], **_TINY_TOWERS["text_config"]},
    "vision_config": {**QWEN25_VL_7B["vision_config"], **_TINY_TOWERS["vision_config"]},
    "tie_word_embeddings": False,
}

preset = functools.partial(
    ModelSpec, family="qwen_image", scheduler=QWEN_IMAGE_SCHEDULER, guidance_mode="cfg", guidance=4.0
)
full_size = functools.partial(preset, text_encoder=QWEN25_VL_7B, vae=QWEN_IMAGE_VAE, steps=50, height=1024, width=1024)
PRESETS: list[ModelSpec] = [
    full_size(
        name="qwen-image",
        description="Qwen-Image, 20B MMDiT (60 dual-stream blocks), true CFG; Qwen2.5-VL-7B text encoder",
        transformer=_QWEN_IMAGE,
        hub_id="Qwen/Qwen-Image",
    ),
    full_size(
        name="qwen-image-edit-2511",
        description="Qwen-Image-Edit-2511, the 20B MMDiT editing from one or more images (their tokens modulated as "
        "at timestep 0); Qwen2.5-VL-7B reads them with the prompt",
        transformer={**_QWEN_IMAGE, "zero_cond_t": True},
        hub_id="Qwen/Qwen-Image-Edit-2511",
        details=EDIT_PLUS,
    ),
    full_size(
        name="qwen-image-edit-2509",
        description="Qwen-Image-Edit-2509, the 20B MMDiT editing from one or more images; Qwen2.5-VL-7B reads them",
        transformer=_QWEN_IMAGE,
        hub_id="Qwen/Qwen-Image-Edit-2509",
        details=EDIT_PLUS,
    ),
    full_size(
        name="qwen-image-edit",
        description="Qwen-Image-Edit, the 20B MMDiT editing one image; Qwen2.5-VL-7B reads it with the prompt",
        transformer=_QWEN_IMAGE,
        hub_id="Qwen/Qwen-Image-Edit",
        details=EDIT,
    ),
    preset(
        name="qwen-image-tiny",
        description="a few-million-parameter Qwen-Image, random weights, for demos and tests",
        transformer=QWEN_IMAGE_TINY_TRANSFORMER,
        text_encoder=QWEN_IMAGE_TINY_TEXT_ENCODER,
        vae={**QWEN_IMAGE_VAE, "base_dim": 8, "dim_mult": [1, 2, 2, 2], "num_res_blocks": 1},
        steps=8,
        height=128,
        width=128,
    ),
]
