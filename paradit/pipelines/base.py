"""The denoise loop every family shares, and the clocks that time it without stalling the device.

Must not import torch.distributed.
"""

from __future__ import annotations

import resource
import sys
import time
from collections.abc import Callable

import torch
from tqdm import tqdm

from paradit.request import Timings

NoisePredictor = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


class StepClock:
    """Per-step durations. On accelerators it records events and reads them once at the end, so timing the loop
    adds no host synchronisation inside it; on the CPU the wall clock is the truth."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.use_events = device.type == "cuda"
        self.marks: list = []

    def mark(self) -> None:
        if self.use_events:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self.marks.append(event)
        else:
            self.marks.append(time.perf_counter())

    def durations_ms(self) -> list[float]:
        if self.use_events:
            self.marks[-1].synchronize()
            return [a.elapsed_time(b) for a, b in zip(self.marks, self.marks[1:])]
        return [(b - a) * 1000 for a, b in zip(self.marks, self.marks[1:])]


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def denoise(
    predict: NoisePredictor,
    scheduler,
    latents: torch.Tensor,
    timesteps: torch.Tensor,
    clock: StepClock,
    progress: bool,
) -> torch.Tensor:
    """Run the scheduler over ``timesteps``; ``predict(latents, t)`` returns the (guided) noise prediction."""
    clock.mark()
    for t in tqdm(timesteps, desc="denoise", unit="step", disable=not progress, file=sys.stderr, leave=False):
        latents = scheduler.step(predict(latents, t), t, latents, return_dict=False)[0]
        clock.mark()
    return latents


def reset_peak_memory(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def record_peak_memory(timings: Timings, device: torch.device) -> None:
    if device.type == "cuda":
        timings.peak_memory_bytes = torch.cuda.max_memory_allocated(device)
        timings.peak_memory_kind = "device"
    else:
        # ru_maxrss is KiB on Linux: the process's peak resident memory, the CPU's closest equivalent.
        timings.peak_memory_bytes = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        timings.peak_memory_kind = "process RSS"
