"""``paradit plan``: pick the hardware profile (named, this machine's, or measured by a probe), adjust its link and
memory as asked, plan, and render the answer."""

from __future__ import annotations

import dataclasses
import re

from paradit.errors import InvalidRequest
from paradit.memory import parse_size
from paradit.planner.plan import plan
from paradit.planner.profile import HardwareProfile, detect_profile, load_profile, with_link
from paradit.planner.report import render
from paradit.request import GenerationRequest
from paradit.settings import resolve_model

DEFAULT_PROFILE = "h200-nvlink"


def parse_image_size(text: str) -> tuple[int, int]:
    """'1360x768' -> (width, height)."""
    match = re.fullmatch(r"\s*(\d+)\s*[xX]\s*(\d+)\s*", text)
    if not match:
        raise InvalidRequest(f"size {text!r} is not WIDTHxHEIGHT, e.g. 1024x768")
    return int(match.group(1)), int(match.group(2))


def choose_profile(name: str | None, gpus: int, link: str | None) -> tuple[HardwareProfile, str | None]:
    """The profile to plan for, and a note when it was not named nor detected."""
    note = None
    profile = load_profile(name) if name is not None else detect_profile(gpus)
    if profile is None:
        profile = load_profile(DEFAULT_PROFILE)
        note = f"no GPU profile detected here: planning for {DEFAULT_PROFILE} (--profile picks another)"
    if link == "measure":
        import torch

        from paradit.planner.probe import measured_profile

        if not torch.cuda.is_available():
            raise InvalidRequest("--link measure probes this machine's GPUs, and it has none; use --link nvlink|pcie")
        if torch.cuda.device_count() < gpus:
            raise InvalidRequest(f"--link measure with {gpus} GPUs, but this machine has {torch.cuda.device_count()}")
        profile = measured_profile(profile, gpus)
    elif link is not None:
        profile = with_link(profile, link)
    return profile, note


def plan_text(
    model: str,
    gpus: int,
    profile_name: str | None = None,
    link: str | None = None,
    gpu_memory: str | None = None,
    size: str | None = None,
    frames: int | None = None,
    quantize: str | None = None,
    attention: str = "sdpa",
) -> str:
    spec = resolve_model(model, "dummy")
    profile, note = choose_profile(profile_name, gpus, link)
    if gpu_memory is not None:
        profile = dataclasses.replace(profile, memory_gib=parse_size(gpu_memory) / 2**30)
    width, height = parse_image_size(size) if size else (None, None)
    request = GenerationRequest(prompt="a", height=height, width=width, frames=frames)
    text = render(plan(spec, gpus, profile, request if size or frames else None, quantize, attention=attention))
    return text if note is None else f"{note}\n{text}"
