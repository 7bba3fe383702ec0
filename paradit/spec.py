"""``ModelSpec``: everything the engine needs to know about one model, from a preset or a checkpoint folder."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from paradit.checkpoint import component_config, safetensors_files

GuidanceMode = Literal["embedded", "cfg", "none"]


def read_configs(module_file: str, name: str = "configs.json") -> dict[str, Any]:
    """The configs and ``presets`` beside a preset module; a ``_changes`` key holds only what it changes of another."""
    return json.loads(Path(module_file).with_name(name).read_text())


@dataclass(frozen=True)
class TextEncoderSpec:
    """A transformers decoder (its ``config``), read as the hidden states of ``layers`` concatenated per token."""

    config: dict[str, Any]
    layers: tuple[int, ...]
    max_length: int = 512
    class_name: str | None = None  # a checkpoint's transformers class (model_index.json); None: random weights


@dataclass(frozen=True)
class CheckpointFolder:
    """Every component read from a diffusers-layout folder; pickle weights only if ``allow_pickle`` (--allow-pickle)."""

    path: Path
    allow_pickle: bool = False

    def use_safetensors(self, component: str) -> bool:
        """``from_pretrained``'s keyword for ``component``, whose default would fall back to pickle weights."""
        return safetensors_files(self.path / component, self.allow_pickle)[0].suffix == ".safetensors"


@dataclass(frozen=True)
class RandomWeights:
    """Seeded random weights."""


@dataclass(frozen=True)
class Fp8PresetFolder:
    """A folder ``paradit quantize`` wrote for a preset: its FP8 transformer from ``transformer``, the rest random."""

    transformer: Path


WeightSource = CheckpointFolder | RandomWeights | Fp8PresetFolder


@dataclass(frozen=True)
class ModelSpec:
    name: str
    family: str
    description: str
    transformer: dict[str, Any]
    text_encoder: Any  # the family's own description of its prompt encoder(s)
    vae: dict[str, Any]
    scheduler: dict[str, Any]
    guidance_mode: GuidanceMode
    steps: int
    guidance: float | None
    height: int
    width: int
    hub_id: str | None = None
    weights: WeightSource = RandomWeights()
    frames: int | None = None  # a video model's default frames per video (None: the model makes images)
    fps: int | None = None  # a video model's default frame rate of the written file
    guidance_2: float | None = None  # a model with further experts: the low-noise expert's default guidance
    experts: dict[str, dict[str, Any]] = field(default_factory=dict)  # further transformers: component -> config
    details: Any = None  # what only the family reads (its own frozen dataclass)

    @property
    def folder(self) -> Path | None:
        """Where the prompt encoders and the VAE are read from (None: they are random)."""
        return self.weights.path if isinstance(self.weights, CheckpointFolder) else None

    @property
    def attention_heads(self) -> int:
        return int(self.transformer.get("num_attention_heads") or self.transformer["n_heads"])


def checkpoint_spec(folder: Path, index: dict, family: str, detail: str | None = None, **fields) -> ModelSpec:
    """A checkpoint folder's ModelSpec: ``fields`` as the family reads them, other configs as the folder holds them."""
    read = {name: component_config(folder, name) for name in ("transformer", "vae", "scheduler") if name not in fields}
    description = f"{index['_class_name']} checkpoint" + (f" ({detail})" if detail else "")
    return ModelSpec(str(folder), family, description, weights=CheckpointFolder(folder), **read, **fields)
