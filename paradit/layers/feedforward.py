"""The GELU MLP of diffusers' ``FeedForward``, laid out as checkpoints name it."""

from __future__ import annotations

import torch
from torch import nn

from paradit.layers.fp8 import Fp8Linear, QuantizedRows
from paradit.layers.fp8_fused import gelu_quantized, uses_fusion


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
        self.fusions: frozenset[str] | None = None  # fp8_fused's choice (None: the measured one)

    def forward(self, x: torch.Tensor | QuantizedRows) -> torch.Tensor:
        """``x`` quantized already where the FP8 input linear takes it (``fp8_fused``)."""
        project, output = self.net[0], self.net[2]
        if self.fuses_gelu():
            # FP8 linears on both sides: the hidden activations go from the GEMM's output straight to FP8.
            hidden, leading = project.proj.unbiased(x)
            return output(gelu_quantized(hidden, project.proj.bias, leading, output.weight.dtype))
        return output(project(x))

    def fuses_gelu(self) -> bool:
        project, output = self.net[0], self.net[2]
        return (
            isinstance(project.proj, Fp8Linear)
            and isinstance(output, Fp8Linear)
            and project.approximate == "tanh"
            and uses_fusion(output.weight.device, "gelu_quantize", self.fusions)
        )
