"""SD3's latent grid in pixels: plain arithmetic, so that requests resolve without the pipeline's imports."""

from __future__ import annotations

from paradit.spec import ModelSpec


def vae_scale_factor(vae_config: dict) -> int:
    return 2 ** (len(vae_config["block_out_channels"]) - 1)


def pixel_granularity(spec: ModelSpec) -> int:
    return vae_scale_factor(spec.vae) * spec.transformer["patch_size"]
