"""FLUX.2 presets: dev and klein as published, and a tiny model for the demo and tests."""

from __future__ import annotations

import functools

from paradit.families.encoders import MISTRAL_SMALL_31, QWEN3_4B, QWEN3_8B, QWEN3_COMMON
from paradit.spec import ModelSpec, TextEncoderSpec, read_configs

CONFIGS = read_configs(__file__)
# The scheduler config FLUX.2 ships: dynamic shifting, with mu computed by the pipeline from the image size.
FLUX2_SCHEDULER = CONFIGS["scheduler"]
# The published VAE is AutoencoderKLFlux2's default; the stride is stated because requests are checked against it.
FLUX2_VAE = CONFIGS["vae"]
_FLUX2_DEV = CONFIGS["dev_transformer"]

FLUX2_TINY_TRANSFORMER = {**_FLUX2_DEV, **CONFIGS["tiny_transformer_changes"]}

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
        transformer={**_FLUX2_DEV, **CONFIGS["klein_4b_transformer_changes"]},
        text_encoder=TextEncoderSpec(QWEN3_4B, layers=(9, 18, 27)),
        hub_id="black-forest-labs/FLUX.2-klein-4B",
    ),
    distilled(
        name="flux2-klein-9b",
        description="FLUX.2 [klein] 9B, step-distilled (4 steps, no guidance); Qwen3-8B text encoder",
        transformer={**_FLUX2_DEV, **CONFIGS["klein_9b_transformer_changes"]},
        text_encoder=TextEncoderSpec(QWEN3_8B, layers=(9, 18, 27)),
        hub_id="black-forest-labs/FLUX.2-klein-9B",
    ),
    preset(
        name="flux2-tiny",
        description="a few-million-parameter FLUX.2 (klein layout, true CFG), random weights, for demos and tests",
        transformer=FLUX2_TINY_TRANSFORMER,
        text_encoder=TextEncoderSpec({**QWEN3_COMMON, **CONFIGS["tiny_text_encoder_changes"]}, layers=(9, 18, 27)),
        vae=CONFIGS["tiny_vae"],
        guidance_mode="cfg",
        steps=8,
        guidance=4.0,
        height=128,
        width=128,
    ),
]
