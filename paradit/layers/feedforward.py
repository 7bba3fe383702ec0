"""The GELU MLP of diffusers' ``FeedForward``, laid out as checkpoints name it."""

from __future__ import annotations

import torch
from torch import nn


class GeluProjection(nn.Module):
    """diffusers' ``GELU`` activation module, which owns the projection."""

    def __init__(self, dim: int, hidden: int, approximate: str = "tanh") -> None:
        super().__init__()
        self.proj = nn.Linear(dim, hidden)
        self.approximate = approximate

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.gelu(self.proj(x), approximate=self.approximate)


class GeluFeedForward(nn.Module):
    """``net`` keeps the checkpoint's indices; 1 is where training had its dropout."""

    def __init__(self, dim: int, hidden: int, out: int, approximate: str = "tanh") -> None:
        super().__init__()
        self.net = nn.ModuleList([GeluProjection(dim, hidden, approximate), nn.Identity(), nn.Linear(hidden, out)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net[2](self.net[0](x))
