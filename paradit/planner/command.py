"""``paradit plan``: what ``generate`` with the same flags would run, here or on a hardware profile's GPUs."""

from __future__ import annotations

import dataclasses
import math

from paradit.errors import InvalidRequest
from paradit.machine import Machine
from paradit.memory import gib, parse_size
from paradit.options import Asked
from paradit.planner.plan import facts_for, plan
from paradit.planner.profile import HardwareProfile, detect_profile, load_profile, with_link
from paradit.planner.report import generate_command, render
from paradit.request import GenerationRequest
from paradit.settings import RunSettings, settle

DEFAULT_PROFILE = "h200-nvlink"


def choose_profile(name: str | None, gpus: int, link: str | None) -> tuple[HardwareProfile, str | None]:
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
    asked: Asked, request: GenerationRequest | None = None, profile_name: str | None = None, link: str | None = None
) -> str:
    gpus = asked.gpus or (asked.parallel.world_size if asked.parallel else 1)
    machine, note = Machine.detect(), None
    if profile_name is not None or link is not None:
        profile, note = choose_profile(profile_name, gpus, link)
        machine = Machine(gpus, profile, virtual=True)
    run = settle(asked, request, machine)
    options, parallel = run.options, run.parallel
    where = f"{parallel.world_size} CPU process(es)" if run.device.type == "cpu" else f"{gpus} GPU(s)"
    lines = [*([note] if note else []), f"generate runs {run.spec.name} on {where}: {settled_words(run)}"]
    profile = machine.profile_for(gpus) if run.device.type == "cuda" else None
    if run.device.type == "cpu":
        lines.append(f"(on this machine's CPU; --profile {DEFAULT_PROFILE} or another predicts for GPUs)")
    if profile is not None and run.origin is None and asked.parallel is None and gpus > 1:
        lines.append(f"(the planner has no FLOP counts for {run.spec.name}'s architecture: the default plan runs)")
    if run.origin is not None and profile is not None:
        if asked.max_gpu_memory is not None:  # the ranking is made for the cap's GPUs
            profile = dataclasses.replace(profile, memory_gib=parse_size(asked.max_gpu_memory) / 2**30)
        quantize = asked.options.quantize
        density = sparse_density(run)
        if density is not None:
            lines.append(
                f"(sparse attention: the steps past its dense warm-up at its mask's density {density:.2f}, at the "
                "dense kernels' rate)"
            )
        chosen = plan(
            run.spec,
            gpus,
            profile,
            run.request,
            quantize,
            attention=options.attention,
            **({} if density is None else {"attention_density": density}),
        )
        lines += ["", render(chosen)]
    return "\n".join([*lines, "", f"Run it: {run_command(asked, run)}"])


def run_command(asked: Asked, run: RunSettings) -> str:
    extra = [f"--device {run.device.type}"] if asked.device is not None else []
    extra += [f"--dtype {asked.dtype}"] if isinstance(asked.dtype, str) else []
    extra += [f"--max-gpu-memory {asked.max_gpu_memory}"] if asked.max_gpu_memory is not None else []
    if (request := run.request) is not None:  # the request the plan was sized for
        extra += [f"--height {request.height} --width {request.width} --steps {request.steps}"]
        extra += [f"--frames {request.frames}"] if request.frames else []
    return generate_command(run.spec.name, run.parallel, run.options, run.text_encoder_placement, tuple(extra))


def sparse_density(run: RunSettings) -> float | None:
    """Radial's mask is static: its density for the request's token grid. SVG2's is known once it runs (None)."""
    request = run.request
    if run.options.sparse_attention != "radial" or request is None or request.frames is None:
        return None
    from paradit.layers.sparse_masks import density, radial_block_mask

    facts = facts_for(run.spec)
    side = facts.token_side
    grid = ((request.frames - 1) // facts.frame_stride + 1, request.height // side, request.width // side)
    decay = run.options.sparse_decay_factor or 1.0
    return density(radial_block_mask(grid, decay), math.prod(grid), math.prod(grid))


def settled_words(run: RunSettings) -> str:
    options = run.options
    parts = [
        run.parallel.describe().replace("1 GPU", "one process" if run.device.type == "cpu" else "1 GPU"),
        "FP8 linears" if options.quantize == "fp8" else str(run.dtype).removeprefix("torch."),
        *(["FP8 attention"] if options.attention == "fp8" else []),
        *([f"sparse attention {options.sparse_attention} (lossy)"] if options.sparse_attention else []),
        *(["CUDA graphs"] if options.cuda_graphs else []),
        *(["experts swapped"] if options.swap_experts else []),
        f"text encoders {run.text_encoder_placement}",
    ]
    if run.memory_plan is not None:
        parts.append(f"{gib(run.memory_plan.total)} GiB on rank 0 of {run.memory_limit}")
    return ", ".join(parts) + f" ({run.origin or 'the flags, or the default for this device'})"
