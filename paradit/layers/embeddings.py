"""Timestep and condition embeddings: sinusoidal features, MLPs lifting them to model width, the conditioning vector."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import nn


def sinusoidal_embedding(timesteps: torch.Tensor, dim: int, scale: float = 1.0) -> torch.Tensor:
    """(N, dim) float32 sin/cos features, diffusers' layout. ``scale`` multiplies the angles, where Qwen-Image's
    reference applies its 1000: scaling timesteps first rounds the fastest angles differently (up to 6e-5 rad)."""
    half = dim // 2
    exponent = -math.log(10000.0) * torch.arange(half, dtype=torch.float32, device=timesteps.device)
    freqs = torch.exp(exponent / half)
    angles = scale * (timesteps[:, None].float() * freqs[None, :])
    emb = torch.cat([torch.cos(angles), torch.sin(angles)], dim=-1)
    if dim % 2 == 1:
        emb = nn.functional.pad(emb, (0, 1))
    return emb


class EmbeddingMLP(nn.Module):
    """diffusers' ``TimestepEmbedding``."""

    def __init__(
        self,
        in_channels: int,
        dim: int,
        bias: bool = True,
        activation: Callable[[torch.Tensor], torch.Tensor] = nn.functional.silu,
    ) -> None:
        super().__init__()
        self.linear_1 = nn.Linear(in_channels, dim, bias=bias)
        self.linear_2 = nn.Linear(dim, dim, bias=bias)
        self.activation = activation

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_2(self.activation(self.linear_1(x)))


class TimestepEmbed(nn.Module):
    """The joint models' conditioning vector: the timestep's embedding, plus the guidance's and pooled text's."""

    def __init__(
        self, dim: int, channels: int = 256, bias: bool = True, guidance: bool = False, pooled_dim: int | None = None
    ) -> None:
        super().__init__()
        self.channels = channels
        self.timestep_embedder = EmbeddingMLP(channels, dim, bias=bias)
        self.guidance_embedder = EmbeddingMLP(channels, dim, bias=bias) if guidance else None
        self.text_embedder = None if pooled_dim is None else EmbeddingMLP(pooled_dim, dim, bias=bias)

    def forward(
        self,
        timestep: torch.Tensor,
        dtype: torch.dtype,
        guidance: torch.Tensor | None = None,
        pooled: torch.Tensor | None = None,
        scale: float = 1.0,
    ) -> torch.Tensor:
        emb = self.timestep_embedder(sinusoidal_embedding(timestep, self.channels, scale=scale).to(dtype))
        if guidance is not None and self.guidance_embedder is not None:
            emb = emb + self.guidance_embedder(sinusoidal_embedding(guidance, self.channels).to(dtype))
        if self.text_embedder is not None:
            emb = emb + self.text_embedder(pooled)
        return emb
