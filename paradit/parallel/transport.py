"""FP8 transport (``--comm-dtype fp8``): each row crosses the wire as its e4m3 bytes then its float32 scale's four, so
one collective carries both (on PCIe a second one costs more latency than its bytes)."""

from __future__ import annotations

import functools

import torch

from paradit.layers.fp8 import quantize_rowwise

TRANSPORT_FP8 = torch.float8_e4m3fn
SCALE_BYTES = 4  # a float32 per row


# The scale's bytes come by shifts rather than a float32 -> uint8 view: inductor may lay a (..., 1) scale out with a
# non-unit last stride, where a view between element sizes fails to compile (float32 <-> int32 views do not).
_BYTE_SHIFTS = (0, 8, 16, 24)  # little-endian, the order a float32 -> uint8 view gives


def _encode(x: torch.Tensor) -> torch.Tensor:
    payload, scale = quantize_rowwise(x, TRANSPORT_FP8)
    bits = scale.view(torch.int32)
    scale_bytes = [((bits >> shift) & 0xFF).to(torch.uint8) for shift in _BYTE_SHIFTS]
    return torch.cat([payload.view(torch.uint8), *scale_bytes], dim=-1)


def _decode(packed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    payload, scale_bytes = packed.split([packed.shape[-1] - SCALE_BYTES, SCALE_BYTES], dim=-1)
    bits = scale_bytes.to(torch.int32)
    bits = sum(bits[..., i : i + 1] << shift for i, shift in enumerate(_BYTE_SHIFTS))
    return (payload.view(TRANSPORT_FP8).float() * bits.view(torch.float32)).to(dtype)


# Compiled on GPUs: eager mode reads and writes ~27 bytes per value, more time than the halved wire saves. Wrapped
# on first use: torch.compile imports Inductor (half a second), which a process that only plans never needs.
@functools.cache
def _compiled(fn):
    return torch.compile(fn, dynamic=False)


def encode_fp8_rows(x: torch.Tensor) -> torch.Tensor:
    """(..., D) floating -> (..., D + 4) uint8."""
    return (_compiled(_encode) if x.is_cuda else _encode)(x.contiguous())


def decode_fp8_rows(packed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return (_compiled(_decode) if packed.is_cuda else _decode)(packed.contiguous(), dtype)
