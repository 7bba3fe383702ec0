"""``paradit quantize``: write an FP8 checkpoint folder (the transformer quantized linear by linear as it loads, the
other components linked), and read back one written for a preset.

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

from paradit.checkpoint import component_dir, read_json
from paradit.errors import CheckpointError, InvalidRequest
from paradit.families import FAMILIES, PRESETS
from paradit.layers.fp8 import Fp8Linear
from paradit.loader import load_transformer
from paradit.quantize import CHECKPOINT_FORMAT, FP8_METHOD, fp8_checkpoint_layers
from paradit.spec import Fp8PresetFolder, ModelSpec
from paradit.weights import save_component

PRESET_FILE = "paradit_preset.json"  # in an FP8 folder written for a preset: which one (see write_fp8_checkpoint)


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
        for item in [entry for entry in Path(folder).iterdir() if entry.name != "transformer"]:
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
