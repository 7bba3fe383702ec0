"""Tensor parallelism, Megatron's pairing applied from outside the model: column-parallel Q/K/V and MLP inputs, row-
parallel outputs summed over the group; packed layouts (FLUX.2's [q, k, v, gate, up]) sharded part by part."""

from __future__ import annotations

from fnmatch import fnmatchcase

import torch
from torch import nn

from paradit.parallel.comm import all_reduce_sum
from paradit.parallel.mesh import ParallelContext
from paradit.parallel.tensor_plan import TensorPlan, check_tensor_plan
from paradit.weights import TensorSlice


class RowParallelLinear(nn.Module):
    """The bias is added once, after the sum; ``linear`` stays a plain ``nn.Linear``, so FP8 can still swap it."""

    def __init__(self, linear: nn.Linear, bias: nn.Parameter | None, context: ParallelContext) -> None:
        super().__init__()
        self.linear, self.bias = linear, bias
        self.group, self.stats = context.group("tensor"), context.stats

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = all_reduce_sum(self.linear(x), self.group, self.stats)
        return out if self.bias is None else out + self.bias


class HeadShardedRMSNorm(nn.Module):
    """An RMS norm over the whole attention width (Wan's Q/K norms) on a rank holding some heads: each token's squared
    sum is added over the group. The weight slice stays in ``norm`` for the loader."""

    def __init__(self, norm: nn.RMSNorm, width: int, context: ParallelContext) -> None:
        super().__init__()
        self.norm, self.width = norm, width
        self.group, self.stats = context.group("tensor"), context.stats

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        squares = x.float().square().sum(-1, keepdim=True)
        mean = all_reduce_sum(squares, self.group, self.stats) / self.width
        eps = torch.finfo(x.dtype).eps if self.norm.eps is None else self.norm.eps
        out = (x.float() * torch.rsqrt(mean + eps)).to(x.dtype)
        return out if self.norm.weight is None else out * self.norm.weight


def _matching(model: nn.Module, pattern: str) -> list[tuple[str, nn.Module]]:
    found = [(name, module) for name, module in model.named_modules() if fnmatchcase(name, pattern)]
    if not found:  # a plan that has drifted from its model must not leave layers silently replicated
        raise ValueError(f"tensor-parallel plan pattern {pattern!r} matches no module of {type(model).__name__}")
    return found


def tensor_slices(plan: TensorPlan | None, model: nn.Module, degree: int, rank: int) -> dict[str, TensorSlice]:
    """By name; tensors not named are replicated."""
    widths = check_tensor_plan(plan, model, degree).widths(model)
    slices = {}
    for pattern, shard in plan.linears.items():
        ranges, offset = [], 0
        for part in shard.parts:
            share = widths[part] // degree
            ranges.append((offset + rank * share, offset + (rank + 1) * share))
            offset += widths[part]
        column = shard.style == "column"
        for name, _ in _matching(model, pattern):
            for leaf in ("weight", "bias", "weight_scale") if column else ("weight",):
                slices[f"{name}.{leaf}"] = TensorSlice(0 if column else 1, offset, tuple(ranges))
    share = widths["attention"] // degree
    for pattern in plan.norms_across_heads:
        for name, _ in _matching(model, pattern):
            slices[f"{name}.weight"] = TensorSlice(0, widths["attention"], ((rank * share, (rank + 1) * share),))
    return slices


@torch.no_grad()
def parallelize_tensor(model: nn.Module, plan: TensorPlan | None, context: ParallelContext) -> dict[str, TensorSlice]:
    """In place, on the meta device; returns ``tensor_slices``. The head counts attention modules store are divided."""
    degree = context.config.tensor
    slices = tensor_slices(plan, model, degree, context.local_rank("tensor"))
    attention_width = plan.widths(model)["attention"]  # read before sharding changes the modules it reads
    for pattern, shard in plan.linears.items():
        for name, linear in _matching(model, pattern):
            for leaf, param in list(linear.named_parameters(recurse=False)):
                if f"{name}.{leaf}" in slices:
                    setattr(linear, leaf, nn.Parameter(slices[f"{name}.{leaf}"].take(param), requires_grad=False))
            linear.out_features, linear.in_features = linear.weight.shape
            if shard.style == "row":
                bias = linear.bias
                linear.register_parameter("bias", None)  # added once, after the sum, by the wrapper
                model.set_submodule(name, RowParallelLinear(linear, bias, context))
    for pattern, attributes in plan.local_attributes.items():
        for _, module in _matching(model, pattern):
            for attribute in attributes:
                setattr(module, attribute, getattr(module, attribute) // degree)
    for pattern in plan.norms_across_heads:
        for name, norm in _matching(model, pattern):
            if norm.weight is not None:
                norm.weight = nn.Parameter(slices[f"{name}.weight"].take(norm.weight), requires_grad=False)
            model.set_submodule(name, HeadShardedRMSNorm(norm, attention_width, context))
    return slices
