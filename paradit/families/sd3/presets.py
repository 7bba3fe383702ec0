"""Stable Diffusion 3.5 presets: full-size large and medium transformer configs (published ``transformer/config.json``),
the three text encoders' configs (for ``--load-format dummy``), the VAE and scheduler as published, the model cards'
defaults, and a tiny model for the demo and tests."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

from paradit.spec import ModelSpec


@dataclass(frozen=True)
class SD3TextEncoders:
    """The prompt encoders of SD3: two CLIP text towers with projection (``CLIPTextModelWithProjection`` configs) and a
    T5 encoder (``T5EncoderModel`` config); T5 reads ``max_sequence_length`` tokens, CLIP its tokenizer's length."""

    clip_l: dict[str, Any]
    clip_g: dict[str, Any]
    t5: dict[str, Any]
    max_sequence_length: int = 256


# The published configs keep CLIP's legacy token ids (eos 2: pooling takes the highest token id, which is the eos).
CLIP_L = {
    "vocab_size": 49408,
    "hidden_size": 768,
    "intermediate_size": 3072,
    "num_hidden_layers": 12,
    "num_attention_heads": 12,
    "projection_dim": 768,
    "hidden_act": "quick_gelu",
    "max_position_embeddings": 77,
    "layer_norm_eps": 1e-5,
    "bos_token_id": 0,
    "eos_token_id": 2,
    "pad_token_id": 1,
}
OPENCLIP_BIGG = {
    **CLIP_L,
    "hidden_size": 1280,
    "intermediate_size": 5120,
    "num_hidden_layers": 32,
    "num_attention_heads": 20,
    "projection_dim": 1280,
    "hidden_act": "gelu",
}
T5_V1_1_XXL = {
    "vocab_size": 32128,
    "d_model": 4096,
    "d_ff": 10240,
    "d_kv": 64,
    "num_heads": 64,
    "num_layers": 24,
    "feed_forward_proj": "gated-gelu",
    "relative_attention_num_buckets": 32,
    "relative_attention_max_distance": 128,
    "layer_norm_epsilon": 1e-6,
    "tie_word_embeddings": False,
}
SD3_TEXT_ENCODERS = SD3TextEncoders(clip_l=CLIP_L, clip_g=OPENCLIP_BIGG, t5=T5_V1_1_XXL)

SD3_VAE: dict[str, Any] = {
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
    "scaling_factor": 1.5305,
    "shift_factor": 0.0609,
    "use_quant_conv": False,
    "use_post_quant_conv": False,
    "mid_block_add_attention": True,
    "force_upcast": True,
}
SD3_SCHEDULER = {"num_train_timesteps": 1000, "shift": 3.0}

SD35_LARGE = {
    "sample_size": 128,
    "patch_size": 2,
    "in_channels": 16,
    "num_layers": 38,
    "attention_head_dim": 64,
    "num_attention_heads": 38,
    "joint_attention_dim": 4096,
    "caption_projection_dim": 2432,
    "pooled_projection_dim": 2048,
    "out_channels": 16,
    "pos_embed_max_size": 192,
    "dual_attention_layers": [],
    "qk_norm": "rms_norm",
}
SD35_MEDIUM = {
    **SD35_LARGE,
    "num_layers": 24,
    "num_attention_heads": 24,
    "caption_projection_dim": 1536,
    "pos_embed_max_size": 384,
    "dual_attention_layers": list(range(13)),
}

SD35_TINY_TRANSFORMER = {
    **SD35_MEDIUM,
    "sample_size": 16,
    "num_layers": 3,
    "attention_head_dim": 16,
    "num_attention_heads": 4,
    "joint_attention_dim": 64,
    "caption_projection_dim": 64,
    "pooled_projection_dim": 64,
    "pos_embed_max_size": 32,
    "dual_attention_layers": [0],
}
_TINY_CLIP = {
    "vocab_size": 514,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 3,
    "num_attention_heads": 2,
    "projection_dim": 32,
    "hidden_act": "quick_gelu",
    "max_position_embeddings": 77,
    "bos_token_id": 512,
    "eos_token_id": 513,
    "pad_token_id": 513,
}
SD35_TINY_TEXT_ENCODERS = SD3TextEncoders(
    clip_l=_TINY_CLIP,
    clip_g={**_TINY_CLIP, "hidden_size": 24, "hidden_act": "gelu"},
    t5={
        "vocab_size": 200,
        "d_model": 64,
        "d_ff": 64,
        "d_kv": 16,
        "num_heads": 4,
        "num_layers": 2,
        "feed_forward_proj": "gated-gelu",
        "relative_attention_num_buckets": 8,
        "relative_attention_max_distance": 32,
    },
)
SD35_TINY_VAE = {
    **SD3_VAE,
    "block_out_channels": [16, 16, 16, 16],
    "norm_num_groups": 4,
    "layers_per_block": 1,
    "sample_size": 128,
}

preset = functools.partial(
    ModelSpec,
    family="sd3",
    text_encoder=SD3_TEXT_ENCODERS,
    vae=SD3_VAE,
    scheduler=SD3_SCHEDULER,
    guidance_mode="cfg",
    height=1024,
    width=1024,
)
PRESETS: list[ModelSpec] = [
    preset(
        name="sd3.5-large",
        description="Stable Diffusion 3.5 Large, 8.1B MMDiT; CLIP-L + OpenCLIP bigG + T5-XXL encoders, true CFG",
        transformer=SD35_LARGE,
        steps=28,
        guidance=3.5,
        hub_id="stabilityai/stable-diffusion-3.5-large",
    ),
    preset(
        name="sd3.5-medium",
        description="Stable Diffusion 3.5 Medium, 2.2B MMDiT-X (dual attention in blocks 0-12), same encoders, CFG",
        transformer=SD35_MEDIUM,
        steps=40,
        guidance=4.5,
        hub_id="stabilityai/stable-diffusion-3.5-medium",
    ),
    preset(
        name="sd3.5-tiny",
        description="a few-million-parameter SD3.5 (medium layout), random weights, for demos and tests",
        transformer=SD35_TINY_TRANSFORMER,
        text_encoder=SD35_TINY_TEXT_ENCODERS,
        vae=SD35_TINY_VAE,
        steps=8,
        guidance=4.5,
        height=128,
        width=128,
    ),
]
