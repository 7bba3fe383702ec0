"""Pipelines, one per model family: prompt encoding, latents, the denoise loop, decoding.

Pipelines reach other ranks only through the parallel runtime's ``ParallelContext`` and guidance branches.
``FAMILIES`` is the registry the engine and the workers dispatch on.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from paradit.errors import CheckpointError
from paradit.pipelines import flux2, qwen_image, sd3, zimage
from paradit.spec import ModelSpec
from paradit.weights import read_json


@dataclass(frozen=True)
class Family:
    """What the engine needs from a family: its pipeline class (``load`` / ``generate``), the request check that
    runs before anything loads, how a checkpoint folder becomes a ModelSpec, and the diffusers pipelines it serves."""

    pipeline: type
    resolve_request: Callable
    spec_from_folder: Callable[[Path, dict], ModelSpec]
    diffusers_pipelines: tuple[str, ...]


FAMILIES: dict[str, Family] = {
    "flux2": Family(flux2.Flux2Pipeline, flux2.resolve_request, flux2.spec_from_folder, flux2.PIPELINE_CLASSES),
    "zimage": Family(zimage.ZImagePipeline, zimage.resolve_request, zimage.spec_from_folder, zimage.PIPELINE_CLASSES),
    "sd3": Family(sd3.SD3Pipeline, sd3.resolve_request, sd3.spec_from_folder, sd3.PIPELINE_CLASSES),
    "qwen_image": Family(
        qwen_image.QwenImagePipeline,
        qwen_image.resolve_request,
        qwen_image.spec_from_folder,
        qwen_image.PIPELINE_CLASSES,
    ),
}


def spec_from_folder(folder: Path) -> ModelSpec:
    """The ModelSpec of a diffusers checkpoint folder, by the pipeline class its ``model_index.json`` names."""
    index = read_json(folder / "model_index.json")
    pipeline_class = index.get("_class_name")
    for family in FAMILIES.values():
        if pipeline_class in family.diffusers_pipelines:
            return family.spec_from_folder(folder, index)
    served = ", ".join(name for family in FAMILIES.values() for name in family.diffusers_pipelines)
    raise CheckpointError(f"{folder} holds a {pipeline_class}; paradit serves {served}")
