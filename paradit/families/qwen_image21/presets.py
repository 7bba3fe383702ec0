"""Qwen-Image 2.1 presets: the base and Turbo models as published (their sources in ``configs.json``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from paradit.spec import ModelSpec, read_configs

CONFIGS = read_configs(__file__)
DEFAULTS = CONFIGS["presets"]
QWEN_IMAGE21_TRANSFORMER = CONFIGS["transformer"]
QWEN_IMAGE21_SCHEDULER = CONFIGS["scheduler"]
QWEN_IMAGE21_VAE = CONFIGS["vae"]
QWEN3_VL_8B = CONFIGS["qwen3_vl_8b"]


@dataclass(frozen=True)
class QwenImage21Inputs:
    """A checkpoint's ``ModelSpec.details``: diffusers' ``output_resolution`` (condition images are resized to about
    its square's area, and with images the output too) and the pipeline's ``sample_sigmas`` (Turbo's schedule)."""

    output_resolution: int = 1024
    sample_sigmas: tuple[float, ...] | None = None


def preset(name: str, **configs: Any) -> ModelSpec:
    full_size = {
        "transformer": QWEN_IMAGE21_TRANSFORMER,
        "text_encoder": QWEN3_VL_8B,
        "vae": QWEN_IMAGE21_VAE,
        "scheduler": QWEN_IMAGE21_SCHEDULER,
        "details": QwenImage21Inputs(),
    }
    return ModelSpec(name=name, family="qwen_image21", **{**full_size, **configs}, **DEFAULTS[name])


PRESETS: list[ModelSpec] = [
    preset("qwen-image-2.1"),
    preset(
        "qwen-image-2.1-turbo",
        scheduler=CONFIGS["turbo_scheduler"],
        details=QwenImage21Inputs(sample_sigmas=tuple(CONFIGS["turbo_sample_sigmas"])),
    ),
]
