"""Rotary position embeddings over several position axes (FLUX-style: interleaved pairs, a band per axis)."""

from __future__ import annotations

import torch


def multi_axis_rope(
    ids: torch.Tensor, axes_dim: list[int] | tuple[int, ...], theta: float, dtype: torch.dtype | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables (seq, sum(axes_dim)) for integer positions ``ids`` (seq, n_axes). Angles are formed in
    ``dtype``, by default float64 (exact for large positions) where the device has it: MPS has not."""
    pos = ids.float()
    dtype = dtype or (torch.float32 if ids.device.type == "mps" else torch.float64)
    bands = []
    for axis, dim in enumerate(axes_dim):
        inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=dtype, device=ids.device) / dim))
        bands.append(torch.outer(pos[:, axis].to(dtype), inv_freq))
    angles = torch.cat(bands, dim=-1).repeat_interleave(2, dim=1)
    return angles.cos().float(), angles.sin().float()


def apply_rope_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Channels (2i, 2i+1) form one complex pair."""
    cos = cos[None, :, None, :]
    sin = sin[None, :, None, :]
    real, imag = x.unflatten(-1, (-1, 2)).unbind(-1)
    rotated = torch.stack([-imag, real], dim=-1).flatten(-2)
    return (x.float() * cos + rotated.float() * sin).to(x.dtype)


def rotate_qk(
    q: torch.Tensor, k: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]
) -> tuple[torch.Tensor, torch.Tensor]:
    return apply_rope_interleaved(q, *rope), apply_rope_interleaved(k, *rope)
