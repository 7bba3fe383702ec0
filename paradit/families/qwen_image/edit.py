"""How Qwen-Image-Edit checkpoints take their input images: light (no torch), as the presets name it."""

from __future__ import annotations

import math
from dataclasses import dataclass


def area_dimensions(area: int, image) -> tuple[int, int]:
    """(height, width) of about ``area`` pixels at ``image``'s aspect, rounded to 32 (``calculate_dimensions``)."""
    ratio = image.width / image.height
    width = math.sqrt(area * ratio)
    return round(width / ratio / 32) * 32, round(width / 32) * 32


@dataclass(frozen=True)
class EditInputs:
    """A Qwen-Image-Edit checkpoint's ``ModelSpec.details``: the pixel areas diffusers resizes its input images to."""

    plus: bool  # Edit-Plus (2509, 2511): several images, each numbered in the prompt ("Picture N: ")
    input_area: int = 1024 * 1024
    condition_area: int | None = None  # None: input_area

    def input_size(self, image) -> tuple[int, int]:
        return area_dimensions(self.input_area, image)

    def condition_size(self, image) -> tuple[int, int]:
        return area_dimensions(self.condition_area or self.input_area, image)


EDIT, EDIT_PLUS = EditInputs(plus=False), EditInputs(plus=True, condition_area=384 * 384)
EDIT_PIPELINES = {"QwenImageEditPipeline": EDIT, "QwenImageEditPlusPipeline": EDIT_PLUS}
