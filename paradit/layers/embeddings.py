"""Timestep embeddings: the sinusoidal projection and the two-layer MLP that lifts it to the model width.

Must not import torch.distributed.
"""

from __future__ import annotations

import math

import torch
from torch import nn


def sinusoidal_embedding(
    timesteps: torch.Tensor,
    dim: int,
    flip_sin_to_cos: bool = True,
    downscale_freq_shift: float = 0.0,
    max_period: float = 10000.0,
) -> torch.Tensor:
    """(N,) timesteps -> (N, dim) sin/cos features, in float32 (the layout diffusers' checkpoints were trained with)."""
    half = dim // 2
    exponent = -math.log(max_period) * torch.arange(half, dtype=torch.float32, device=timesteps.device)
    freqs = torch.exp(exponent / (half - downscale_freq_shift))
    angles = timesteps[:, None].float() * freqs[None, :]
    emb = torch.cat(
        [torch.cos(angles), torch.sin(angles)] if flip_sin_to_cos else [torch.sin(angles), torch.cos(angles)], dim=-1
    )
    if dim % 2 == 1:
        emb = nn.functional.pad(emb, (0, 1))
    return emb


class TimestepMLP(nn.Module):
    """linear_1 -> SiLU -> linear_2, named as diffusers' ``TimestepEmbedding`` so checkpoints load as they are."""

    def __init__(self, in_channels: int, dim: int, bias: bool = True) -> None:
        super().__init__()
        self.linear_1 = nn.Linear(in_channels, dim, bias=bias)
        self.linear_2 = nn.Linear(dim, dim, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_2(nn.functional.silu(self.linear_1(x)))
