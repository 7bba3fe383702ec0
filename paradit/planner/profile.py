"""Hardware profiles: a GPU and its links as the cost model sees them, one JSON file each under ``profiles/``."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path

from paradit.errors import InvalidRequest

PROFILES_DIR = Path(__file__).with_name("profiles")
COLLECTIVES = ("all_to_all", "send_recv", "all_reduce", "all_gather")


@dataclass(frozen=True)
class HardwareProfile:
    """``link_gbps``: GB/s a rank sends per collective, as ``parallel/comm.py`` counts; ``linear_efficiency``: the share
    of ``matmul_tflops`` reached absent a model's measurement; ``attention_tflops`` by head size (``fp8_``: paradit's
    kernel, empty where never measured); ``host_ms_per_block``: launching a compiled block without CUDA graphs."""

    name: str
    description: str
    device: str
    device_names: tuple[str, ...]
    link: str
    peer_access: bool
    predicted: bool  # nothing measured here
    memory_gib: float
    matmul_tflops: dict[str, float]
    linear_efficiency: dict[str, float]
    attention_tflops: dict[int, float]
    link_gbps: dict[str, float]
    host_ms_per_block: float
    sources: dict[str, str] = field(default_factory=dict)
    fp8_attention_tflops: dict[int, float] = field(default_factory=dict)

    def attention_rate(self, head_dim: int, fp8: bool = False) -> float:
        """The rate of the largest listed head size not above ``head_dim``, else the smallest's."""
        rates = self.fp8_attention_tflops if fp8 else self.attention_tflops
        return rates[max((dim for dim in rates if dim <= head_dim), default=min(rates))]

    @property
    def memory_bytes(self) -> int:
        return int(self.memory_gib * 2**30)

    @classmethod
    def from_json(cls, data: dict) -> HardwareProfile:
        converted = {
            "device_names": tuple(data["device_names"]),
            "memory_gib": float(data["memory_gib"]),
            "attention_tflops": {int(dim): rate for dim, rate in data["attention_tflops"].items()},
            "fp8_attention_tflops": {int(dim): rate for dim, rate in data.get("fp8_attention_tflops", {}).items()},
            "link_gbps": {name: float(data["link_gbps"][name]) for name in COLLECTIVES},
            "host_ms_per_block": float(data["host_ms_per_block"]),
        }
        return cls(**{**data, **converted})


@cache
def all_profiles() -> dict[str, HardwareProfile]:
    profiles = (HardwareProfile.from_json(json.loads(path.read_text())) for path in sorted(PROFILES_DIR.glob("*.json")))
    return {profile.name: profile for profile in profiles}


def load_profile(name: str) -> HardwareProfile:
    profiles = all_profiles()
    if name not in profiles:
        raise InvalidRequest(f"unknown hardware profile {name!r}; choose one of {', '.join(profiles)}")
    return profiles[name]


def with_link(profile: HardwareProfile, link: str) -> HardwareProfile:
    if link == profile.link:
        return profile
    for other in all_profiles().values():
        if other.device == profile.device and other.link == link:
            return other
    raise InvalidRequest(f"no profile of {profile.device} with {link} links; profiles: {', '.join(all_profiles())}")


def detect_profile(gpus: int = 1) -> HardwareProfile | None:
    """This machine's profile: its device name matched, then the link by peer access (one GPU: the device's first)."""
    import torch

    if not torch.cuda.is_available():
        return None
    name = torch.cuda.get_device_name(0)
    matching = [p for p in all_profiles().values() if any(known in name for known in p.device_names)]
    if gpus > 1 and matching:  # peer access as NCCL uses it: the GPUs reach each other and NCCL_P2P_DISABLE is unset
        disabled = os.environ.get("NCCL_P2P_DISABLE", "0") not in ("", "0")
        others = range(1, min(gpus, torch.cuda.device_count()))
        peers = not disabled and all(torch.cuda.can_device_access_peer(0, other) for other in others)
        matching = [p for p in matching if p.peer_access == peers] or matching
    return matching[0] if matching else None
