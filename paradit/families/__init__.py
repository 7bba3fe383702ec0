"""The registry of model families: the only place outside the family folders that names them.

A family is one folder: ``model.py`` (plain single-device math), ``pipeline.py`` (a ``DiffusionPipeline``),
``presets.py`` (published and tiny models, as data) and ``runtime.py`` (its tensor plan and the layers FP8 keeps in
high precision). Adding a family is one folder and one line in each table below. A checkpoint folder finds its family
by the pipeline class its ``model_index.json`` names; a preset by its ``family`` field.

The presets are light (no torch); the pipelines and runtime facts are imported on first use of ``FAMILIES``, so that
listing models and refusing bad flags answer at once.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from importlib import import_module
from pathlib import Path
from typing import TYPE_CHECKING

from paradit.errors import CheckpointError
from paradit.families.flux2.presets import FLUX2_PRESETS
from paradit.families.qwen_image.presets import QWEN_IMAGE_PRESETS
from paradit.families.sd3.presets import SD3_PRESETS
from paradit.families.wan.presets import WAN_PRESETS
from paradit.families.zimage.presets import ZIMAGE_PRESETS
from paradit.spec import ModelSpec

if TYPE_CHECKING:
    from paradit.parallel.tensor import TensorPlan
    from paradit.pipelines.base import DiffusionPipeline

# family -> (its folder's module path, its pipeline class)
PIPELINES = {
    "flux2": ("paradit.families.flux2", "Flux2Pipeline"),
    "qwen_image": ("paradit.families.qwen_image", "QwenImagePipeline"),
    "sd3": ("paradit.families.sd3", "SD3Pipeline"),
    "wan": ("paradit.families.wan", "WanPipeline"),
    "zimage": ("paradit.families.zimage", "ZImagePipeline"),
}
PRESETS: dict[str, ModelSpec] = {
    spec.name: spec for spec in [*FLUX2_PRESETS, *QWEN_IMAGE_PRESETS, *SD3_PRESETS, *WAN_PRESETS, *ZIMAGE_PRESETS]
}
DEFAULT_MODEL = "flux2-tiny"  # the demo's: a tiny random model that runs anywhere


@dataclass(frozen=True)
class Family:
    """A family's pipeline class (its hooks, ``spec_from_folder`` and the diffusers pipelines it serves) and its
    runtime facts."""

    pipeline: type[DiffusionPipeline]
    tensor_plan: TensorPlan | None
    keep_high_precision: tuple[str, ...]  # name fragments of the linears FP8 leaves in the model dtype


@functools.cache
def _registry() -> dict[str, Family]:
    families = {}
    for name, (package, pipeline_class) in PIPELINES.items():
        runtime = import_module(f"{package}.runtime")
        pipeline = getattr(import_module(f"{package}.pipeline"), pipeline_class)
        families[name] = Family(pipeline, runtime.TENSOR_PLAN, runtime.KEEP_HIGH_PRECISION)
    return families


def __getattr__(name: str):
    if name == "FAMILIES":  # family name -> Family, imported on first use
        return _registry()
    raise AttributeError(f"module 'paradit.families' has no attribute {name!r}")


def spec_from_folder(folder: Path, allow_pickle: bool = False) -> ModelSpec:
    """The ModelSpec of a diffusers checkpoint folder, by the pipeline class its ``model_index.json`` names, once
    every component it lists is there (and, unless ``allow_pickle``, in safetensors)."""
    from paradit.weights import check_components, read_json

    index = read_json(folder / "model_index.json")
    check_components(folder, index, allow_pickle)
    pipeline_class = index.get("_class_name")
    for family in _registry().values():
        if pipeline_class in family.pipeline.DIFFUSERS_PIPELINES:
            return family.pipeline.spec_from_folder(folder, index)
    served = ", ".join(name for family in _registry().values() for name in family.pipeline.DIFFUSERS_PIPELINES)
    raise CheckpointError(f"{folder} holds a {pipeline_class}; paradit serves {served}")
