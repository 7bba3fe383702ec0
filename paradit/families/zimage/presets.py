"""Z-Image presets: the full-size Turbo (step-distilled) and base transformers (published ``transformer/config.json``),
the Qwen3-4B text encoder read at its second-to-last hidden state, the FLUX.1 VAE and the schedulers as published,
and a tiny model for the demo and tests."""

from __future__ import annotations

import functools
from typing import Any

from paradit.families.encoders import QWEN3_4B
from paradit.spec import ModelSpec, TextEncoderSpec

# Both checkpoints use a fixed timestep shift (no dynamic shifting): 3.0 for Turbo, 6.0 for the base model.
TURBO_SCHEDULER = {"num_train_timesteps": 1000, "use_dynamic_shifting": False, "shift": 3.0}
BASE_SCHEDULER = {"num_train_timesteps": 1000, "use_dynamic_shifting": False, "shift": 6.0}

# The FLUX.1 VAE (AutoencoderKL, 16 latent channels, stride 8) with its latent scaling and shift.
FLUX1_VAE: dict[str, Any] = {
    "in_channels": 3,
    "out_channels": 3,
    "latent_channels": 16,
    "block_out_channels": [128, 256, 512, 512],
    "down_block_types": ["DownEncoderBlock2D"] * 4,
    "up_block_types": ["UpDecoderBlock2D"] * 4,
    "layers_per_block": 2,
    "norm_num_groups": 32,
    "act_fn": "silu",
    "sample_size": 1024,
    "scaling_factor": 0.3611,
    "shift_factor": 0.1159,
    "use_quant_conv": False,
    "use_post_quant_conv": False,
    "force_upcast": True,
    "mid_block_add_attention": True,
}

# Tongyi-MAI/Z-Image-Turbo's transformer/config.json (shared/models/configs.json); the base model shares it.
_ZIMAGE_TRANSFORMER = {
    "all_patch_size": [2],
    "all_f_patch_size": [1],
    "in_channels": 16,
    "dim": 3840,
    "n_layers": 30,
    "n_refiner_layers": 2,
    "n_heads": 30,
    "n_kv_heads": 30,
    "norm_eps": 1e-5,
    "qk_norm": True,
    "cap_feat_dim": 2560,
    "siglip_feat_dim": None,
    "rope_theta": 256.0,
    "t_scale": 1000.0,
    "axes_dims": [32, 48, 48],
    "axes_lens": [1536, 512, 512],
}

ZIMAGE_TINY_TEXT_ENCODER = {
    **QWEN3_4B,
    "vocab_size": 320,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 4,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "head_dim": 16,
}
ZIMAGE_TINY_TRANSFORMER = {
    **_ZIMAGE_TRANSFORMER,
    "dim": 96,
    "n_layers": 2,
    "n_heads": 6,
    "n_kv_heads": 6,
    "cap_feat_dim": 32,
    "axes_dims": [4, 6, 6],
}
ZIMAGE_TINY_VAE = {**FLUX1_VAE, "block_out_channels": [16, 16, 16, 16], "layers_per_block": 1, "norm_num_groups": 4}


def text_encoder_spec(config: dict[str, Any], class_name: str | None = None) -> TextEncoderSpec:
    """The pipeline reads ``hidden_states[-2]``: the output of the second-to-last decoder layer, so the last layer is
    never run. Captions are at most 512 tokens (the reference's max_sequence_length)."""
    return TextEncoderSpec(config, layers=(config["num_hidden_layers"] - 1,), max_length=512, class_name=class_name)


QWEN3_4B_CAPTIONS = text_encoder_spec(QWEN3_4B)
preset = functools.partial(ModelSpec, family="zimage", vae=FLUX1_VAE, guidance_mode="cfg", height=1024, width=1024)
PRESETS: list[ModelSpec] = [
    preset(
        name="z-image-turbo",
        description="Z-Image-Turbo, 6.2B, step-distilled (8 steps, guidance 0: off); Qwen3-4B text encoder",
        transformer=_ZIMAGE_TRANSFORMER,
        text_encoder=QWEN3_4B_CAPTIONS,
        scheduler=TURBO_SCHEDULER,
        steps=8,
        guidance=0.0,
        hub_id="Tongyi-MAI/Z-Image-Turbo",
    ),
    preset(
        name="z-image",
        description="Z-Image, 6.2B, the non-distilled base model (true CFG, negative prompts); Qwen3-4B text encoder",
        transformer=_ZIMAGE_TRANSFORMER,
        text_encoder=QWEN3_4B_CAPTIONS,
        scheduler=BASE_SCHEDULER,
        steps=50,
        guidance=5.0,
        hub_id="Tongyi-MAI/Z-Image",
    ),
    preset(
        name="z-image-tiny",
        description="a few-million-parameter Z-Image (base layout, true CFG), random weights, for demos and tests",
        transformer=ZIMAGE_TINY_TRANSFORMER,
        text_encoder=text_encoder_spec(ZIMAGE_TINY_TEXT_ENCODER),
        vae=ZIMAGE_TINY_VAE,
        scheduler=BASE_SCHEDULER,
        steps=8,
        guidance=5.0,
        height=128,
        width=128,
    ),
]
