"""The registry of model families. The presets are light (no torch); the family records are imported on first use of
``FAMILIES``, so that listing models and refusing bad flags answer at once."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Collection
from importlib import import_module
from pathlib import Path
from typing import TYPE_CHECKING

from paradit.checkpoint import check_components, index_file, read_json
from paradit.errors import CheckpointError
from paradit.spec import CheckpointFolder, ModelSpec

if TYPE_CHECKING:
    from paradit.family import Family
    from paradit.planner.facts import ModelFacts

PACKAGES = (
    "paradit.families.flux2",
    "paradit.families.flux3",
    "paradit.families.qwen_image",
    "paradit.families.qwen_image21",
    "paradit.families.sd3",
    "paradit.families.wan",
    "paradit.families.zimage",
)
PRESETS: dict[str, ModelSpec] = {
    spec.name: spec for package in PACKAGES for spec in import_module(f"{package}.presets").PRESETS
}


@functools.cache
def _registry() -> dict[str, Family]:
    records = [import_module(f"{package}.family").FAMILY for package in PACKAGES]
    return {family.name: family for family in records}


def __getattr__(name: str):
    if name == "FAMILIES":  # family name -> Family, imported on first use
        return _registry()
    raise AttributeError(f"module 'paradit.families' has no attribute {name!r}")


def spec_from_folder(folder: Path, allow_pickle: bool = False) -> ModelSpec:
    index = read_json(index_file(folder))
    check_components(folder, index, allow_pickle)
    pipeline_class = index.get("_class_name")
    for family in _registry().values():
        if pipeline_class in family.diffusers_pipelines:
            spec = family.read_checkpoint(folder, index)
            return dataclasses.replace(spec, weights=CheckpointFolder(folder, allow_pickle))
    served = ", ".join(name for family in _registry().values() for name in family.diffusers_pipelines)
    raise CheckpointError(f"{folder} holds a {pipeline_class}; paradit serves {served}")


def measured_preset(spec: ModelSpec, measured: Collection[str]) -> str | None:
    """Of the presets ``measured`` names, ``spec``'s own, else the first of its family whose settings it all shares."""
    if spec.name in measured:
        return spec.name
    for name in measured:
        preset = PRESETS.get(name)
        if preset is not None and preset.family == spec.family:
            if all(spec.transformer.get(key) == value for key, value in preset.transformer.items()):
                return name
    return None


def find_facts(spec: ModelSpec) -> ModelFacts | None:
    """The planner's counts of ``spec``'s transformer (its ``measured_preset``'s); None where none was counted."""
    counted = _registry()[spec.family].measured.model_facts
    preset = measured_preset(spec, counted)
    return None if preset is None else counted[preset]
