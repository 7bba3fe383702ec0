"""FP8 linears swapped in from outside the model, and reading paradit's own FP8 checkpoints (diffusers refuses them)."""

from __future__ import annotations

import torch
from torch import nn

from paradit.errors import CheckpointError, InvalidRequest
from paradit.layers.fp8 import Fp8Linear
from paradit.weights import Fp8Load, ModelNames

FP8_METHOD = "paradit-fp8"
CHECKPOINT_FORMAT = torch.float8_e4m3fn  # OCP e4m3, what every FP8 GPU but MI300 multiplies natively


# The families' ``keep`` (embedders, timestep MLPs, modulation, output) are few FLOPs but feed every block or the
# prediction directly, so their FP8 error is not averaged away: a measured choice.
def quantizable(name: str, module: nn.Module, keep: tuple[str, ...]) -> bool:
    """A linear whose name holds none of the family's ``keep`` fragments, of dimensions the FP8 GEMM takes."""
    if not isinstance(module, nn.Linear) or module.in_features % 16 or module.out_features % 16:
        return False
    return not any(fragment in name for fragment in keep)


def converts_to_fp8(encoder: nn.Module, name: str, module: nn.Module) -> bool:
    """A prompt encoder's linear ``quantizable`` accepts, unless transformers keeps it in float32 for precision (T5's
    ``wo``)."""
    keep = getattr(encoder, "_keep_in_fp32_modules", None) or ()
    return quantizable(name, module, keep=()) and not any(part in keep for part in name.split("."))


@torch.no_grad()
def convert_fp8(model: nn.Module, dtype: torch.dtype, keep: tuple[str, ...]) -> list[str]:
    """The quantizable linears replaced one at a time (one high-precision weight beside the FP8 copies); their names."""
    replaced = []
    for name, module in list(model.named_modules()):
        if quantizable(name, module, keep):
            model.set_submodule(name, Fp8Linear.from_linear(module, dtype))
            replaced.append(name)
    return replaced


def fp8_checkpoint_layers(config: dict) -> list[str] | None:
    quantization = config.get("quantization_config")
    if quantization is None:
        return None
    method = quantization.get("quant_method")
    if method != FP8_METHOD or quantization.get("format") != str(CHECKPOINT_FORMAT).removeprefix("torch."):
        raise CheckpointError(
            f"the transformer is quantized with {method!r} ({quantization.get('format')}); paradit loads "
            f"high-precision checkpoints and its own {FP8_METHOD!r} (float8_e4m3fn) ones"
        )
    return list(quantization["modules"])


def fp8_load(
    model: nn.Module, names: ModelNames, config: dict, quantize: str, dtype: torch.dtype, keep: tuple[str, ...]
) -> Fp8Load | None:
    """The parallelized meta ``model``'s linears to load as FP8 (an FP8 checkpoint's or the quantizable), or None."""
    layers = fp8_checkpoint_layers(config)
    if layers is None and quantize != "fp8":
        return None
    modules = {}
    for module in model.modules():
        name = names.module(module)
        if not isinstance(module, nn.Linear) or name is None:
            continue
        if layers is not None and name in layers and not quantizable(name, module, keep=()):
            raise InvalidRequest(
                f"FP8 layer {name} holds {module.out_features} x {module.in_features} features here, which the "
                "FP8 GEMM does not take (multiples of 16); choose a smaller tensor degree"
            )
        wanted = quantizable(name, module, keep) if layers is None else name in layers
        if wanted:
            modules[id(module)] = name
    return Fp8Load(modules, dtype, frozenset(f"{name}.weight_scale" for name in layers or ()))
