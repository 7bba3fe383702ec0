"""The device's side of memory: the allocator, free memory, out-of-memory errors; the estimate is ``memory.py``'s."""

from __future__ import annotations

import gc
import os
import re
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

import torch

from paradit.errors import OutOfMemory

ALLOCATOR_VARIABLES = ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_HIP_ALLOC_CONF")
EXPANDABLE_SEGMENTS = "expandable_segments:True"
# Held outside PyTorch's allocator (the CUDA or HIP context, its kernels): benchmarks/gpu_checks.py measured it.
OUTSIDE_ALLOCATOR_BYTES = 2**30

Result = TypeVar("Result")


@dataclass(frozen=True)
class MemoryBudget:
    """What rank 0 was planned to hold (None: no plan was made), for an out-of-memory error's line."""

    estimate: int | None = None
    limit: str = ""
    advice: str = ""


def configure_allocator(device: torch.device) -> None:
    """Expandable segments unless configured: fixed ones failed Wan 2.2 720p at 32 GiB (docs/benchmarks.md)."""
    if device.type != "cuda" or any(os.environ.get(name) for name in ALLOCATOR_VARIABLES):
        return
    setter = getattr(torch._C, "_accelerator_setAllocatorSettings", None) or torch.cuda.memory._set_allocator_settings
    with warnings.catch_warnings(action="ignore"):  # a build without them says so once and keeps fixed segments
        setter(EXPANDABLE_SEGMENTS)


def hold_to_cap(device: torch.device, cap: int | None) -> None:
    """Make the caching allocator refuse to grow past ``cap``; None lifts the cap an earlier engine may have set."""
    if device.type == "cuda":
        index = torch.cuda.current_device() if device.index is None else device.index  # "cuda" names no index
        total = torch.cuda.get_device_properties(index).total_memory
        torch.cuda.set_per_process_memory_fraction(1.0 if cap is None else min(1.0, cap / total), index)


def free_memory(index: int) -> int:
    """Bytes of GPU ``index`` a new process can give its allocator, through NVML where it can (not a CUDA context)."""
    total = torch.cuda.get_device_properties(index).total_memory
    try:
        free = total - torch.cuda.device_memory_used(index)
    except Exception:  # noqa: BLE001 - no pynvml or amdsmi, or it cannot read the device: ask the runtime
        free = torch.cuda.mem_get_info(index)[0]
    return max(0, free - OUTSIDE_ALLOCATOR_BYTES)


def release_cached(device: torch.device) -> None:
    gc.collect()
    unmap_free(device)


def unmap_free(device: torch.device) -> None:
    """Give the device back the memory no tensor holds, between phases of a request (lowers the peak a cap bounds)."""
    if device.type == "cuda":
        torch.cuda.empty_cache()


def reporting_out_of_memory(
    call: Callable[[], Result], stage: Callable[[], str], device: torch.device, budget: MemoryBudget
) -> Result:
    """``call()``, its device out-of-memory error raised as ``OutOfMemory``'s one line once its tensors are freed."""
    gib = 2**30
    try:
        return call()
    except torch.OutOfMemoryError as exc:
        tried = re.search(r"[Tt]ried to allocate ([0-9.]+ [KMGT]?i?B)", str(exc))
        figures = [f"{tried[1]} more was asked for"] if tried else []
        if device.type == "cuda":
            held, peak = torch.cuda.memory_reserved(device), torch.cuda.max_memory_reserved(device)
            figures.append(f"{held / gib:.1f} GiB was held by PyTorch (peak {peak / gib:.1f} GiB)")
        if budget.estimate is not None:
            figures.append(f"against the plan's {budget.estimate / gib:.1f} GiB for {budget.limit}")
        line = f"out of memory on {device} {stage()}: {', '.join(figures) or exc}"
        error = OutOfMemory(line + (f"; to need less: {budget.advice}" if budget.advice else ""))
    # Past the except block the failed frames (and their tensors) are gone.
    release_cached(device)
    raise error
