"""Applying adapters to a transformer as it loads, on whatever plan it runs. Fused: each targeted weight is read whole,
its updates added in float32, and only then cut to the rank's tensor-parallel slice and converted to FP8, so every
plan and precision gets the same merged weight at no cost per step. Unfused: each targeted linear gets a low-rank
side path beside it (bf16 beside an FP8 GEMM), its factors cut the way the base weight is cut (``up`` for a column-
parallel linear, ``down`` for a row-parallel one, whose partial output the existing all-reduce sums), so no extra
communication. Must not import torch.distributed."""

from __future__ import annotations

import dataclasses
import importlib

import torch
from torch import nn

from paradit.errors import CheckpointError, InvalidRequest
from paradit.lora.adapters import LoraRef, LoraSet, LowRank, read_adapter
from paradit.weights import ModelNames, TensorSlice, TensorSource


def check_adapters(family, spec, lora: LoraSet) -> None:
    """Refuses, before anything loads, an adapter that would not apply to ``spec``'s transformers (each rank reads
    its adapters again as it loads: they are small, and the files are the only thing a worker is sent)."""
    if lora.transformer_2 and "transformer_2" not in spec.experts:
        raise InvalidRequest(f"--lora-2 is for a second transformer (a low-noise expert); {spec.name} has one")
    for component, config in {"transformer": spec.transformer, **spec.experts}.items():
        if refs := lora.of(component):
            with torch.device("meta"):
                model = family.build_transformer(dataclasses.replace(spec, transformer=config))
            read_updates(family.lora_loader, refs, model, component)


def read_updates(loader_name: str, refs: tuple[LoraRef, ...], model: nn.Module, component: str) -> dict[str, list]:
    """Each linear's updates from every adapter in ``refs``, in order; ``model`` the plain model (on meta)."""
    loader = getattr(importlib.import_module("diffusers.loaders.lora_pipeline"), loader_name)
    linears = {name: tuple(m.weight.shape) for name, m in model.named_modules() if isinstance(m, nn.Linear)}
    biased = {name for name, m in model.named_modules() if isinstance(m, nn.Linear) and m.bias is not None}
    updates: dict[str, list[LowRank]] = {}
    for ref in refs:
        for name, update in read_adapter(ref, loader, linears, component).items():
            if update.up_bias is not None and name not in biased:
                raise InvalidRequest(f"--lora {ref.source}: a lora_B bias for {name}, a linear without a bias")
            updates.setdefault(name, []).append(update)
    return updates


class LoraTensors:
    """``source`` with the updates added as tensors are read: weights too when ``fuse_weights`` (else only the
    biases, which a side path leaves to its base linear)."""

    def __init__(self, source: TensorSource, updates: dict[str, list[LowRank]], fuse_weights: bool) -> None:
        self.source, self.updates, self.fuse_weights = source, updates, fuse_weights
        self.dtype = source.dtype

    def __getattr__(self, name: str):  # the checkpoint's keys and folder, for the loader's key check
        return getattr(self.source, name)

    def read(self, name: str, full_shape: tuple[int, ...], cut: TensorSlice | None, dtype: torch.dtype | None):
        module, _, leaf = name.rpartition(".")
        updates = self.updates.get(module, [])
        if leaf == "bias":
            updates = [update for update in updates if update.up_bias is not None]
        elif leaf != "weight" or not self.fuse_weights:
            updates = []
        if not updates:
            return self.source.read(name, full_shape, cut, dtype)
        if dtype is None:  # an FP8 checkpoint's weight, read as stored
            raise CheckpointError(f"{name} is FP8 in the checkpoint: a LoRA fuses into high-precision weights only; "
                                  "run with --lora-mode unfused")  # fmt: skip
        full = self.source.read(name, full_shape, None, torch.float32)
        for update in updates:
            full += update.delta(full.device) if leaf == "weight" else update.up_bias.to(full) * update.scale
        full = full.to(dtype)
        return full if cut is None else cut.take(full)


class LoraSidePath(nn.Module):
    """``linear`` with its adapters' updates beside it: ``linear(x) + (x @ down.T) @ up.T``, every adapter's factors
    concatenated along the rank (one pair of GEMMs however many) and their scales folded into ``up``."""

    def __init__(self, linear: nn.Module, down: torch.Tensor, up: torch.Tensor) -> None:
        super().__init__()
        self.linear = linear
        self.register_buffer("down", down, persistent=False)
        self.register_buffer("up", up, persistent=False)

    @property
    def weight(self) -> torch.Tensor:  # the models read a linear's weight for its dtype
        return self.linear.weight

    @property
    def bias(self) -> torch.Tensor | None:
        return self.linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        base = self.linear(x)
        hidden = x.to(self.down.dtype) @ self.down.T
        # The up projection accumulates into the base output in the GEMM itself (beta 1): a sum after it would read
        # and write the whole output once more, which costs more than the low-rank GEMMs on wide linears.
        return torch.addmm(base.flatten(0, -2), hidden.flatten(0, -2), self.up.T).view(base.shape)


def add_side_paths(model: nn.Module, names: ModelNames, updates: dict[str, list[LowRank]],
                   slices: dict[str, TensorSlice], device: torch.device, dtype: torch.dtype) -> None:  # fmt: skip
    """Wraps every linear this rank kept that an adapter updates (before the loader fills it, so FP8 can still swap
    the linear inside the wrapper)."""
    for parent in list(model.modules()):
        for leaf, child in list(parent.named_children()):
            name = names.module(child)
            if not isinstance(child, nn.Linear) or name not in updates:
                continue
            down = torch.cat([update.down for update in updates[name]]).to(device, dtype)
            up = torch.cat([update.up * update.scale for update in updates[name]], dim=1).to(device, dtype)
            cut = slices.get(f"{name}.weight")
            if cut is not None:  # a column-parallel linear keeps some outputs, a row-parallel one some inputs
                down, up = (down, cut.take(up)) if cut.dim == 0 else (cut.take(down), up)
            setattr(parent, leaf, LoraSidePath(child, down, up))
