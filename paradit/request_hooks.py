"""Per-request features as hooks of the denoise loop, so that ``DiffusionPipeline.generate`` stays the skeleton."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from paradit.request import ResolvedRequest


@dataclass
class Denoise:
    """A batch's denoise loop before its first step (a hook may replace where it starts); ``guided``: [cond; uncond]."""

    requests: list[ResolvedRequest]
    request: ResolvedRequest
    guided: bool
    latents: torch.Tensor
    layout: Any
    scheduler: Any
    timesteps: torch.Tensor
    features: dict[str, Any]


class RequestHook:
    """A per-request feature. Each call does nothing unless the feature needs it."""

    def begin_request(self, request: ResolvedRequest) -> None:
        """Before the request's first work, ahead of its clock and of its peak memory's reset."""

    def begin_denoise(self, denoise: Denoise) -> None:
        """Once the schedule is set, before the first step."""

    def at_step(self, done: int, steps: int) -> None:
        """When ``done`` of the ``steps`` steps are done: 0 before the first step, ``steps`` after the last."""
