"""Normalisations with timestep-conditioned affine parameters.

Must not import torch.distributed.
"""

from __future__ import annotations

import torch
from torch import nn


class AdaLayerNormOut(nn.Module):
    """Final LayerNorm whose scale and shift come from the conditioning vector (diffusers' AdaLayerNormContinuous).

    The projection emits (scale, shift) in that order, as the published checkpoints do.
    """

    def __init__(self, dim: int, cond_dim: int, eps: float = 1e-6, bias: bool = True) -> None:
        super().__init__()
        self.linear = nn.Linear(cond_dim, dim * 2, bias=bias)
        self.norm = nn.LayerNorm(dim, eps=eps, elementwise_affine=False)

    def forward(self, x: torch.Tensor, cond: torch.Tensor) -> torch.Tensor:
        scale, shift = self.linear(nn.functional.silu(cond).to(x.dtype)).chunk(2, dim=-1)
        return self.norm(x) * (1 + scale)[:, None, :] + shift[:, None, :]
