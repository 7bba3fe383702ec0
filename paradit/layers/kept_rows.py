"""The rows a step keeps of its last block: a linear's output features computed from its weight's rows alone.

The last joint block of FLUX.2 and FLUX.3 needs every token's keys and values, but its queries, MLP and output
projection only for the image rows the step keeps (the text's and the references' are dropped after it). Where
their projections share one weight (FLUX.2's ``to_qkv_mlp_proj``), the dropped rows multiply only its K and V rows.
Plain single-device math; it never imports ``torch.distributed``."""

from __future__ import annotations

import torch
from torch import nn

from paradit.layers.fp8 import Fp8Linear


def output_features(linear: nn.Module, x: torch.Tensor, start: int, stop: int) -> torch.Tensor:
    """``linear(x)[..., start:stop]``. A plain or FP8 linear multiplies only those rows of its weight (a row slice of
    a row-major weight is a view: nothing is copied a step); any other (a LoRA side path) runs whole, then is cut."""
    if type(linear) is nn.Linear:
        bias = None if linear.bias is None else linear.bias[start:stop]
        return nn.functional.linear(x, linear.weight[start:stop], bias)
    if isinstance(linear, Fp8Linear):
        return linear(x, slice(start, stop))
    return linear(x)[..., start:stop]
