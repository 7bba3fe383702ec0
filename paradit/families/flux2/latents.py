"""FLUX.2's latent grid in pixels: plain arithmetic, so that requests resolve without the pipeline's imports."""

from __future__ import annotations


def pixel_granularity(vae_config) -> int:
    """Pixels per latent token side: the VAE's stride, doubled by the 2x2 patchify after it."""
    return 2 ** len(vae_config["block_out_channels"])


def reference_size(image, granularity: int) -> tuple[int, int]:
    return image.height // granularity * granularity, image.width // granularity * granularity
