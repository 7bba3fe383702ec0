"""A server's choice of adapters for each batch: side paths, or choices merged into the weights and kept in an LRU
cache, each copied into the tensors the model already runs, so compiled blocks and CUDA graphs stay valid."""

from __future__ import annotations

import functools
from collections import OrderedDict
from typing import TYPE_CHECKING

import torch
from torch import nn

from paradit.layers.fp8 import Fp8Linear, quantize_weight
from paradit.lora.apply import LoraSidePath, select_adapters
from paradit.request_hooks import RequestHook

if TYPE_CHECKING:
    from paradit.request import ResolvedRequest

Merged = dict[int, tuple[tuple[torch.Tensor, ...], torch.Tensor | None]]  # path index -> its tensors, its bias


class AdapterChoice(RequestHook):
    """Each batch's choice (name -> scale), on side paths (``cache`` 0) or fused; None keeps the engine's."""

    def __init__(self, model: nn.Module, cache: int) -> None:
        self.choose = functools.partial(select_adapters, model) if cache == 0 else FusedVariants(model, cache).choose

    def begin_request(self, request: ResolvedRequest) -> None:
        if request.lora is not None:
            self.choose(dict(request.lora))


def _live(path: LoraSidePath) -> tuple[torch.Tensor, ...]:
    linear = path.linear
    return (linear.weight, linear.weight_scale) if isinstance(linear, Fp8Linear) else (linear.weight,)


class FusedVariants:
    """``choose`` copies weights merged from a copy of the base ones into the side paths' linears (the factors are this
    rank's cut); an adapter's bias stays beside the linear (a row-parallel one adds its bias after the all-reduce)."""

    def __init__(self, model: nn.Module, size: int) -> None:
        self.paths = [module for module in model.modules() if isinstance(module, LoraSidePath)]
        self.size = size
        self.base = [tuple(tensor.detach().clone() for tensor in _live(path)) for path in self.paths]
        self.merged: OrderedDict[tuple, Merged] = OrderedDict()
        self.chosen: tuple = ()
        self.holding: Merged = {}
        for path in self.paths:
            biases = [bias for _, _, bias in path.factors.values() if bias is not None]
            path.select({})
            path.up_bias = torch.zeros_like(biases[0]) if biases else None

    @torch.inference_mode()  # the weights may have loaded as inference tensors
    def choose(self, scales: dict[str, float]) -> None:
        key = tuple(sorted(scales.items()))
        if key == self.chosen:
            return
        merged: Merged = {}
        if key:
            merged = self.merged.pop(key, None) or self._merge(scales)
            self.merged[key] = merged
            while len(self.merged) > self.size:
                self.merged.popitem(last=False)
        for index in self.holding.keys() | merged.keys():
            path = self.paths[index]
            tensors, bias = merged.get(index, (self.base[index], None))
            for live, chosen in zip(_live(path), tensors):
                live.copy_(chosen)
            if path.up_bias is not None:
                path.up_bias.zero_() if bias is None else path.up_bias.copy_(bias)
        self.chosen, self.holding = key, merged

    def _merge(self, scales: dict[str, float]) -> Merged:
        merged: Merged = {}
        for index, path in enumerate(self.paths):
            if (combined := path.combined(scales)) is None:
                continue
            down, up, bias = combined
            base = self.base[index]
            weight = (base[0].float() * base[1] if len(base) == 2 else base[0].float()) + up.float() @ down.float()
            tensors = quantize_weight(weight, base[0].dtype) if len(base) == 2 else (weight.to(base[0].dtype),)
            merged[index] = (tensors, bias)
        return merged
