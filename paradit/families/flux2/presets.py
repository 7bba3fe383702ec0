"""FLUX.2 presets: dev and klein as published, and a tiny model for the demo and tests."""

from __future__ import annotations

from dataclasses import dataclass

from paradit.families.encoders import MISTRAL_SMALL_31, QWEN3_4B, QWEN3_8B, QWEN3_COMMON
from paradit.spec import ModelSpec, TextEncoderSpec, read_configs

CONFIGS = read_configs(__file__)
DEFAULTS = CONFIGS["presets"]
FLUX2_SCHEDULER = CONFIGS["scheduler"]
# The published VAE is AutoencoderKLFlux2's default; the stride is stated because requests are checked against it.
FLUX2_VAE = CONFIGS["vae"]
_FLUX2_DEV = CONFIGS["dev_transformer"]

FLUX2_TINY_TRANSFORMER = {**_FLUX2_DEV, **CONFIGS["tiny_transformer_changes"]}
# The prompt encoder's hidden layers the transformer reads: dev's Mistral's, klein's Qwen3's.
DEV_LAYERS, KLEIN_LAYERS = (10, 20, 30), (9, 18, 27)


@dataclass(frozen=True)
class Flux2Details:
    """A checkpoint's ``ModelSpec.details`` (None for presets): ``cached_references`` for ``Flux2KleinKVPipeline``'s."""

    cached_references: bool = False


def caches_references(spec: ModelSpec) -> bool:
    return spec.details is not None and spec.details.cached_references


def preset(name: str, transformer: dict, encoder: dict, layers=KLEIN_LAYERS, vae: dict = FLUX2_VAE) -> ModelSpec:
    return ModelSpec(
        name=name,
        family="flux2",
        transformer=transformer,
        text_encoder=TextEncoderSpec(encoder, layers=layers),
        vae=vae,
        scheduler=FLUX2_SCHEDULER,
        **DEFAULTS[name],
    )


PRESETS: list[ModelSpec] = [
    preset("flux2-dev", _FLUX2_DEV, MISTRAL_SMALL_31, layers=DEV_LAYERS),
    preset("flux2-klein-4b", {**_FLUX2_DEV, **CONFIGS["klein_4b_transformer_changes"]}, QWEN3_4B),
    preset("flux2-klein-9b", {**_FLUX2_DEV, **CONFIGS["klein_9b_transformer_changes"]}, QWEN3_8B),
    preset(
        "flux2-tiny",
        FLUX2_TINY_TRANSFORMER,
        {**QWEN3_COMMON, **CONFIGS["tiny_text_encoder_changes"]},
        vae=CONFIGS["tiny_vae"],
    ),
]
