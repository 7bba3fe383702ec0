"""FLUX.3 [klein] presets: the base model and the step-distilled flow map, and their sources.

- Transformer: diffusers 0.42.1's ``Flux3Transformer2DModel`` defaults (no published ``transformer/config.json`` was
  found); its ``joint_attention_dim`` of 20480 is the 8 stacked layers of Qwen3-VL-4B's 2560, as it must be.
- Hub ids: the ones diffusers' single-file loader maps FLUX.3 checkpoints to (``single_file_utils``).
- Steps and guidance: diffusers' modular blocks, 50 steps with ``ClassifierFreeGuidance`` at 3.5 for the base
  (``Flux3LoopDenoiser``; issue 52 says CFG 4, for which no source was found), 16 steps and no guider for the flow map.
- Scheduler: the one diffusers' modular pipeline creates (a constant shift of 6.93, no folder in the checkpoint).
- VAE: FLUX.2's ``AutoencoderKLFlux2``.
- Text encoder: Qwen3-VL-4B-Instruct's ``config.json`` as a copy of it publishes it
  (huggingface.co/amburger66/robometer-4b-lora-robotsmith-task03, from unsloth/Qwen3-VL-4B-Instruct)."""

from __future__ import annotations

from typing import Any

from paradit.spec import ModelSpec, TextEncoderSpec, read_configs

CONFIGS = read_configs(__file__)
DEFAULTS = CONFIGS["presets"]
FLUX3_SCHEDULER = CONFIGS["scheduler"]
FLUX3_VAE = CONFIGS["vae"]
FLUX3_TRANSFORMER = CONFIGS["transformer"]
QWEN3_VL_4B = CONFIGS["qwen3_vl_4b"]
# The prompt encoder's hidden states the transformer reads, stacked per token (diffusers' text_encoder_out_layers).
TEXT_LAYERS = (4, 8, 12, 16, 20, 24, 28, 32)
# The longest prompt diffusers encodes (its max_sequence_length), in tokens.
MAX_PROMPT_TOKENS = 8192


def text_encoder_spec(config: dict[str, Any], class_name: str | None = None) -> TextEncoderSpec:
    return TextEncoderSpec(config, layers=TEXT_LAYERS, max_length=MAX_PROMPT_TOKENS, class_name=class_name)


def preset(name: str, flow_map: bool) -> ModelSpec:
    return ModelSpec(
        name=name,
        family="flux3",
        transformer={**FLUX3_TRANSFORMER, "flow_map": flow_map},
        text_encoder=text_encoder_spec(QWEN3_VL_4B),
        vae=FLUX3_VAE,
        scheduler=FLUX3_SCHEDULER,
        **DEFAULTS[name],
    )


PRESETS: list[ModelSpec] = [preset("flux3-klein-base", flow_map=False), preset("flux3-klein", flow_map=True)]
