"""``ModelSpec``: everything the engine needs to know about one model, from a preset or a checkpoint folder.

Must not import torch.distributed.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

GuidanceMode = Literal["embedded", "cfg", "none"]


@dataclass(frozen=True)
class ModelSpec:
    """Everything the engine needs to know about one model: its architecture, components and defaults.

    Presets are ModelSpecs; a checkpoint folder yields one too (its configs read from the folder).
    """

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
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def attention_heads(self) -> int:
        config = self.transformer
        return int(config["num_attention_heads"] if "num_attention_heads" in config else config["n_heads"])
