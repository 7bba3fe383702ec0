"""FLUX.2 presets: full-size dev and klein configs (published ``transformer/config.json``), the text encoders'
decoder configs (for ``--load-format dummy``), a tiny model for demo and tests."""

from __future__ import annotations

import functools
from typing import Any

from paradit.families.encoders import MISTRAL_SMALL_31, QWEN3_4B, QWEN3_8B, QWEN3_COMMON
from paradit.spec import ModelSpec, TextEncoderSpec

# The scheduler config FLUX.2 ships: dynamic shifting, with mu computed by the pipeline from the image size.
FLUX2_SCHEDULER = {
    "num_train_timesteps": 1000,
    "shift": 3.0,
    "use_dynamic_shifting": True,
    "base_shift": 0.5,
    "max_shift": 1.15,
    "base_image_seq_len": 256,
    "max_image_seq_len": 4096,
    "time_shift_type": "exponential",
}

# The published VAE is AutoencoderKLFlux2's default; the stride is stated because requests are checked against it.
FLUX2_VAE: dict[str, Any] = {"block_out_channels": [128, 256, 512, 512]}

_FLUX2_DEV = {
    "patch_size": 1,
    "in_channels": 128,
    "out_channels": None,
    "num_layers": 8,
    "num_single_layers": 48,
    "attention_head_dim": 128,
    "num_attention_heads": 48,
    "joint_attention_dim": 15360,
    "timestep_guidance_channels": 256,
    "mlp_ratio": 3.0,
    "axes_dims_rope": [32, 32, 32, 32],
    "rope_theta": 2000,
    "eps": 1e-6,
    "guidance_embeds": True,
}

FLUX2_TINY_TRANSFORMER = {
    **_FLUX2_DEV,
    "num_layers": 2,
    "num_single_layers": 2,
    "attention_head_dim": 16,
    "num_attention_heads": 4,
    "joint_attention_dim": 96,
    "axes_dims_rope": [4, 4, 4, 4],
    "timestep_guidance_channels": 32,
    "guidance_embeds": False,
}
FLUX2_TINY_TEXT_ENCODER = {
    **QWEN3_COMMON,
    "vocab_size": 320,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 27,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "head_dim": 16,
}
FLUX2_TINY_VAE = {"block_out_channels": [16, 16, 16, 16], "norm_num_groups": 4, "layers_per_block": 1}

# The published checkpoints' sizes; klein's step-distilled checkpoints run unguided.
preset = functools.partial(ModelSpec, family="flux2", vae=FLUX2_VAE, scheduler=FLUX2_SCHEDULER, height=1024, width=1024)
distilled = functools.partial(preset, guidance_mode="none", steps=4, guidance=None)
PRESETS: list[ModelSpec] = [
    preset(
        name="flux2-dev",
        description="FLUX.2 [dev], 32B, guidance-distilled; Mistral Small 3.1 24B text encoder",
        transformer=_FLUX2_DEV,
        text_encoder=TextEncoderSpec(MISTRAL_SMALL_31, layers=(10, 20, 30)),
        guidance_mode="embedded",
        steps=50,
        guidance=4.0,
        hub_id="black-forest-labs/FLUX.2-dev",
    ),
    distilled(
        name="flux2-klein-4b",
        description="FLUX.2 [klein] 4B, step-distilled (4 steps, no guidance); Qwen3-4B text encoder",
        transformer={
            **_FLUX2_DEV,
            "num_layers": 5,
            "num_single_layers": 20,
            "num_attention_heads": 24,
            "joint_attention_dim": 7680,
            "guidance_embeds": False,
        },
        text_encoder=TextEncoderSpec(QWEN3_4B, layers=(9, 18, 27)),
        hub_id="black-forest-labs/FLUX.2-klein-4B",
    ),
    distilled(
        name="flux2-klein-9b",
        description="FLUX.2 [klein] 9B, step-distilled (4 steps, no guidance); Qwen3-8B text encoder",
        transformer={
            **_FLUX2_DEV,
            "num_layers": 8,
            "num_single_layers": 24,
            "num_attention_heads": 32,
            "joint_attention_dim": 12288,
            "guidance_embeds": False,
        },
        text_encoder=TextEncoderSpec(QWEN3_8B, layers=(9, 18, 27)),
        hub_id="black-forest-labs/FLUX.2-klein-9B",
    ),
    preset(
        name="flux2-tiny",
        description="a few-million-parameter FLUX.2 (klein layout, true CFG), random weights, for demos and tests",
        transformer=FLUX2_TINY_TRANSFORMER,
        text_encoder=TextEncoderSpec(FLUX2_TINY_TEXT_ENCODER, layers=(9, 18, 27)),
        vae=FLUX2_TINY_VAE,
        guidance_mode="cfg",
        steps=8,
        guidance=4.0,
        height=128,
        width=128,
    ),
]
