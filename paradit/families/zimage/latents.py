"""Z-Image's latent grid in pixels: plain arithmetic, so that requests resolve without the pipeline's imports."""

from __future__ import annotations


def pixel_granularity(vae_config: dict) -> int:
    """Pixels per latent token side: the VAE's stride (one per down block after the first), times the 2x2 patch."""
    return 2 ** (len(vae_config["block_out_channels"]) - 1) * 2
