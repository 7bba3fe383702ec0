"""A request's time on this server: its groups' fastest measured step, scaled by the planner's FLOP counts. It errs
high (2.3x for flux2-tiny on the CPU from 128x128 to 1024x1024, docs/benchmarks.md), hence ``ESTIMATE_MARGIN``."""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING

from paradit.families import find_facts

if TYPE_CHECKING:
    from paradit.family import Family
    from paradit.request import ResolvedRequest
    from paradit.spec import ModelSpec


class Pace:
    """Seconds per FLOP of this server's fastest step; without the planner's counts for it, nothing is refused."""

    def __init__(self, spec: ModelSpec, family: Family) -> None:
        self.spec, self._family, self._facts = spec, family, find_facts(spec)
        self._seconds_per_flop: float | None = None
        self._lock = threading.Lock()

    def _flops(self, request: ResolvedRequest) -> float:
        guided = self.spec.guidance_mode == "cfg" and self._family.uses_cfg(self.spec, request)
        workload = self._facts.workload(request.height, request.width, request.frames)
        return self._facts.step_flops(workload, request.batch * (2 if guided else 1))

    def record(self, requests: list[ResolvedRequest], step_ms: list[float]) -> None:
        if self._facts is not None and step_ms:
            pace = min(step_ms) / 1000 / sum(self._flops(request) for request in requests)
            with self._lock:
                self._seconds_per_flop = min(pace, self._seconds_per_flop or pace)

    def step_seconds(self, requests: list[ResolvedRequest]) -> float | None:
        """One denoise step of ``requests`` as one batch, at the fastest pace measured; None before any."""
        if self._facts is None or self._seconds_per_flop is None:
            return None
        return sum(self._flops(request) for request in requests) * self._seconds_per_flop
