"""How an FP8 linear's LoRA side path runs, in variants that ``benchmarks/lora_cost.py --fp8-side-paths`` times side
by side in one GPU call; the one measured fastest stays, the others go. Each equals ``sum`` within FP8's error.

- ``sum``: ``linear(x) + (x @ down.T) @ up.T``, a bf16 GEMM reading the activation again for the down projection.
- ``addmm``: the up projection accumulated by ``torch.addmm`` (cuBLAS's beta 1), as Inductor lowers it.
- ``accumulate``: the same in place (``accumulate_low_rank``): the base output read and written once by the up GEMM.
- ``stacked``: down's rows appended to the FP8 weight, so one scaled GEMM of the input already quantized for the
  base gives ``[W x | down x]`` (its output dimension grows by the rank); then the up projection summed.
- ``stacked-accumulate``: stacked, and the up projection accumulated in place.
- ``fold``: the up projection folded into the FP8 GEMM's reduced dimension (``[W, up]`` times ``[x, x @ down.T]``,
  as bf16 folds), its depth padded to a whole tile, where the width pays (``FOLD_WIDTH_RATIO``).

Imports no ``torch.distributed``."""

from __future__ import annotations

import math

import torch
from torch import nn

from paradit.layers.fp8 import Fp8Linear, quantize_rowwise, quantize_weight

FP8_SIDE_PATHS = ("sum", "addmm", "accumulate", "stacked", "stacked-accumulate", "fold")
DEFAULT_FP8_SIDE_PATH = "sum"  # the one measured (docs/benchmarks.md) until lora_cost.py compares the others
# The variants that widen the FP8 weight for the adapters chosen at load: a server's choices change the rank.
WIDENING = {"stacked": "sum", "stacked-accumulate": "accumulate", "fold": "sum"}
# FP8 GEMMs take dimensions of whole multiples of 16: a stacked down projection is padded with zero rows to them.
FP8_MULTIPLE = 16
# A folded depth padded to a whole K tile of Hopper's FP8 GEMMs: folding at a depth of 16 more (6144 + 32 -> 6160)
# measured +13.3% on an H100 against +9.3% for ``sum`` (docs/benchmarks.md), a partial tile being one of the suspects.
FOLD_DEPTH = 128
# A fold whose ``up`` outgrows the weights' row scales shrinks it by ``c`` < 1 and enlarges the low-rank product by
# 1 / c, which may then set its rows' FP8 scale; past 16x that costs the input too much of its range: not folded.
MIN_FOLD = 1 / 16


@torch.library.custom_op("paradit::accumulate_low_rank", mutates_args=("out",))
def accumulate_low_rank(out: torch.Tensor, low_rank: torch.Tensor, up_t: torch.Tensor) -> None:
    """``out += low_rank @ up_t`` in one GEMM whose epilogue reads ``out``. An op of our own because Inductor lowers
    ``torch.addmm`` out of place, which copies ``out`` before the GEMM reads it again (ATen's ``addmm_out``)."""
    out.addmm_(low_rank, up_t)


@accumulate_low_rank.register_fake
def _(out: torch.Tensor, low_rank: torch.Tensor, up_t: torch.Tensor) -> None:
    return None


def fold_factor(linear: Fp8Linear, up: torch.Tensor) -> float:
    """The largest power of two ``c`` by which ``up`` over the FP8 weights' row scales stays within the format."""
    fmax = torch.finfo(linear.weight.dtype).max
    largest = (up.float() / linear.weight_scale).abs().max().item()
    return 2.0 ** math.floor(math.log2(fmax / largest)) if largest > 0 else 1.0


@torch.no_grad()
def ready(path: nn.Module, variant: str, width_pays: bool) -> str:
    """``path`` (a ``LoraSidePath`` whose linear is FP8, its weights loaded) readied for ``variant``: the FP8 weight
    widened where it stacks or folds, ``down`` and ``up`` padded to match. Returns the variant it will run (a
    widening one falls back where the adapters are a server's or, for a fold, where it does not pay)."""
    if variant not in FP8_SIDE_PATHS:
        raise ValueError(f"unknown FP8 side path {variant!r}; the variants are {', '.join(FP8_SIDE_PATHS)}")
    linear: Fp8Linear = path.linear
    if variant in WIDENING and path.factors:
        return WIDENING[variant]
    if variant == "fold":
        if not width_pays or (c := fold_factor(linear, path.up)) < MIN_FOLD:
            return WIDENING[variant]
        pad = -(linear.in_features + path.down.shape[0]) % FOLD_DEPTH
        path.down, up = nn.functional.pad(path.down, (0, 0, 0, pad)), nn.functional.pad(path.up, (0, pad))
        fmax = torch.finfo(linear.weight.dtype).max
        columns = (up.float() / linear.weight_scale * c).clamp(-fmax, fmax).to(linear.weight.dtype)
        linear.weight = nn.Parameter(torch.cat([linear.weight, columns], dim=1), requires_grad=False)
        linear.in_features = linear.weight.shape[1]
        path.up, path.folded_scale = None, 1.0 / c
    elif variant in WIDENING:
        pad = -path.down.shape[0] % FP8_MULTIPLE
        rows, scales = quantize_weight(nn.functional.pad(path.down, (0, 0, 0, pad)), linear.weight.dtype)
        linear.weight = nn.Parameter(torch.cat([linear.weight, rows]), requires_grad=False)
        linear.weight_scale = nn.Parameter(torch.cat([linear.weight_scale, scales]), requires_grad=False)
        path.up = nn.functional.pad(path.up, (0, pad))
    return variant


def side_path_output(path: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """``path``'s FP8 linear and its low-rank update, before the adapters' bias, as its ``fp8_path`` computes them."""
    linear: Fp8Linear = path.linear
    rows = x.reshape(-1, x.shape[-1])
    variant, out_features = path.fp8_path, linear.out_features
    if variant == "fold":
        low_rank = (rows.to(path.down.dtype) @ path.down.T) * path.folded_scale
        out = linear.multiply(*quantize_rowwise(torch.cat([rows, low_rank.to(rows.dtype)], -1), linear.weight.dtype))
    else:
        out = linear.multiply(*quantize_rowwise(rows, linear.weight.dtype))
        if variant in WIDENING:  # the stacked GEMM's last columns are the down projection
            out, low_rank = out[:, :out_features], out[:, out_features:].contiguous()
        else:
            low_rank = rows.to(path.down.dtype) @ path.down.T
        up_t = path.up.T
        if variant == "addmm":
            out = torch.addmm(out, low_rank, up_t)
        elif variant.endswith("accumulate"):
            accumulate_low_rank(out, low_rank, up_t)
        else:
            out = out + low_rank @ up_t
    if linear.bias is not None:
        out = out + linear.bias
    return out.reshape(*x.shape[:-1], out_features)
