"""``paradit quantize``: write an FP8 checkpoint folder, and read back one written for a preset."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
from pathlib import Path

import torch
from safetensors import SafetensorError

from paradit.checkpoint import component_dir, read_json
from paradit.download import checkpoint_bytes, human_size
from paradit.errors import CheckpointError, InvalidRequest
from paradit.families import FAMILIES, PRESETS
from paradit.layers.fp8 import Fp8Linear
from paradit.options import ExecutionOptions
from paradit.outputs import replaced, writable_folder
from paradit.quantize import CHECKPOINT_FORMAT, FP8_METHOD, convert_fp8
from paradit.spec import Fp8PresetFolder, ModelSpec
from paradit.weights import save_component

PRESET_FILE = "paradit_preset.json"  # in an FP8 folder written for a preset: which one


def write_fp8_checkpoint(spec: ModelSpec, out: Path, dtype: torch.dtype) -> list[str]:
    """``spec``'s transformer quantized on the CPU, the rest hard-linked (random weights: ``PRESET_FILE`` names it)."""
    # The runtime, imported where a transformer is converted: settling a run, which reads FP8 folders, stays light.
    from paradit.runtime import load_transformer

    folder = spec.folder
    if folder is None and spec.name not in PRESETS:
        raise InvalidRequest(
            f"random weights are quantized for presets only; {spec.name} is quantized from its weights"
        )
    check_out(out, spec, dtype)
    options = ExecutionOptions(quantize="fp8")
    model = load_transformer(FAMILIES[spec.family], spec, torch.device("cpu"), dtype, options=options).model
    layers = [name for name, module in model.named_modules() if isinstance(module, Fp8Linear)]  # CPU: e4m3fn
    marker = {
        "quant_method": FP8_METHOD,
        "format": str(CHECKPOINT_FORMAT).removeprefix("torch."),
        "modules": layers,
        "weight_scale": "float32 (out_features, 1): weight = fp8 * scale, row by row",
    }
    config = {**spec.transformer, "quantization_config": marker}
    with replaced(out, (OSError, SafetensorError)) as staging:
        save_component(model.state_dict(), config, staging / "transformer", max_shard_bytes=5 * 2**30)
        if folder is None:
            (staging / PRESET_FILE).write_text(json.dumps({"preset": spec.name}, indent=2) + "\n")
        else:  # file by file, so that a failure is the file's own (copytree's gathers them all)
            for item in sorted(p for p in folder.rglob("*") if p.relative_to(folder).parts[0] != "transformer"):
                target = staging / item.relative_to(folder)
                if item.is_dir():
                    target.mkdir()
                    continue
                try:
                    os.link(item, target)  # follows the hub cache's symlinks to the blob itself
                except OSError:  # another file system: copied
                    shutil.copy2(item, target)
    return layers


def check_out(out: Path, spec: ModelSpec | None = None, dtype: torch.dtype = torch.bfloat16) -> None:
    """``--out`` before any work: a new (or empty) folder paradit can write in; with ``spec``, outside the checkpoint,
    on a disk with room for the FP8 transformer (and copies of the rest where it cannot link them)."""
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise InvalidRequest(f"--out {out} {'is not empty' if out.is_dir() else 'is a file'}; give a new folder")
    disk = writable_folder("--out", out, out.parent)  # where it is written, to be renamed
    if spec is None:
        return
    source = spec.folder
    if source is not None and out.resolve().is_relative_to(source.resolve()):
        raise InvalidRequest(f"--out {out} is inside the checkpoint it quantizes; give a folder outside {source}")
    family = FAMILIES[spec.family]
    with torch.device("meta"):  # the transformer converted as it will be, without its memory
        model = family.build_transformer(spec).to(dtype)
    convert_fp8(model, CHECKPOINT_FORMAT, family.keep_high_precision)
    needed = sum(tensor.nbytes for tensor in model.state_dict().values())
    if source is not None and os.stat(source).st_dev != os.stat(disk).st_dev:
        needed += checkpoint_bytes(source) - checkpoint_bytes(source / "transformer")
    if needed > (free := shutil.disk_usage(disk).free):
        raise InvalidRequest(f"--out {out} needs {human_size(needed)}; {disk} has {human_size(free)} free")


def spec_with_fp8_transformer(folder: Path) -> ModelSpec:
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
