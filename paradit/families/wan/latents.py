"""Wan's latent video in pixels and frames: plain arithmetic, so that requests resolve without the pipeline's
imports."""

from __future__ import annotations

from paradit.spec import ModelSpec


def vae_factors(vae_config: dict) -> tuple[int, int]:
    """(temporal, spatial) compression of the VAE, with diffusers' defaults (the 2.1 VAE's 4 and 8)."""
    return vae_config.get("scale_factor_temporal") or 4, vae_config.get("scale_factor_spatial") or 8


def image_input(spec: ModelSpec) -> str | None:
    """How the model takes an image: ``"first_frame"`` (TI2V-5B, optional: its latent replaces the first latent frame),
    ``"channels"`` (I2V-A14B, required: a first-frame mask and its latents as extra input channels), or None."""
    if spec.details.expand_timesteps:
        return "first_frame"
    if spec.transformer["in_channels"] > spec.vae.get("z_dim", 16):
        return "channels"
    return None
