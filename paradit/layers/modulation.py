"""Timestep conditioning (AdaLN): modulation triples, the fp16 residual guard, the adaptive LayerNorm at the output."""

from __future__ import annotations

import torch
from torch import nn


class Modulation(nn.Module):
    """The conditioning vector to ``sets`` (shift, scale, gate) triples, unsplit."""

    def __init__(self, dim: int, sets: int, bias: bool = True) -> None:
        super().__init__()
        self.sets = sets
        self.linear = nn.Linear(dim, dim * 3 * sets, bias=bias)

    def forward(self, temb: torch.Tensor) -> torch.Tensor:
        return self.linear(nn.functional.silu(temb))


def split_modulation(mod: torch.Tensor, sets: int) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """(B, 3*sets*D) -> ``sets`` triples of (shift, scale, gate), each (B, 1, D)."""
    chunks = mod.unsqueeze(1).chunk(3 * sets, dim=-1)
    return [tuple(chunks[3 * i : 3 * i + 3]) for i in range(sets)]


def clip_fp16(x: torch.Tensor) -> torch.Tensor:
    # fp16 overflows in the residual streams of the MMDiT models; clipping is what the references do.
    return x.clip(-65504, 65504) if x.dtype == torch.float16 else x


class AdaLayerNormOut(nn.Module):
    """diffusers' AdaLayerNormContinuous, whose projection emits (scale, shift) in that order."""

    def __init__(self, dim: int, cond_dim: int, eps: float = 1e-6, bias: bool = True) -> None:
        super().__init__()
        self.linear = nn.Linear(cond_dim, dim * 2, bias=bias)
        self.norm = nn.LayerNorm(dim, eps=eps, elementwise_affine=False)

    def forward(self, x: torch.Tensor, cond: torch.Tensor) -> torch.Tensor:
        scale, shift = self.linear(nn.functional.silu(cond).to(x.dtype)).chunk(2, dim=-1)
        return self.norm(x) * (1 + scale)[:, None, :] + shift[:, None, :]
