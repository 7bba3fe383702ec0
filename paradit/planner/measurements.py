"""Measured step times (``measurements.json``, copied from docs/benchmarks.md): the one-GPU rows calibrate the cost
model's compute, the rows of several GPUs are what its predictions are checked against, and both mark tuned
configurations as measured."""

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
    """One benchmark invocation: where and when, and its commands by link."""

    id: str
    section: str
    date: str
    where: str
    commands: dict[str, str]

    def command(self, link: str | None) -> str:
        return self.commands.get(link or "", self.commands.get("any", next(iter(self.commands.values()))))


@dataclass(frozen=True)
class Measurement:
    run: Run
    model: str
    parallel: ParallelConfig
    precision: str
    execution: str  # eager, compiled (regional torch.compile), graphs (compiled + CUDA graphs)
    link: str | None  # None: one GPU, no link involved
    ms: float
    batch: int  # samples per step: 2 when both guidance branches ran
    superseded: str | None
    calibrates: str | None  # the profile figure derived from this row, which makes it in-sample

    def on(self, profile: HardwareProfile) -> bool:
        """Whether the measurement applies to ``profile``: its device, and its link unless no link was involved (the
        measurements name a link regime: NVLink, or PCIe-like with NCCL's peer access off)."""
        return profile.device in self.run.where and self.link in (None, "nvlink" if profile.peer_access else "p2p-off")


def parse_plan(text: str) -> ParallelConfig:
    """'ulysses=2,comm_dtype=fp8' -> ParallelConfig; '' is one GPU."""
    values = {}
    for item in filter(None, text.split(",")):
        key, value = item.split("=")
        values[key] = int(value) if key in _INT_FIELDS else value
    return ParallelConfig(**values)


@cache
def all_measurements() -> tuple[Measurement, ...]:
    rows = []
    for run_data in json.loads(MEASUREMENTS_FILE.read_text())["runs"]:
        run = Run(**{key: run_data[key] for key in ("id", "section", "date", "where", "commands")})
        rows += [
            Measurement(
                run,
                row["model"],
                parse_plan(row["plan"]),
                row["precision"],
                row["execution"],
                row["link"],
                row["ms"],
                row.get("batch", 1),
                row.get("superseded"),
                row.get("calibrates"),
            )
            for row in run_data["rows"]
        ]
    return tuple(rows)


def one_gpu_reference(
    model: str,
    precision: str,
    execution: str,
    profile: HardwareProfile,
    run: Run | None = None,
    batch: int | None = None,
) -> Measurement | None:
    """The latest current one-GPU measurement of ``model`` in that precision and execution on the profile's device
    (within ``run`` and at ``batch`` when given: one machine's figures of one workload compared with each other)."""
    found = [
        m
        for m in all_measurements()
        if m.model == model
        and m.parallel.world_size == 1
        and m.precision == precision
        and m.execution == execution
        and m.superseded is None
        and m.on(profile)
        and (run is None or m.run == run)
        and (batch is None or m.batch == batch)
    ]
    return found[-1] if found else None
