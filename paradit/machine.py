"""The hardware a run is settled for: this machine, or a hardware profile's GPUs (``paradit plan --profile``)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from paradit.device_memory import free_memory
from paradit.errors import InvalidRequest
from paradit.planner.profile import HardwareProfile, detect_profile


@dataclass(frozen=True)
class Machine:
    """``virtual``: GPUs of ``profile`` that are not here, whose free memory and FP8 support the profile gives."""

    gpus: int
    profile: HardwareProfile | None = None
    virtual: bool = False

    @classmethod
    def detect(cls) -> Machine:
        return cls(torch.cuda.device_count() if torch.cuda.is_available() else 0)

    def profile_for(self, gpus: int) -> HardwareProfile | None:
        return self.profile if self.virtual else detect_profile(gpus)

    def free_memory(self, index: int) -> int:
        return self.profile.memory_bytes if self.virtual else free_memory(index)

    def memory_words(self, free: int, index: int) -> str:
        where = f"an {self.profile.name} GPU" if self.virtual else f"GPU {index}"
        return f"the {free / 2**30:.1f} GiB free on {where}"

    def check_fp8(self, device: torch.device) -> None:
        if not self.virtual:
            from paradit.layers.fp8 import check_fp8_supported

            check_fp8_supported(device)
        elif device.type != "cuda" or "fp8" not in self.profile.matmul_tflops:
            raise InvalidRequest(f"{self.profile.name} has no FP8 matrix kernels; run without --quantize fp8 (bf16)")

    def check_fp8_attention(self, device: torch.device) -> None:
        if not self.virtual:
            from paradit.layers.fp8_attention import check_fp8_attention  # imports Triton: only runs that use it

            check_fp8_attention(device)
        elif device.type != "cuda" or "fp8" not in self.profile.matmul_tflops:
            raise InvalidRequest(f"{self.profile.name} cannot run FP8 attention; run with --attention sdpa")
