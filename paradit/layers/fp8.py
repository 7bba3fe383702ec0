"""FP8 linears through ``torch._scaled_mm``: e4m3 weights scaled per output channel, activations per token on the fly
(a tensor-wide scale would let the loudest token set everyone's resolution; row-wise the error stays near 1e-2)."""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import nn

from paradit.errors import InvalidRequest


def fp8_dtype(device: torch.device) -> torch.dtype:
    """The FP8 format the device multiplies natively: MI300 (gfx94x) uses the "fnuz" variant, everything else OCP."""
    rocm = device.type == "cuda" and torch.version.hip is not None
    if rocm and torch.cuda.get_device_properties(device).gcnArchName.startswith("gfx94"):
        return torch.float8_e4m3fnuz
    return torch.float8_e4m3fn


def check_fp8_supported(device: torch.device) -> None:
    problem = None
    if device.type != "cuda":
        problem = f"FP8 execution needs a GPU, not {device.type}"
    elif torch.version.hip is not None:
        arch = torch.cuda.get_device_properties(device).gcnArchName
        if not arch.startswith(("gfx94", "gfx95", "gfx12")):
            problem = f"FP8 execution needs an MI300-class or RDNA 4 GPU; this one is {arch}"
    elif (capability := torch.cuda.get_device_capability(device)) < (8, 9):
        version = ".".join(map(str, capability))
        problem = f"FP8 execution needs compute capability 8.9 or newer (Ada, Hopper, Blackwell); this GPU is {version}"
    if problem:
        raise InvalidRequest(f"{problem}; run without --quantize fp8 (bf16)")


def quantize_rowwise(x: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(x / scale in ``dtype``, its float32 absmax scale per row (last dim))."""
    fmax = torch.finfo(dtype).max
    scale = x.abs().amax(dim=-1, keepdim=True).float().clamp(min=1e-12) / fmax
    return (x.float() / scale).clamp(-fmax, fmax).to(dtype), scale


def quantize_weight(weight: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """``quantize_rowwise`` a block of rows at a time, so the float32 working copies stay small."""
    rows = max(1, 2**24 // max(1, weight.shape[1]))
    out = torch.empty(weight.shape, dtype=dtype, device=weight.device)
    scale = torch.empty(weight.shape[0], 1, dtype=torch.float32, device=weight.device)
    for start in range(0, weight.shape[0], rows):
        out[start : start + rows], scale[start : start + rows] = quantize_rowwise(weight[start : start + rows], dtype)
    return out, scale


class QuantizedRows(NamedTuple):
    """Activations quantized row-wise where they were made (``fp8_fused``'s kernels): (rows, width) FP8, their
    (rows, 1) float32 scales, and the leading shape the rows flatten. ``Fp8Linear`` takes them for a tensor."""

    values: torch.Tensor
    scale: torch.Tensor
    leading: tuple[int, ...]


class Fp8Linear(nn.Module):
    """Drop-in for ``nn.Linear`` at inference: ``weight`` is FP8 (out, in), ``weight_scale`` float32 (out, 1)."""

    def __init__(
        self, weight: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None, out_dtype: torch.dtype
    ):
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.weight_scale = nn.Parameter(weight_scale, requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        self.out_dtype = out_dtype
        self.in_features, self.out_features = weight.shape[1], weight.shape[0]

    @classmethod
    def from_linear(cls, linear: nn.Linear, dtype: torch.dtype) -> Fp8Linear:
        weight, scale = quantize_weight(linear.weight.detach(), dtype)
        bias = None if linear.bias is None else linear.bias.detach()
        return cls(weight, scale, bias, linear.weight.dtype)

    def forward(self, x: torch.Tensor | QuantizedRows, features: slice | None = None) -> torch.Tensor:
        """``features``: only those output features, from those rows of the weight (views: nothing copied)."""
        out, leading = self.unbiased(x, features)
        if self.bias is not None:
            out = out + (self.bias if features is None else self.bias[features])
        return out.reshape(*leading, out.shape[-1])

    def unbiased(
        self, x: torch.Tensor | QuantizedRows, features: slice | None = None
    ) -> tuple[torch.Tensor, tuple[int, ...]]:
        """The GEMM's (rows, out) output before the bias, and the leading shape its rows flatten."""
        if isinstance(x, QuantizedRows):
            return self.multiply(x.values, x.scale, features), x.leading
        x_q, x_scale = quantize_rowwise(x.reshape(-1, x.shape[-1]), self.weight.dtype)
        return self.multiply(x_q, x_scale, features), tuple(x.shape[:-1])

    def multiply(self, x_q: torch.Tensor, x_scale: torch.Tensor, features: slice | None = None) -> torch.Tensor:
        weight, weight_scale = self.weight, self.weight_scale
        if features is not None:
            weight, weight_scale = weight[features], weight_scale[features]
        return torch._scaled_mm(
            x_q,
            weight.t(),
            scale_a=x_scale,
            scale_b=weight_scale.t(),
            out_dtype=self.out_dtype,
            use_fast_accum=True,
        )
