"""Qwen-Image presets: the published full-size model (``Qwen/Qwen-Image``), its Qwen2.5-VL-7B text encoder's config
(for ``--load-format dummy``), VAE and scheduler, a tiny model for demo and tests."""

from __future__ import annotations

from typing import Any

from paradit.families.qwen_image.edit import EDIT, EDIT_PLUS
from paradit.spec import ModelSpec

# The published scheduler config: dynamic shifting with mu from the image size (up to 8192 tokens), and the sigma
# ladder stretched so that its last step lands at 0.02.
QWEN_IMAGE_SCHEDULER = {
    "num_train_timesteps": 1000,
    "shift": 1.0,
    "use_dynamic_shifting": True,
    "base_shift": 0.5,
    "max_shift": 0.9,
    "base_image_seq_len": 256,
    "max_image_seq_len": 8192,
    "shift_terminal": 0.02,
    "time_shift_type": "exponential",
}

# AutoencoderKLQwenImage as published (its defaults, the Wan 2.1 VAE): 16 channels, 8x spatial stride.
QWEN_IMAGE_VAE: dict[str, Any] = {
    "base_dim": 96,
    "z_dim": 16,
    "dim_mult": [1, 2, 4, 4],
    "num_res_blocks": 2,
    "attn_scales": [],
    "temperal_downsample": [False, True, True],
    "dropout": 0.0,
    "latents_mean": [
        -0.7571,
        -0.7089,
        -0.9113,
        0.1075,
        -0.1745,
        0.9653,
        -0.1517,
        1.5508,
        0.4134,
        -0.0715,
        0.5517,
        -0.3632,
        -0.1922,
        -0.9497,
        0.2503,
        -0.2921,
    ],
    "latents_std": [
        2.8184,
        1.4541,
        2.3275,
        2.6558,
        1.2196,
        1.7708,
        2.6052,
        2.0743,
        3.2687,
        2.1526,
        2.8652,
        1.5579,
        1.6382,
        1.1253,
        2.8251,
        1.9160,
    ],
}

# Qwen2_5_VLForConditionalGeneration, Qwen2.5-VL-7B-Instruct (8,292,166,656 parameters with its vision tower).
# Text-to-image reads only the language model's last hidden states, so its dummy mode builds the text config alone;
# the edit models' encoder reads their input images too, through the vision tower.
QWEN25_VL_7B: dict[str, Any] = {
    "model_type": "qwen2_5_vl",
    "text_config": {
        "vocab_size": 152064,
        "hidden_size": 3584,
        "intermediate_size": 18944,
        "num_hidden_layers": 28,
        "num_attention_heads": 28,
        "num_key_value_heads": 4,
        "hidden_act": "silu",
        "max_position_embeddings": 128000,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "rope_scaling": {"type": "mrope", "mrope_section": [16, 24, 24]},
        "sliding_window": 32768,
        "max_window_layers": 28,
        "use_sliding_window": False,
        "bos_token_id": 151643,
        "eos_token_id": 151645,
    },
    "vision_config": {
        "depth": 32,
        "hidden_act": "silu",
        "hidden_size": 1280,
        "intermediate_size": 3420,
        "num_heads": 16,
        "in_chans": 3,
        "out_hidden_size": 3584,
        "patch_size": 14,
        "spatial_merge_size": 2,
        "spatial_patch_size": 14,
        "window_size": 112,
        "fullatt_block_indexes": [7, 15, 23, 31],
        "tokens_per_second": 2,
        "temporal_patch_size": 2,
    },
    "image_token_id": 151655,
    "video_token_id": 151656,
    "vision_start_token_id": 151652,
    "vision_end_token_id": 151653,
    "tie_word_embeddings": False,
}

_QWEN_IMAGE = {
    "patch_size": 2,
    "in_channels": 64,
    "out_channels": 16,
    "num_layers": 60,
    "attention_head_dim": 128,
    "num_attention_heads": 24,
    "joint_attention_dim": 3584,
    "guidance_embeds": False,
    "axes_dims_rope": [16, 56, 56],
    "zero_cond_t": False,
    "use_additional_t_cond": False,
    "use_layer3d_rope": False,
}

QWEN_IMAGE_TINY_TRANSFORMER = {
    **_QWEN_IMAGE,
    "num_layers": 2,
    "attention_head_dim": 32,
    "num_attention_heads": 4,
    "joint_attention_dim": 64,
    "axes_dims_rope": [8, 12, 12],
}
QWEN_IMAGE_TINY_TEXT_ENCODER: dict[str, Any] = {
    "model_type": "qwen2_5_vl",
    "text_config": {
        **QWEN25_VL_7B["text_config"],
        "vocab_size": 320,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "rope_scaling": {"type": "mrope", "mrope_section": [2, 3, 3]},
        "bos_token_id": 1,
        "eos_token_id": 2,
    },
    "vision_config": {
        **QWEN25_VL_7B["vision_config"],
        "depth": 1,
        "hidden_size": 16,
        "intermediate_size": 32,
        "num_heads": 2,
        "out_hidden_size": 64,
        "fullatt_block_indexes": [0],
    },
    "tie_word_embeddings": False,
}
QWEN_IMAGE_TINY_VAE = {**QWEN_IMAGE_VAE, "base_dim": 8, "dim_mult": [1, 2, 2, 2], "num_res_blocks": 1}

PRESETS: list[ModelSpec] = [
    ModelSpec(
        name="qwen-image",
        family="qwen_image",
        description="Qwen-Image, 20B MMDiT (60 dual-stream blocks), true CFG; Qwen2.5-VL-7B text encoder",
        transformer=_QWEN_IMAGE,
        text_encoder=QWEN25_VL_7B,
        vae=QWEN_IMAGE_VAE,
        scheduler=QWEN_IMAGE_SCHEDULER,
        guidance_mode="cfg",
        steps=50,
        guidance=4.0,
        height=1024,
        width=1024,
        hub_id="Qwen/Qwen-Image",
    ),
    *(
        ModelSpec(
            name=name,
            family="qwen_image",
            description=description,
            transformer=transformer,
            text_encoder=QWEN25_VL_7B,
            vae=QWEN_IMAGE_VAE,
            scheduler=QWEN_IMAGE_SCHEDULER,
            guidance_mode="cfg",
            steps=50,
            guidance=4.0,
            height=1024,
            width=1024,
            hub_id=hub_id,
            details=inputs,
        )
        for name, hub_id, transformer, inputs, description in (
            (
                "qwen-image-edit-2511",
                "Qwen/Qwen-Image-Edit-2511",
                {**_QWEN_IMAGE, "zero_cond_t": True},
                EDIT_PLUS,
                "Qwen-Image-Edit-2511, the 20B MMDiT editing from one or more images (their tokens modulated as at "
                "timestep 0); Qwen2.5-VL-7B reads them with the prompt",
            ),
            (
                "qwen-image-edit-2509",
                "Qwen/Qwen-Image-Edit-2509",
                _QWEN_IMAGE,
                EDIT_PLUS,
                "Qwen-Image-Edit-2509, the 20B MMDiT editing from one or more images; Qwen2.5-VL-7B reads them",
            ),
            (
                "qwen-image-edit",
                "Qwen/Qwen-Image-Edit",
                _QWEN_IMAGE,
                EDIT,
                "Qwen-Image-Edit, the 20B MMDiT editing one image; Qwen2.5-VL-7B reads it with the prompt",
            ),
        )
    ),
    ModelSpec(
        name="qwen-image-tiny",
        family="qwen_image",
        description="a few-million-parameter Qwen-Image, random weights, for demos and tests",
        transformer=QWEN_IMAGE_TINY_TRANSFORMER,
        text_encoder=QWEN_IMAGE_TINY_TEXT_ENCODER,
        vae=QWEN_IMAGE_TINY_VAE,
        scheduler=QWEN_IMAGE_SCHEDULER,
        guidance_mode="cfg",
        steps=8,
        guidance=4.0,
        height=128,
        width=128,
    ),
]
