"""Qwen-Image 2.1's latent grid in pixels: plain arithmetic, so that requests resolve without the pipeline's
imports."""

from __future__ import annotations

import math

# One latent token is a 16x16 pixel tile (the VAE's stride, no patching); sides are multiples of 32, as diffusers
# floors them, so that each of the encoder's merged 32-pixel image slots covers 2x2 tokens.
TOKEN_PIXELS = 16
SIDE_MULTIPLE = 32


def area_size(resolution: int, image) -> tuple[int, int]:
    """(height, width) of about ``resolution`` squared pixels at ``image``'s aspect, each rounded to 32."""
    ratio = image.width / image.height
    width = math.sqrt(resolution * resolution * ratio)
    return round(width / ratio / SIDE_MULTIPLE) * SIDE_MULTIPLE, round(width / SIDE_MULTIPLE) * SIDE_MULTIPLE
