"""A rank's share of a meta model, made tensor by tensor (peak: its share plus one) from safetensors or random."""

from __future__ import annotations

import hashlib
import json
import math
import pickle
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file
from torch import nn

from paradit.checkpoint import INDEX_FILE, SINGLE_FILE
from paradit.errors import CheckpointError
from paradit.layers.fp8 import Fp8Linear, quantize_weight


@dataclass(frozen=True)
class TensorSlice:
    """A rank's part of a full tensor (``size`` along ``dim``): its ``ranges`` [start, stop), one per packed part."""

    dim: int
    size: int
    ranges: tuple[tuple[int, int], ...]

    def indices(self, ndim: int) -> list[tuple[slice, ...]]:
        before = (slice(None),) * self.dim
        return [(*before, slice(start, stop), *(slice(None),) * (ndim - self.dim - 1)) for start, stop in self.ranges]

    def take(self, tensor: torch.Tensor) -> torch.Tensor:
        """A copy, so that the full tensor can be freed."""
        if tensor.shape[self.dim] != self.size:
            raise ValueError(
                f"a tensor-parallel plan expects {self.size} features along dim {self.dim}, found {tensor.shape}"
            )
        return torch.cat([tensor[index] for index in self.indices(tensor.ndim)], self.dim)


class CheckpointTensors(ExitStack):
    """The tensors of weight ``files`` by name, each read (or a rank's slice of it) from the memory map when asked for.
    Pickle files (``.bin``, only where allowed) go through torch's restricted unpickler, which builds only tensors."""

    def __init__(self, files: list[Path], device: torch.device, dtype: torch.dtype) -> None:
        super().__init__()
        self.device, self.dtype = device, dtype
        self.folder = files[0].parent
        self._stored = {}  # name -> a safetensors slice or a memory-mapped tensor: both read only what is indexed
        self.callback(self._stored.clear)  # a pickle's memory map closes with its last tensor
        for file in files:
            try:
                if file.suffix == ".bin":
                    stored = torch.load(file, map_location="cpu", weights_only=True, mmap=True)
                    if not isinstance(stored, dict) or not all(isinstance(t, torch.Tensor) for t in stored.values()):
                        raise pickle.UnpicklingError
                else:
                    handle = self.enter_context(safe_open(str(file), framework="pt", device="cpu"))
                    stored = {name: handle.get_slice(name) for name in handle.keys()}
            except (SafetensorError, OSError, RuntimeError, pickle.UnpicklingError) as exc:  # truncated, empty, ...
                self.close()
                why = "objects besides tensors" if isinstance(exc, pickle.UnpicklingError) else str(exc).splitlines()[0]
                kind = "pickle" if file.suffix == ".bin" else "safetensors"
                raise CheckpointError(f"{file} is not a readable {kind} file ({why}); download it again") from None
            self._stored.update(stored)

    def keys(self) -> set[str]:
        return set(self._stored)

    def read(self, name: str, full_shape: tuple[int, ...], cut: TensorSlice | None, dtype: torch.dtype | None):
        """On the device, floating tensors cast to ``dtype`` (None: as stored, for FP8 weights and their scales)."""
        stored = self._stored[name]
        shape = tuple(stored.shape if isinstance(stored, torch.Tensor) else stored.get_shape())
        if shape != tuple(full_shape):
            raise CheckpointError(f"{name}: checkpoint shape {shape} != model shape {full_shape}")
        pieces = [stored[index] for index in ([...] if cut is None else cut.indices(len(full_shape)))]
        tensor = pieces[0] if len(pieces) == 1 else torch.cat(pieces, cut.dim)
        # Moved first, then cast: the device converts faster, and the bus carries the stored bytes once. A pickle's
        # tensor is copied even so: it is a view of the file's memory map, which must not outlive the file as it was.
        tensor = tensor.to(self.device, copy=isinstance(stored, torch.Tensor))
        return tensor.to(dtype) if dtype is not None and tensor.is_floating_point() else tensor


class DummyTensors:
    """Random weights (vLLM's ``dummy``), drawn whole seeded by the name, then sliced, so ranks match; std
    1/sqrt(fan_in) for matrices, 1 for norms, 0 for biases: no inf/NaN arithmetic distorts timings."""

    def __init__(self, device: torch.device, dtype: torch.dtype, buffers: set[str], seed: int = 0) -> None:
        self.device, self.dtype, self.buffers, self.seed = device, dtype, buffers, seed

    def read(self, name: str, full_shape: tuple[int, ...], cut: TensorSlice | None, dtype: torch.dtype):
        zero = name in self.buffers or name.endswith("bias")
        if zero or len(full_shape) < 2:
            full = torch.full(full_shape, 0 if zero else 1, dtype=dtype, device=self.device)
        else:
            digest = hashlib.sha256(f"{self.seed}:{name}".encode()).digest()
            generator = torch.Generator(device=self.device).manual_seed(int.from_bytes(digest[:8], "little") >> 1)
            full = torch.empty(full_shape, dtype=dtype, device=self.device)
            full.normal_(0.0, math.prod(full_shape[1:]) ** -0.5, generator=generator)
        return full if cut is None else cut.take(full)


TensorSource = CheckpointTensors | DummyTensors


class ModelNames:
    """The names and full shapes of a plain model's tensors, taken before it is parallelized; found by identity, or by
    module and attribute where tensor parallelism sliced one (all kept referenced, so no identity is reused)."""

    def __init__(self, model: nn.Module) -> None:
        self._modules = {id(module): (name, module) for name, module in model.named_modules(remove_duplicate=False)}
        self._tensors, self._slots = {}, {}
        for module_name, module in model.named_modules(remove_duplicate=False):
            for leaf, tensor in _own_tensors(module):
                entry = (f"{module_name}.{leaf}" if module_name else leaf, tuple(tensor.shape), tensor)
                self._tensors[id(tensor)] = self._slots[(id(module), leaf)] = entry

    def module(self, module: nn.Module) -> str | None:
        return self._modules.get(id(module), (None,))[0]

    def tensor(self, owner: nn.Module, leaf: str, tensor: torch.Tensor) -> tuple[str, tuple[int, ...]]:
        entry = self._tensors.get(id(tensor)) or self._slots.get((id(owner), leaf))
        if entry is None:  # a parallel wrapper built on the meta device must hold only the model's own tensors
            raise ValueError(f"{type(owner).__name__}.{leaf} is on the meta device but is none of the model's tensors")
        return entry[0], entry[1]

    def all(self) -> set[str]:
        return {name for name, _, _ in self._tensors.values()}


@dataclass(frozen=True)
class Fp8Load:
    """Linears to build as ``Fp8Linear`` (names by module identity), and an FP8 checkpoint's ``weight_scale`` names."""

    modules: dict[int, str]
    dtype: torch.dtype
    scales: frozenset[str] = field(default_factory=frozenset)


@torch.no_grad()
def materialize(
    root: nn.Module,
    names: ModelNames,
    source: TensorSource,
    slices: dict[str, TensorSlice] | None = None,
    fp8: Fp8Load | None = None,
) -> None:
    """Fill every meta tensor reachable from ``root`` (a sharded one's slice), ``fp8``'s linears converted as read."""
    slices = slices or {}
    fp8 = fp8 or Fp8Load({}, torch.float8_e4m3fn)
    owners = list(root.modules())
    if hasattr(source, "keys"):  # a checkpoint (random weights have no keys to check)
        wanted = {names.tensor(owner, leaf, t)[0] for owner in owners for leaf, t in _own_tensors(owner) if t.is_meta}
        wanted |= {scale for name in fp8.modules.values() if (scale := f"{name}.weight_scale") in fp8.scales}
        keys = source.keys()
        mismatches = {"missing": sorted(wanted - keys), "unexpected": sorted(keys - names.all() - fp8.scales)}
        if parts := [f"{kind} keys {_few(listed)}" for kind, listed in mismatches.items() if listed]:
            raise CheckpointError(f"checkpoint {source.folder} does not match the model: " + "; ".join(parts))
    done: dict[int, torch.Tensor] = {}
    for owner in owners:
        if id(owner) in fp8.modules:
            continue
        for leaf, child in list(owner.named_children()):
            if id(child) in fp8.modules:
                setattr(owner, leaf, _fp8_linear(child, fp8.modules[id(child)], names, source, slices, fp8))
        for table in (owner._parameters, owner._buffers):
            for leaf, tensor in table.items():
                if tensor is None or not tensor.is_meta:
                    continue
                if id(tensor) not in done:
                    name, shape = names.tensor(owner, leaf, tensor)
                    dtype = source.dtype if tensor.is_floating_point() else tensor.dtype
                    done[id(tensor)] = source.read(name, shape, slices.get(name), dtype)
                value = done[id(tensor)]
                table[leaf] = nn.Parameter(value, requires_grad=False) if table is owner._parameters else value


def _own_tensors(module: nn.Module) -> list[tuple[str, torch.Tensor]]:
    return [(leaf, t) for leaf, t in [*module._parameters.items(), *module._buffers.items()] if t is not None]


def _fp8_linear(
    linear: nn.Linear, name: str, names: ModelNames, source: TensorSource, slices: dict[str, TensorSlice], fp8: Fp8Load
) -> Fp8Linear:

    def read(key: str, shape: tuple[int, ...], dtype: torch.dtype | None) -> torch.Tensor:
        return source.read(key, shape, slices.get(key), dtype)

    shape = names.tensor(linear, "weight", linear.weight)[1]
    if f"{name}.weight_scale" in fp8.scales:
        weight, scale = read(f"{name}.weight", shape, None), read(f"{name}.weight_scale", (shape[0], 1), torch.float32)
        if weight.dtype != fp8.dtype:  # an OCP (e4m3fn) checkpoint on MI300's "fnuz" format, or a LoRA fused in
            weight, scale = quantize_weight(weight.float() * scale, fp8.dtype)
    else:
        weight, scale = quantize_weight(read(f"{name}.weight", shape, source.dtype), fp8.dtype)
    bias = None if linear.bias is None else read(*names.tensor(linear, "bias", linear.bias), source.dtype)
    return Fp8Linear(weight, scale, bias, source.dtype)


def _few(names: list[str], limit: int = 8) -> str:
    shown = ", ".join(names[:limit])
    return shown + (f" and {len(names) - limit} more" if len(names) > limit else "")


def save_component(state: dict[str, torch.Tensor], config: dict, folder: Path, max_shard_bytes: int) -> None:
    """``config.json`` and safetensors shards of at most ``max_shard_bytes`` with their index, or one file for all."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    shards: list[dict[str, torch.Tensor]] = [{}]
    for name, tensor in state.items():
        if shards[-1] and sum(t.nbytes for t in shards[-1].values()) + tensor.nbytes > max_shard_bytes:
            shards.append({})
        shards[-1][name] = tensor.detach().to("cpu").contiguous()
    if len(shards) == 1:
        save_file(shards[0], str(folder / SINGLE_FILE))
        return
    weight_map = {}
    for number, shard in enumerate(shards, 1):
        file = f"diffusion_pytorch_model-{number:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(folder / file))
        weight_map.update(dict.fromkeys(shard, file))
    index = {"metadata": {"total_size": sum(t.nbytes for t in state.values())}, "weight_map": weight_map}
    (folder / INDEX_FILE).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
