"""Tuned configurations, as data in ``paradit/configs/<profile>.json`` (``benchmarks/tune_configs.py``)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import cache
from pathlib import Path

from paradit.parallel.config import ParallelConfig
from paradit.planner.cost import ms
from paradit.planner.plan import Request

CONFIGS_DIR = Path(__file__).resolve().parents[1] / "configs"
GPU_COUNTS = (1, 2, 4)


@dataclass(frozen=True)
class TunedEntry:
    preset: str
    gpus: int
    request: Request  # what it was planned for
    parallel: ParallelConfig | None = None
    quantize: str = "none"
    text_encoder_placement: str = "gpu"
    cuda_graphs: bool = False
    swap_experts: bool = False
    ms_per_step: float | None = None
    source: dict | None = None
    refused: str | None = None

    @property
    def measured(self) -> bool:
        return self.source is not None and self.source.get("kind") == "measured"

    def describe(self) -> str:
        if self.refused:
            return f"nothing fits: {self.refused}"
        settings = [
            self.parallel.describe(),
            "FP8" if self.quantize == "fp8" else "bf16",
            f"text encoders {self.text_encoder_placement}",
            *(["experts swapped"] if self.swap_experts else []),
            "CUDA graphs" if self.cuda_graphs else "no CUDA graphs",
        ]
        if self.measured:
            s = self.source
            figure = f'measured {s["ms_per_step"]:.1f} ms/step: docs/benchmarks.md "{s["section"]}", {s["date"]}'
        else:
            figure = f"predicted {ms(self.ms_per_step)} ms/step by the planner"
        return f"{', '.join(settings)} ({figure})"

    @classmethod
    def from_json(cls, data: dict) -> TunedEntry:
        parallel = ParallelConfig(**data["parallel"]) if "parallel" in data else None
        return cls(**{**data, "request": Request(**data["request"]), "parallel": parallel})


def config_file(profile: str) -> Path:
    return CONFIGS_DIR / f"{profile}.json"


@cache
def tuned_entries(profile: str) -> dict[tuple[str, int], TunedEntry]:
    path = config_file(profile)
    if not path.is_file():
        return {}
    entries = (TunedEntry.from_json(entry) for entry in json.loads(path.read_text())["entries"])
    return {(entry.preset, entry.gpus): entry for entry in entries}


def tuned_entry(preset: str, gpus: int, profile: str) -> TunedEntry | None:
    return tuned_entries(profile).get((preset, gpus))
