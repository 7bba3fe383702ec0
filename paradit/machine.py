"""What ``settle`` needs to know of the hardware a run is settled for: how many GPUs there are, their hardware profile,
their free memory, and whether they run FP8. ``Machine.detect()`` asks this machine; ``Machine.of_profile`` is GPUs of
a hardware profile, which ``paradit plan --profile`` predicts for on any machine (the CPU included), through the same
``settle`` that ``generate`` runs."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from paradit.device_memory import free_memory
from paradit.errors import InvalidRequest
from paradit.planner.profile import HardwareProfile, detect_profile


@dataclass(frozen=True)
class Machine:
    """``gpus``: the GPUs visible (0: none); ``profile``: theirs, as the planner knows it (None: none known);
    ``virtual``: GPUs of ``profile`` that are not here (``paradit plan --profile``), whose free memory is the
    profile's memory and whose FP8 support its rates say."""

    gpus: int
    profile: HardwareProfile | None = None
    virtual: bool = False

    @classmethod
    def detect(cls) -> Machine:
        return cls(torch.cuda.device_count() if torch.cuda.is_available() else 0)

    @classmethod
    def of_profile(cls, profile: HardwareProfile, gpus: int) -> Machine:
        return cls(gpus, profile, virtual=True)

    def profile_for(self, gpus: int) -> HardwareProfile | None:
        """The profile of a group of ``gpus`` of these GPUs (on this machine: detected, the links by peer access)."""
        return self.profile if self.virtual else detect_profile(gpus)

    def free_memory(self, index: int) -> int:
        """Bytes GPU ``index`` can give a run's allocator (``device_memory.free_memory``)."""
        if self.virtual:  # the profile's memory, as the planner counts it
            return self.profile.memory_bytes
        return free_memory(index)

    def memory_words(self, free: int, index: int) -> str:
        """What a plan made for ``free`` bytes of GPU ``index`` was made for, in words."""
        where = f"an {self.profile.name} GPU" if self.virtual else f"GPU {index}"
        return f"the {free / 2**30:.1f} GiB free on {where}"

    def check_fp8(self, device: torch.device) -> None:
        """Refuse FP8 linears where the device has no FP8 matrix kernels, naming what would run."""
        if not self.virtual:
            from paradit.layers.fp8 import check_fp8_supported

            check_fp8_supported(device)
        elif device.type != "cuda" or "fp8" not in self.profile.matmul_tflops:
            raise InvalidRequest(f"{self.profile.name} has no FP8 matrix kernels; run without --quantize fp8 (bf16)")

    def check_fp8_attention(self, device: torch.device) -> None:
        """Refuse the FP8 attention kernel where it cannot run, naming what would."""
        if not self.virtual:
            from paradit.layers.fp8_attention import check_fp8_attention  # imports Triton: only runs that use it

            check_fp8_attention(device)
        elif device.type != "cuda" or "fp8" not in self.profile.matmul_tflops:
            raise InvalidRequest(f"{self.profile.name} cannot run FP8 attention; run with --attention sdpa")
