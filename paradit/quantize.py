"""Swap a model's linear layers for FP8 ones, from outside the model (its file never knows), and paradit's FP8
checkpoints: a diffusers-layout transformer component whose quantized linears hold an FP8 ``weight`` and a float32
``weight_scale`` (one per output channel), marked in its ``config.json`` by a ``quantization_config`` that names
the method (``paradit-fp8``), the format (``float8_e4m3fn``) and the layers. diffusers refuses the unknown method
rather than reading FP8 bytes as weights.

Converting and saving run anywhere (the CPU included); only executing FP8 needs a GPU (``check_fp8_supported``).

Which layers stay in bf16 is a measured choice, not a guess: the embedders, the timestep/guidance MLPs, the
modulation projections and the output projection are a small share of the FLOPs but feed every block (modulation)
or the final prediction directly, so their error is not averaged away; the benchmark reports the resulting error.

Must not import torch.distributed.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
from pathlib import Path

import torch
from torch import nn

from paradit.errors import CheckpointError, InvalidRequest
from paradit.layers.fp8 import Fp8Linear, check_fp8_supported, fp8_dtype
from paradit.spec import Fp8PresetFolder, ModelSpec
from paradit.weights import Fp8Load, ModelNames, component_dir, read_json, save_component

FP8_METHOD = "paradit-fp8"
CHECKPOINT_FORMAT = torch.float8_e4m3fn  # OCP e4m3, what every FP8 GPU but MI300 multiplies natively
PRESET_FILE = "paradit_preset.json"  # in an FP8 folder written for a preset: which one (see write_fp8_checkpoint)


def quantizable(name: str, module: nn.Module, keep: tuple[str, ...]) -> bool:
    """Linear layers whose name holds none of the family's ``keep`` fragments (its embedders, modulation and output
    layers), and whose dimensions the FP8 GEMM accepts (multiples of 16)."""
    return (
        isinstance(module, nn.Linear)
        and not any(fragment in name for fragment in keep)
        and module.in_features % 16 == 0
        and module.out_features % 16 == 0
    )


@torch.no_grad()
def convert_fp8(model: nn.Module, dtype: torch.dtype, keep: tuple[str, ...]) -> list[str]:
    """Replace the quantizable linears of ``model`` with ``dtype`` ones, one at a time, so that at most one layer's
    high-precision weight exists beside the FP8 copies; returns the names replaced."""
    replaced = []
    for name, module in list(model.named_modules()):
        if quantizable(name, module, keep):
            owner_name, _, leaf = name.rpartition(".")
            owner = model.get_submodule(owner_name) if owner_name else model
            setattr(owner, leaf, Fp8Linear.from_linear(module, dtype))
            replaced.append(name)
    return replaced


def quantize_fp8(model: nn.Module, device: torch.device, keep: tuple[str, ...]) -> list[str]:
    """``convert_fp8`` into the format ``device`` multiplies, where it can (a loaded model, for benchmarks)."""
    check_fp8_supported(device)
    return convert_fp8(model, fp8_dtype(device), keep)


def fp8_checkpoint_layers(config: dict) -> list[str] | None:
    """The FP8 linears a transformer ``config.json`` declares (None for a high-precision checkpoint)."""
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


def fp8_load(model: nn.Module, names: ModelNames, config: dict, quantize: str, dtype: torch.dtype,
             keep: tuple[str, ...]) -> Fp8Load | None:  # fmt: skip
    """The linears of the (parallelized, still meta) ``model`` to load as ``dtype`` FP8, by ``names`` (of the plain
    model): those of an FP8 checkpoint (``config`` declares them), else with ``quantize="fp8"`` the quantizable ones
    (``keep``: the family's high-precision fragments) at their sharded sizes. None when nothing loads as FP8."""
    layers = fp8_checkpoint_layers(config)
    if layers is None and quantize != "fp8":
        return None
    modules = {}
    for module in model.modules():
        name = names.module(module)
        if not isinstance(module, nn.Linear) or name is None:
            continue
        if layers is None:
            if quantizable(name, module, keep):
                modules[id(module)] = name
        elif name in layers:
            if module.in_features % 16 or module.out_features % 16:
                raise InvalidRequest(
                    f"FP8 layer {name} holds {module.out_features} x {module.in_features} features here, which the "
                    "FP8 GEMM does not take (multiples of 16); choose a smaller tensor degree"
                )
            modules[id(module)] = name
    return Fp8Load(modules, dtype, frozenset(f"{name}.weight_scale" for name in layers or ()))


def save_fp8_transformer(model: nn.Module, config: dict, folder: Path, max_shard_bytes: int = 5 * 2**30) -> None:
    """Write the plain (unsharded) ``model``, whose FP8 linears are ``Fp8Linear`` in ``CHECKPOINT_FORMAT``, as a
    diffusers-layout component: ``config`` plus the FP8 marker, safetensors shards and their index."""
    layers = [name for name, module in model.named_modules() if isinstance(module, Fp8Linear)]
    formats = {model.get_submodule(name).weight.dtype for name in layers}
    if formats - {CHECKPOINT_FORMAT}:
        raise ValueError(
            f"FP8 checkpoints hold {CHECKPOINT_FORMAT}; this model's linears are {sorted(map(str, formats))}"
        )
    marker = {
        "quant_method": FP8_METHOD,
        "format": str(CHECKPOINT_FORMAT).removeprefix("torch."),
        "weight_scale": "float32 (out_features, 1): weight = fp8 * scale, row by row",
        "modules": layers,
    }
    save_component(model.state_dict(), {**config, "quantization_config": marker}, folder, max_shard_bytes)


def write_fp8_checkpoint(spec: ModelSpec, out: Path, dtype: torch.dtype) -> list[str]:
    """Quantize ``spec``'s transformer on the CPU, linear by linear as it loads, and write an FP8 checkpoint folder at
    ``out``; returns the FP8 layers. A checkpoint folder's other components are hard-linked (copied across file
    systems), so ``out`` is a complete diffusers-layout folder. A preset without one (random weights) gets its
    transformer component and ``PRESET_FILE`` naming the preset, whose prompt encoders and VAE paradit then draws at
    random: a full-size FP8 load path for benchmarks without the real weights. ``dtype``: the layers kept in high
    precision."""
    from paradit.families import FAMILIES, PRESETS
    from paradit.loader import load_transformer

    if out.exists() and any(out.iterdir()):
        raise InvalidRequest(f"{out} is not empty; give a new folder for the FP8 checkpoint")
    folder = spec.folder
    if folder is None and spec.name not in PRESETS:
        raise InvalidRequest(
            f"random weights are quantized for presets only; {spec.name} is quantized from its weights"
        )
    model = load_transformer(FAMILIES[spec.family], spec, torch.device("cpu"), dtype, quantize="fp8").model
    save_fp8_transformer(model, spec.transformer, out / "transformer")
    if folder is None:
        (out / PRESET_FILE).write_text(json.dumps({"preset": spec.name}, indent=2) + "\n")
    else:
        for item in Path(folder).iterdir():
            if item.name == "transformer":
                continue
            if item.is_dir():
                shutil.copytree(item, out / item.name, copy_function=_link_or_copy)
            else:
                _link_or_copy(item, out / item.name)
    return fp8_checkpoint_layers(read_json(out / "transformer" / "config.json"))


def _link_or_copy(source: str | Path, target: str | Path) -> None:
    try:
        os.link(source, target)  # follows the hub cache's symlinks to the blob itself
    except OSError:
        shutil.copy2(source, target)


def spec_with_fp8_transformer(folder: Path) -> ModelSpec:
    """The spec of a folder ``write_fp8_checkpoint`` wrote for a preset: the preset, with its transformer read from
    the folder's FP8 component and everything else random."""
    from paradit.families import PRESETS

    preset = read_json(folder / PRESET_FILE).get("preset")
    if preset not in PRESETS:
        raise CheckpointError(f"{folder / PRESET_FILE} names preset {preset!r}; the presets: {', '.join(PRESETS)}")
    spec = PRESETS[preset]
    return dataclasses.replace(
        spec,
        name=str(folder),
        description=f"{spec.description}; FP8 transformer from {folder}, the rest random",
        transformer=read_json(component_dir(folder, "transformer") / "config.json"),
        weights=Fp8PresetFolder(folder / "transformer"),
    )
