"""Hardware profiles: a GPU and its links as the cost model sees them, one JSON file each under ``profiles/``.

A profile gives the rates the cost model divides by (bf16 and FP8 matmul, attention by head size, each collective's
bandwidth), the fraction of the matmul rate a compiled step's linear layers reach when no measurement of the model
itself says otherwise, the GPU memory, and how to recognise the machine (device name, peer access). Adding a profile
is adding a file. Where each figure comes from is written in the file's ``sources``.

Must not import torch.distributed.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, replace
from functools import cache
from pathlib import Path

from paradit.errors import InvalidRequest

PROFILES_DIR = Path(__file__).with_name("profiles")
COLLECTIVES = ("all_to_all", "send_recv", "all_reduce", "all_gather")
LINKS = ("nvlink", "pcie")


@dataclass(frozen=True)
class HardwareProfile:
    """``link_gbps``: bytes a rank sends per second through each collective, in GB/s, as paradit's counters count
    them (``parallel/comm.py``); ``linear_efficiency``: achieved share of ``matmul_tflops`` by precision;
    ``attention_tflops``: by head dimension; ``host_ms_per_block``: the host's time to launch one compiled block
    without CUDA graphs; ``predicted``: no figure was measured on this hardware."""

    name: str
    description: str
    device: str
    device_names: tuple[str, ...]
    link: str
    peer_access: bool
    predicted: bool
    memory_gib: float
    matmul_tflops: dict[str, float]
    linear_efficiency: dict[str, float]
    attention_tflops: dict[int, float]
    link_gbps: dict[str, float]
    host_ms_per_block: float
    sources: dict[str, str]

    def attention_rate(self, head_dim: int) -> float:
        """TFLOP/s of attention at ``head_dim``: the figure of the largest listed head size not above it (small heads
        use the smallest listed)."""
        listed = sorted(self.attention_tflops)
        below = [d for d in listed if d <= head_dim]
        return self.attention_tflops[below[-1] if below else listed[0]]

    @property
    def memory_bytes(self) -> int:
        return int(self.memory_gib * 2**30)

    @classmethod
    def from_json(cls, data: dict) -> HardwareProfile:
        return cls(
            **{key: data[key] for key in ("name", "description", "device", "link", "peer_access", "predicted")},
            device_names=tuple(data["device_names"]),
            memory_gib=float(data["memory_gib"]),
            matmul_tflops=dict(data["matmul_tflops"]),
            linear_efficiency=dict(data["linear_efficiency"]),
            attention_tflops={int(dim): rate for dim, rate in data["attention_tflops"].items()},
            link_gbps={name: float(data["link_gbps"][name]) for name in COLLECTIVES},
            host_ms_per_block=float(data["host_ms_per_block"]),
            sources=dict(data.get("sources", {})),
        )


@cache
def all_profiles() -> dict[str, HardwareProfile]:
    profiles = {}
    for path in sorted(PROFILES_DIR.glob("*.json")):
        profile = HardwareProfile.from_json(json.loads(path.read_text()))
        profiles[profile.name] = profile
    return profiles


def load_profile(name: str) -> HardwareProfile:
    profiles = all_profiles()
    if name not in profiles:
        raise InvalidRequest(f"unknown hardware profile {name!r}; choose one of {', '.join(profiles)}")
    return profiles[name]


def with_link(profile: HardwareProfile, link: str) -> HardwareProfile:
    """The profile of the same device with ``link`` (nvlink or pcie), for asking "what if" of another machine."""
    if link == profile.link:
        return profile
    for other in all_profiles().values():
        if other.device == profile.device and other.link == link:
            return other
    raise InvalidRequest(f"no profile of {profile.device} with {link} links; profiles: {', '.join(all_profiles())}")


def with_memory(profile: HardwareProfile, memory_bytes: int) -> HardwareProfile:
    return replace(profile, memory_gib=memory_bytes / 2**30)


def peer_access_enabled(gpus: int) -> bool:
    """Whether NCCL will move data GPU to GPU directly: peers reachable and ``NCCL_P2P_DISABLE`` not set."""
    import torch

    if os.environ.get("NCCL_P2P_DISABLE", "0") not in ("", "0"):
        return False
    count = min(gpus, torch.cuda.device_count())
    return all(torch.cuda.can_device_access_peer(0, other) for other in range(1, count))


def detect_profile(gpus: int = 1) -> HardwareProfile | None:
    """The profile of this machine's GPUs: its device name matched to a profile's, then the link by peer access (on
    one GPU, the first profile of the device). None without a GPU, or for a GPU no profile knows."""
    import torch

    if not torch.cuda.is_available():
        return None
    name = torch.cuda.get_device_name(0)
    matching = [p for p in all_profiles().values() if any(known in name for known in p.device_names)]
    if not matching:
        return None
    if gpus > 1:
        peers = peer_access_enabled(gpus)
        matching = [p for p in matching if p.peer_access == peers] or matching
    return matching[0]
