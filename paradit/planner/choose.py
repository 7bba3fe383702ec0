"""What ``--gpus N`` alone runs: the tuned entry for the request, else the planner's (None: GPU or model unknown)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from paradit.errors import InvalidRequest
from paradit.families import find_facts
from paradit.parallel.config import ParallelConfig
from paradit.planner.cost import ms
from paradit.planner.plan import plan, request_for
from paradit.planner.profile import HardwareProfile, detect_profile
from paradit.planner.tuned import tuned_entry
from paradit.request import GenerationRequest
from paradit.spec import ModelSpec


@dataclass(frozen=True)
class PlannedSettings:
    parallel: ParallelConfig
    quantize: str
    text_encoder_placement: str
    cuda_graphs: bool
    origin: str  # a line saying where they come from
    swap_experts: bool = False


def settings_for(
    spec: ModelSpec,
    gpus: int,
    request: GenerationRequest | None = None,
    device: str | torch.device | None = None,
    profile: HardwareProfile | None = None,
) -> PlannedSettings | None:
    if device is not None and torch.device(device).type == "cpu":
        return None
    profile = profile or detect_profile(gpus)
    if profile is None or find_facts(spec) is None:  # an architecture the planner has not counted: the default
        return None
    wanted = request_for(spec, request)
    entry = tuned_entry(spec.name, gpus, profile.name)
    if entry is not None and entry.request == wanted:
        if entry.refused:
            raise InvalidRequest(entry.refused)
        origin = f"tuned configuration for {spec.name} on {gpus} x {profile.name}: {entry.describe()}"
        return PlannedSettings(
            entry.parallel, entry.quantize, entry.text_encoder_placement, entry.cuda_graphs, origin, entry.swap_experts
        )
    best = plan(spec, gpus, profile, request).best
    origin = (
        f"planned for this request on {gpus} x {profile.name}: {best.describe()}, text encoders {best.placement}, "
        f"{'CUDA graphs' if best.cuda_graphs else 'no CUDA graphs'} (predicted {ms(best.mean_ms)} ms/step)"
    )
    return PlannedSettings(
        best.parallel, "fp8" if best.fp8 else "none", best.placement, best.cuda_graphs, origin, best.swap_experts
    )
