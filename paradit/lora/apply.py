"""Applying adapters as the transformer loads, on any plan: fused (merged whole in float32, then cut and converted), or
as side paths cut as the base weight is cut, so the existing all-reduce sums them: no extra communication."""

from __future__ import annotations

import dataclasses
import importlib
import math

import torch
from torch import nn

from paradit.errors import InvalidRequest
from paradit.layers.fp8 import Fp8Linear
from paradit.lora.adapters import Kronecker, LowRank, read_adapter
from paradit.lora.refs import LoraRef, LoraSet, adapter_key
from paradit.pipelines.requests import not_allowed
from paradit.weights import ModelNames, TensorSlice, TensorSource

# Past the square root of float32's largest number, a scale alone overflows the layer after the update.
SCALE_LIMIT = math.sqrt(torch.finfo(torch.float32).max)
# A folded side path writes its input again, beside the low-rank product (``[x, x @ down.T]``: in + rank columns a
# row); an unfolded one writes the up projection's output and reads it back for the sum (out columns, twice). So it
# folds where in <= FOLD_WIDTH_RATIO * out: FLUX.2's fused single-block projection (6144 -> 55296) folds, its output
# projection (24576 -> 6144) does not; square attention projections break even on traffic and save a GEMM's launch.
# On an H100, FLUX.2-dev rank 32 compiled, folding took bf16 from +7.9% a forward to +3.6%; with FP8 linears it took
# +6.6% to +5.3% (docs/benchmarks.md, session 29), the widened depth padded to ``FP8_FOLD_DEPTH``.
FOLD_WIDTH_RATIO = 1.0
# An FP8 linear's folded depth is padded to a whole K tile of Hopper's FP8 GEMMs: padded to 16 (6144 + 32 -> 6160), the
# fold measured +13.3% a forward against +9.3% unfolded; to 128, +6.4% against +7.6% (docs/benchmarks.md, session 26).
FP8_FOLD_DEPTH = 128
# An FP8 fold stores ``up * c`` over the weight's row scales (``fp8_fold_factor``) and scales the low-rank product by
# 1 / c, which is quantized with the input's row: past 16x, it would take the input's row scale over.
MIN_FP8_FOLD = 1 / 16


def check_adapters(family, spec, lora: LoraSet, dtype: torch.dtype, fp8: bool) -> int:
    """Refuses, before anything loads, an adapter that would not apply; returns the bytes a rank holds for them beyond
    the weights (every tensor whole, so it errs high)."""
    if lora.transformer_2 and "transformer_2" not in spec.experts:
        raise InvalidRequest(f"--lora-2 is for a second transformer (a low-noise expert); {spec.name} has one")
    held = 0
    for component, config in {"transformer": spec.transformer, **spec.experts}.items():
        if refs := lora.of(component):
            with torch.device("meta"):
                model = family.build_transformer(dataclasses.replace(spec, transformer=config))
            keyed = read_updates(family.lora_loader, refs, model, component)
            check_reach(refs, keyed, dtype)
            if lora.fused:
                continue
            updates = [(name, update) for name, pairs in keyed.items() for _, update in pairs]
            if kronecker := [name for name, update in updates if isinstance(update, Kronecker)]:
                raise InvalidRequest(
                    f"LoKr adapters fuse into the weights only (for {kronecker[0]} and others); "
                    "run with --lora-mode fused, not as side paths"
                )
            held += dtype.itemsize * sum(
                u.down.numel() + u.up.numel() + (0 if u.up_bias is None else u.up_bias.numel()) for _, u in updates
            )
            if fp8 and not lora.switchable:
                held += fp8_fold_bytes(model, keyed)
            if lora.cache:
                weights = [model.get_submodule(name).weight.shape for name in keyed]
                per_copy = sum(
                    rows * (columns + 4) if fp8 else rows * columns * dtype.itemsize for rows, columns in weights
                )
                held += (1 + lora.cache) * per_copy
    return held


def fp8_fold_bytes(model: nn.Module, keyed: dict[str, list]) -> int:
    """The bytes FP8 folds add to the weights they widen: a column of each padded depth a row (``LoraSidePath.fold``).
    Every linear whose width pays is counted, ``up``'s range unseen on the meta device: it errs high."""
    held = 0
    for name, pairs in keyed.items():
        rows, columns = model.get_submodule(name).weight.shape
        if columns <= FOLD_WIDTH_RATIO * rows:
            rank = sum(update.down.shape[0] for _, update in pairs)
            held += rows * (fp8_folded_depth(columns, rank) - columns)
    return held


def fp8_folded_depth(in_features: int, rank: int) -> int:
    """An FP8 fold's reduced dimension: the input's and the rank's columns, padded to a whole ``FP8_FOLD_DEPTH``."""
    return -(-(in_features + rank) // FP8_FOLD_DEPTH) * FP8_FOLD_DEPTH


def check_reach(refs: tuple[LoraRef, ...], keyed: dict[str, list], dtype: torch.dtype) -> None:
    """Refuses an update whose numbers (``reach``) pass the square root of ``dtype``'s largest: a layer multiplies its
    weights by inputs of like size, so past it the next layer overflows and the first denoise step predicts NaN."""
    limit = math.sqrt(torch.finfo(dtype).max)
    by_key = {adapter_key(ref, index): ref for index, ref in enumerate(refs)}
    for name, pairs in keyed.items():
        for key, update in pairs:
            if (reach := update.reach()) > limit:
                ref = by_key[key]
                raise InvalidRequest(
                    f"--lora {ref.source} at scale {ref.scale:g}: its update of {name} reaches {reach:.3g}, past "
                    f"what {str(dtype).removeprefix('torch.')} carries through a layer ({limit:.3g}, the square root "
                    "of its largest number); give a smaller scale"
                )


def check_choice(lora: LoraSet, chosen: tuple | None) -> tuple | None:
    """A request's choice of a server's named adapters: () for none, None for an engine whose adapters are fixed."""
    if not lora.switchable:
        if chosen:
            raise InvalidRequest("this model was started without named LoRA adapters to choose from", param="lora")
        return None
    known = lora.names()
    for name, scale in chosen or ():
        if name not in known:
            raise InvalidRequest(f"unknown LoRA adapter {name!r}; this server has {', '.join(known)}", param="lora")
        if not abs(scale) <= SCALE_LIMIT:
            allowed = f"give a finite number within ±{SCALE_LIMIT:.3g}"
            raise not_allowed(f"LoRA adapter {name!r}: scale", f"{scale:g}", allowed, "lora")
    return tuple(chosen or ())


def read_updates(loader_name: str, refs: tuple[LoraRef, ...], model: nn.Module, component: str) -> dict[str, list]:
    """Each linear's updates from every adapter in ``refs`` as (its key, the update), in order."""
    loader = getattr(importlib.import_module("diffusers.loaders.lora_pipeline"), loader_name)
    linears = {name: tuple(m.weight.shape) for name, m in model.named_modules() if isinstance(m, nn.Linear)}
    biased = {name for name, m in model.named_modules() if isinstance(m, nn.Linear) and m.bias is not None}
    updates: dict[str, list[tuple[str, LowRank]]] = {}
    for index, ref in enumerate(refs):
        for name, update in read_adapter(ref, loader, linears, component).items():
            if update.up_bias is not None and name not in biased:
                raise InvalidRequest(f"--lora {ref.source}: a lora_B bias for {name}, a linear without a bias")
            updates.setdefault(name, []).append((adapter_key(ref, index), update))
    return updates


class FusedLoraTensors:
    """``source`` with the updates fused into the weights and biases they name, whole in float32, then cast and cut."""

    def __init__(self, source: TensorSource, updates: dict[str, list[tuple[str, LowRank]]]) -> None:
        self.source, self.updates = source, updates

    def __getattr__(self, name: str):  # the checkpoint's dtype, keys and folder, for the loader
        return getattr(self.source, name)

    def read(self, name: str, full_shape: tuple[int, ...], cut: TensorSlice | None, dtype: torch.dtype | None):
        module, _, leaf = name.rpartition(".")
        pairs = self.updates.get(module, []) if leaf in ("weight", "bias") else []
        updates = [update for _, update in pairs if leaf == "weight" or update.up_bias is not None]
        if not updates:
            return self.source.read(name, full_shape, cut, dtype)
        scale = None
        if dtype is None:  # an FP8 checkpoint's weight, read as stored: dequantized by its row scales first
            scale = self.source.read(f"{module}.weight_scale", (full_shape[0], 1), None, torch.float32)
            full = self.source.read(name, full_shape, None, None).float() * scale
        else:
            full = self.source.read(name, full_shape, None, torch.float32)
        for update in updates:
            full += update.delta(full.device) if leaf == "weight" else update.up_bias.to(full) * update.scale
        # An FP8 weight goes back in float32 over the checkpoint's scales, which the loader multiplies it by before
        # quantizing it anew (its path for a checkpoint whose FP8 format differs from the device's).
        full = full.to(dtype) if scale is None else full / scale.clamp_min(torch.finfo(torch.float32).tiny)
        return full if cut is None else cut.take(full)


class LoraSidePath(nn.Module):
    """``linear(x) + (x @ down.T) @ up.T (+ bias)``, the chosen adapters' factors concatenated along the rank (one pair
    of GEMMs however many). They are plain attributes, not buffers: an expert swap leaves them where they are."""

    def __init__(self, linear: nn.Module, factors: dict[str, tuple]) -> None:
        super().__init__()
        self.linear, self.factors = linear, factors
        self.chosen: tuple = ()
        self.down = self.up = self.up_bias = None
        self.folded = False  # once folded (``fold``), the base GEMM computes the update too
        self.folded_scale = 1.0  # an FP8 fold's factor on the low-rank product (``fold``)

    @property
    def weight(self) -> torch.Tensor:  # the models read a linear's weight for its dtype
        return self.linear.weight

    @property
    def bias(self) -> torch.Tensor | None:
        return self.linear.bias

    def combined(self, scales: dict[str, float]) -> tuple | None:
        """(down, up, bias or None) of the adapters ``scales`` chooses, their scales folded in (None: none here)."""
        parts = [(*self.factors[key], scale) for key, scale in scales.items() if key in self.factors]
        if not parts:
            return None
        biases = [bias * scale for _, _, bias, scale in parts if bias is not None]
        return (
            torch.cat([down for down, _, _, _ in parts]),
            torch.cat([up * scale for _, up, _, scale in parts], 1),
            sum(biases) if biases else None,
        )

    def select(self, scales: dict[str, float]) -> None:
        chosen = tuple((key, scale) for key, scale in scales.items() if key in self.factors)
        if chosen == self.chosen:
            return
        self.chosen = chosen
        self.down, self.up, self.up_bias = self.combined(scales) or (None, None, None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.folded:
            low_rank = x.to(self.down.dtype) @ self.down.T
            if self.folded_scale != 1.0:
                low_rank = low_rank * self.folded_scale
            out = self.linear(torch.cat([x, low_rank.to(x.dtype)], dim=-1))
        else:
            out = self.linear(x)
            if self.down is not None:
                # A plain sum: accumulating into the base output inside the up GEMM (addmm, beta 1) measured slower on
                # an H200 (FLUX.2-dev: +8.5% a forward against +6.7%, docs/benchmarks.md).
                out = out + (x.to(self.down.dtype) @ self.down.T) @ self.up.T
        return out if self.up_bias is None else out + self.up_bias

    def folds(self) -> bool:
        """Fixed adapters (a server's choices change the rank) by a plain or FP8 linear of this process, where the
        width pays (``FOLD_WIDTH_RATIO``) and, in FP8, ``up`` keeps to the format's range (``MIN_FP8_FOLD``)."""
        linear = self.linear
        if self.factors or self.down is None or self.folded:
            return False
        if type(linear) not in (nn.Linear, Fp8Linear) or linear.weight.is_meta:
            return False
        if linear.weight.shape[1] > FOLD_WIDTH_RATIO * linear.weight.shape[0]:
            return False
        return type(linear) is nn.Linear or fp8_fold_factor(linear, self.up) >= MIN_FP8_FOLD

    @torch.no_grad()
    def fold(self) -> None:
        """The up projection folded into the base GEMM: its weight becomes ``[W, up]`` along the reduced dimension
        and its input ``[x, x @ down.T]``, so one GEMM writes ``W x + up (down x)`` and no up output is written and
        summed. An FP8 weight takes ``up * c`` in its format over its row scales, its depth padded with zeros to
        ``FP8_FOLD_DEPTH``, and the low-rank product ``1 / c`` of itself, quantized with the input's row."""
        linear, up = self.linear, self.up
        if isinstance(linear, Fp8Linear):
            pad = fp8_folded_depth(linear.in_features, self.down.shape[0]) - linear.in_features - self.down.shape[0]
            self.down, up = nn.functional.pad(self.down, (0, 0, 0, pad)), nn.functional.pad(up, (0, pad))
            factor, fmax = fp8_fold_factor(linear, up), torch.finfo(linear.weight.dtype).max
            up = (up.float() / linear.weight_scale * factor).clamp(-fmax, fmax)
            self.folded_scale = 1.0 / factor
        linear.weight = nn.Parameter(torch.cat([linear.weight, up.to(linear.weight.dtype)], dim=1), requires_grad=False)
        linear.in_features = linear.weight.shape[1]
        self.up, self.folded = None, True


def fp8_fold_factor(linear: Fp8Linear, up: torch.Tensor) -> float:
    """The largest power of two ``c`` by which ``up`` over the FP8 weight's row scales stays within the format."""
    fmax = torch.finfo(linear.weight.dtype).max
    largest = (up.float() / linear.weight_scale).abs().max().item()
    return 2.0 ** math.floor(math.log2(fmax / largest)) if largest > 0 else 1.0


def add_side_paths(
    model: nn.Module,
    names: ModelNames,
    updates: dict[str, list[tuple[str, LowRank]]],
    slices: dict[str, TensorSlice],
    device: torch.device,
    dtype: torch.dtype,
    scales: dict[str, float],
    switchable: bool,
) -> None:
    """Wraps each kept linear an adapter updates before the loader fills it (so FP8 can swap the linear inside); a
    column-parallel linear keeps its ``up`` and bias rows, a row-parallel one its ``down`` columns and a bias share."""
    for parent in list(model.modules()):
        for leaf, child in list(parent.named_children()):
            name = names.module(child)
            if not isinstance(child, nn.Linear) or name not in updates:
                continue
            cut = slices.get(f"{name}.weight")
            factors = {}
            for key, update in updates[name]:
                down, up = update.down.to(device, dtype), (update.up * update.scale).to(device, dtype)
                bias = None if update.up_bias is None else (update.up_bias * update.scale).to(device, dtype)
                if cut is not None and cut.dim == 0:
                    up, bias = cut.take(up), None if bias is None else cut.take(bias)
                elif cut is not None:
                    down = cut.take(down)
                    bias = None if bias is None else bias * (down.shape[1] / cut.size)
                factors[key] = (down, up, bias)
            side_path = LoraSidePath(child, factors)
            side_path.select(scales)
            if not switchable:  # the chosen factors are all it will run: no second copy of them
                side_path.factors = {}
            setattr(parent, leaf, side_path)


def fold_side_paths(model: nn.Module) -> int:
    """Every side path of ``model`` that folds (``LoraSidePath.folds``) folded, once its weights have loaded (before
    compilation); how many."""
    folding = [module for module in model.modules() if isinstance(module, LoraSidePath) and module.folds()]
    for side_path in folding:
        side_path.fold()
    return len(folding)


def select_adapters(model: nn.Module, scales: dict[str, float]) -> None:
    for module in model.modules():
        if isinstance(module, LoraSidePath):
            module.select(scales)
