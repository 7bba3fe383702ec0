"""Qwen-Image's latent grid in pixels: plain arithmetic, so that requests resolve without the pipeline's imports."""

from __future__ import annotations


def pixel_granularity(vae_config: dict) -> int:
    """Pixels per latent token side: the VAE's spatial stride, doubled by the 2x2 packing."""
    return 2 ** len(vae_config.get("temperal_downsample", [False, True, True])) * 2
