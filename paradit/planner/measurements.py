"""Measured step times (from docs/benchmarks.md): one-GPU rows calibrate the cost model, the others check it."""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from functools import cache
from pathlib import Path

from paradit.parallel.config import ParallelConfig
from paradit.planner.profile import HardwareProfile

MEASUREMENTS_FILE = Path(__file__).with_name("measurements.json")
_INT_FIELDS = {f.name for f in fields(ParallelConfig) if f.type in ("int", int)}


@dataclass(frozen=True)
class Run:
    id: str
    section: str
    date: str
    where: str
    commands: dict[str, str]  # by link ("" where none), or "any"


@dataclass(frozen=True)
class Measurement:
    run: Run
    model: str
    parallel: ParallelConfig
    precision: str
    execution: str  # eager, compiled (regional torch.compile), graphs (compiled + CUDA graphs)
    link: str | None  # None: one GPU, no link involved
    ms: float
    batch: int = 1  # samples per step: 2 when both guidance branches ran
    superseded: str | None = None
    calibrates: str | None = None  # the profile figure derived from this row, which makes it in-sample

    def on(self, profile: HardwareProfile) -> bool:
        """Its device, and its link regime unless none was involved (NVLink, or PCIe-like with NCCL's P2P off)."""
        return profile.device in self.run.where and self.link in (None, "nvlink" if profile.peer_access else "p2p-off")


def parse_plan(text: str) -> ParallelConfig:
    """'ulysses=2,comm_dtype=fp8' -> ParallelConfig; '' is one GPU."""
    pairs = (item.split("=") for item in filter(None, text.split(",")))
    return ParallelConfig(**{key: int(value) if key in _INT_FIELDS else value for key, value in pairs})


@cache
def all_measurements() -> tuple[Measurement, ...]:
    rows = []
    for data in json.loads(MEASUREMENTS_FILE.read_text())["runs"]:
        run = Run(**{key: value for key, value in data.items() if key != "rows"})
        rows += [Measurement(run, parallel=parse_plan(row.pop("plan")), **row) for row in data["rows"]]
    return tuple(rows)


def one_gpu_reference(
    model: str,
    precision: str,
    execution: str,
    profile: HardwareProfile,
    run: Run | None = None,
    batch: int | None = None,
) -> Measurement | None:
    """The latest current one-GPU measurement of ``model`` on the profile's device (within ``run`` and at ``batch``)."""
    wanted = (model, 1, precision, execution, None)
    found = (
        m
        for m in reversed(all_measurements())
        if (m.model, m.parallel.world_size, m.precision, m.execution, m.superseded) == wanted
        and m.on(profile)
        and run in (None, m.run)
        and batch in (None, m.batch)
    )
    return next(found, None)
