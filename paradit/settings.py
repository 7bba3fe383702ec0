"""``settle``, the one front door: what a user asked and its request become the checked settings a run executes with."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from paradit.checkpoint import resolve_checkpoint
from paradit.device_memory import MemoryBudget
from paradit.errors import InvalidRequest
from paradit.families import FAMILIES, PRESETS, spec_from_folder
from paradit.flags import check_choices
from paradit.fp8_checkpoint import PRESET_FILE, spec_with_fp8_transformer
from paradit.lora.apply import check_adapters, check_choice
from paradit.lora.refs import MODES
from paradit.machine import Machine
from paradit.memory import MemoryPlan, cap_words, check_fits, check_placement, gib, lowering_options, parse_size
from paradit.options import Asked, ExecutionOptions, check_conflicts
from paradit.parallel.config import ParallelConfig, plans_for
from paradit.parallel.validate import check_plan
from paradit.planner.choose import settings_for
from paradit.quantize import fp8_checkpoint_layers
from paradit.request import GenerationRequest, ResolvedRequest
from paradit.spec import ModelSpec, RandomWeights

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def parse_dtype(dtype: str | torch.dtype | None, device: torch.device) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype is None:
        return torch.bfloat16 if device.type != "cpu" else torch.float32
    return DTYPES[dtype]


def parse_device(device: str | torch.device | None, machine: Machine) -> torch.device:
    if device is None:
        return torch.device("cuda" if machine.gpus else "cpu")
    device = torch.device(device)
    if device.type not in ("cuda", "cpu"):
        raise InvalidRequest(f"unknown device {str(device)!r}; choose cuda (CUDA or ROCm builds) or cpu")
    if device.type == "cuda" and not machine.gpus:
        raise InvalidRequest("device cuda was asked for but this PyTorch build sees no GPU; use --device cpu")
    return device


def resolve_model(model: str | ModelSpec, load_format: str = "auto", allow_pickle: bool = False) -> ModelSpec:
    """The spec of a preset (with a hub id: its checkpoint), checkpoint folder or hub id; ``dummy``: random weights."""
    if isinstance(model, ModelSpec):
        return model
    path = Path(model).expanduser()
    if model in PRESETS:
        spec = PRESETS[model]
        if load_format == "auto" and spec.hub_id is not None:
            spec = spec_from_folder(resolve_checkpoint(spec.hub_id, allow_pickle), allow_pickle)
    elif (path / PRESET_FILE).is_file():
        spec = spec_with_fp8_transformer(path)
    elif path.is_dir() or model.count("/") == 1:
        spec = spec_from_folder(resolve_checkpoint(model, allow_pickle), allow_pickle)
    else:
        raise InvalidRequest(
            f"{model!r} is neither a preset ({', '.join(PRESETS)}) nor a checkpoint folder or hub id (org/name)"
        )
    return dataclasses.replace(spec, weights=RandomWeights()) if load_format == "dummy" else spec


# CPU processes past this many a core only wait for the cores (the tests run 4 on 2), and each holds a model.
PROCESSES_PER_CORE = 4


def launched_by_torchrun() -> bool:
    return int(os.environ.get("WORLD_SIZE", "1")) > 1 and "LOCAL_RANK" in os.environ


@dataclass(frozen=True)
class RunSettings:
    """What a run executes with, settled and checked; ``memory_limit``: what the memory plan was made for, in words."""

    spec: ModelSpec
    device: torch.device
    dtype: torch.dtype
    parallel: ParallelConfig
    options: ExecutionOptions
    memory_cap: int | None = None
    memory_plan: MemoryPlan | None = None
    text_encoder_placement: str = "gpu"
    origin: str | None = None
    memory_limit: str | None = None
    request: ResolvedRequest | None = None  # the one request it was settled for, resolved

    @property
    def family(self):
        return FAMILIES[self.spec.family]

    @property
    def memory_budget(self) -> MemoryBudget:
        if self.memory_plan is None:
            return MemoryBudget()
        options = self.options
        advice = lowering_options(
            self.spec, self.parallel, options.quantize == "fp8", self.text_encoder_placement, options.swap_experts
        )
        advice.append("or a smaller size")
        return MemoryBudget(self.memory_plan.total, self.memory_limit or "", ", ".join(advice))

    def resolve(self, request: GenerationRequest) -> ResolvedRequest:
        return self.checked(self.family.resolve_request(self.spec, request))

    def checked(self, resolved: ResolvedRequest) -> ResolvedRequest:
        """Refuse what this run's plan and options cannot give ``resolved`` (the family's rules, ``CONFLICTS``)."""
        if self.family.check_run is not None:
            self.family.check_run(self, resolved)
        check_conflicts(self.parallel, self.options, self.device.type, resolved)
        return dataclasses.replace(resolved, lora=check_choice(self.options.lora, resolved.lora))


@dataclass(frozen=True)
class WorkerPlan:
    """What each rank builds its pipeline from: a run's settings, as the engine hands them to its workers."""

    spec: ModelSpec
    device_type: str
    dtype: torch.dtype
    parallel: ParallelConfig
    options: ExecutionOptions
    memory_cap: int | None
    init_method: str = "env://"
    text_encoder_placement: str = "gpu"
    vae_tiled: bool = False  # the memory plan's last resort: every rank decodes the whole latent tile by tile
    budget: MemoryBudget = MemoryBudget()


def choices(
    asked: Asked, spec: ModelSpec, resolved: ResolvedRequest | None, machine: Machine
) -> tuple[ParallelConfig, ExecutionOptions, str, str | None]:
    """What ``asked`` leaves open (plan, execution options, encoder placement, origin), chosen and unchecked."""
    planned = None
    if asked.parallel is not None:
        parallel = asked.parallel
        if asked.gpus is not None and asked.gpus != parallel.world_size:  # say which plans fit the group
            parallel.validate(asked.gpus, has_cfg=spec.guidance_mode == "cfg", heads=spec.attention_heads)
    elif (gpus := asked.gpus or 1) == 1:
        parallel = ParallelConfig()
    elif (planned := settings_for(spec, gpus, resolved, asked.device, machine.profile_for(gpus))) is not None:
        parallel = planned.parallel
    else:
        family = FAMILIES[spec.family]
        resolved = resolved or family.resolve_request(spec, GenerationRequest(prompt="a"))
        guides = spec.guidance_mode == "cfg" and family.uses_cfg(spec, resolved)
        parallel = plans_for(gpus, guides, spec.attention_heads)[0]
    parallel = dataclasses.replace(
        parallel,
        comm_dtype=asked.comm_dtype or parallel.comm_dtype,
        patches=asked.patches or parallel.patches,
        warmup_steps=asked.warmup_steps or parallel.warmup_steps,
        shard_weights=parallel.shard_weights if asked.shard_weights is None else asked.shard_weights,
    )
    placement = asked.text_encoder_placement
    if planned is not None and placement == "auto" and asked.max_gpu_memory is None:
        placement = planned.text_encoder_placement  # under a cap, the memory plan places them for that cap
    wanted = asked.options
    options = dataclasses.replace(
        wanted,
        quantize=wanted.quantize or (planned.quantize if planned else "none"),
        # A planned graph would replay one step's mask and dense/sparse choice (the conflicts refuse it when asked).
        cuda_graphs=bool(wanted.cuda_graphs or (planned and planned.cuda_graphs and not wanted.sparse_attention)),
        swap_experts=bool(wanted.swap_experts or (planned and planned.swap_experts)),
        attention=wanted.attention or "sdpa",
    )
    return parallel, options, placement, planned.origin if planned else None


def check_execution(spec: ModelSpec, options: ExecutionOptions, device: torch.device, machine: Machine) -> None:
    """Refuse what ``device`` cannot execute, and an FP8 checkpoint run otherwise than in FP8."""
    if fp8_checkpoint_layers(spec.transformer) is not None:  # it runs in FP8 or not at all
        if options.quantize != "fp8":
            raise InvalidRequest(f"{spec.name} holds an FP8 transformer; run it with --quantize fp8")
        try:
            machine.check_fp8(device)
        except InvalidRequest:  # its own advice (drop --quantize fp8) would lead to the refusal above
            raise InvalidRequest(
                f"{spec.name} holds an FP8 transformer, which needs a GPU with FP8 kernels (compute capability "
                "8.9+, MI300 or RDNA 4); on this device run the checkpoint it was quantized from"
            ) from None
    elif options.quantize == "fp8":
        machine.check_fp8(device)
    if options.attention == "fp8":
        machine.check_fp8_attention(device)
    if options.lora.mode not in MODES:
        raise InvalidRequest(f"unknown LoRA mode {options.lora.mode!r}; choose one of {', '.join(MODES)}")
    if options.lora.cache < 0:
        raise InvalidRequest(f"--lora-cache {options.lora.cache}: give 0 (side paths) or more fused choices")


def available_memory() -> int | None:
    with contextlib.suppress(OSError, StopIteration, ValueError):
        line = next(line for line in Path("/proc/meminfo").read_text().splitlines() if line.startswith("MemAvailable"))
        return int(line.split()[1]) * 1024
    return None


def check_cpu_group(spec: ModelSpec, parallel: ParallelConfig, dtype: torch.dtype) -> None:
    """Refuse more CPU processes than the cores take, or a group whose transformer weights alone pass free memory."""
    processes, cores = parallel.world_size, os.cpu_count() or 1
    if processes > PROCESSES_PER_CORE * cores:
        raise InvalidRequest(
            f"{processes} CPU processes asked for on {cores} cores; give at most "
            f"{PROCESSES_PER_CORE * cores} ({PROCESSES_PER_CORE} a core)"
        )
    with torch.device("meta"):
        parameters = sum(p.numel() for p in FAMILIES[spec.family].build_transformer(spec).parameters())
    shares = parallel.tensor * parallel.pipefusion * (parallel.shard_weights or 1)
    held = processes * parameters * dtype.itemsize // shares
    if held > (available := available_memory() or held):
        raise InvalidRequest(
            f"{processes} CPU process(es) would hold {gib(held)} GiB of {spec.name}'s transformer "
            f"weights in {str(dtype).removeprefix('torch.')}, past the {gib(available)} GiB of memory "
            "available; give --dtype bf16 (half), --shard-weights, --tensor or --pipefusion (a share "
            "each), or fewer processes"
        )


def settle(asked: Asked, request: GenerationRequest | None = None, machine: Machine | None = None) -> RunSettings:
    """The settings for ``asked`` on ``machine`` (default: this one), sized for ``request``, resolved here once."""
    machine = machine or Machine.detect()
    check_choices(asked)
    check_choices(asked.options)
    device = parse_device(asked.device, machine)
    dtype = parse_dtype(asked.dtype, device)
    spec = resolve_model(asked.model, asked.load_format, asked.allow_pickle)
    family = FAMILIES[spec.family]
    resolved = None if request is None else family.resolve_request(spec, request)
    parallel, options, placement, origin = choices(asked, spec, resolved, machine)
    check_conflicts(parallel, options, device.type)
    check_execution(spec, options, device, machine)
    check_plan(family, spec, parallel)
    gpus, fp8 = parallel.world_size, options.quantize == "fp8"
    adapter_bytes = check_adapters(family, spec, options.lora, dtype, fp8)
    if device.type == "cuda" and not launched_by_torchrun() and (device.index or 0) + gpus > machine.gpus:
        start = "" if device.index is None else f" from {device}"
        raise InvalidRequest(f"{gpus} GPUs{start} asked for, but this machine has {machine.gpus}")
    check_placement(placement, fp8)
    cap = None if asked.max_gpu_memory is None else parse_size(asked.max_gpu_memory)
    # Uncapped on GPUs, the plan is made for the memory they have free; a cap on the CPU is for the GPU plan.
    limit, limit_words = (cap, cap_words(cap)) if cap is not None else free_limit(device, gpus, machine)
    memory_plan = None
    if limit is not None:  # estimated at the request's size when there is one, else the model's
        sized, extra_tokens = spec, 0 if resolved is None else resolved.reference_tokens
        if resolved is not None:
            sized = dataclasses.replace(
                spec, height=resolved.height, width=resolved.width, frames=resolved.frames or spec.frames
            )
        fits = functools.partial(
            check_fits,
            sized,
            parallel,
            dtype,
            fp8,
            limit,
            placement,
            compiled=options.compiles(device),
            adapter_bytes=adapter_bytes,
            extra_tokens=extra_tokens,
            limit=None if cap is not None else limit_words,
            fp8_attention=options.attention == "fp8",
            sparse_attention=options.sparse_attention,
        )
        try:
            memory_plan = fits(swap_experts=options.swap_experts)
        except InvalidRequest:
            if options.swap_experts or not spec.experts or parallel.shard_weights:
                raise
            memory_plan = fits(swap_experts=True)
            options = dataclasses.replace(options, swap_experts=True)
            check_conflicts(parallel, options, device.type)
        placement = memory_plan.text_encoder_placement
    if device.type == "cpu":  # after the cap's check
        check_cpu_group(spec, parallel, dtype)
    placement = "gpu" if placement == "auto" else placement
    settings = RunSettings(spec, device, dtype, parallel, options, cap, memory_plan, placement, origin, limit_words)
    return settings if resolved is None else dataclasses.replace(settings, request=settings.checked(resolved))


def free_limit(device: torch.device, gpus: int, machine: Machine) -> tuple[int | None, str | None]:
    """The free memory of the group's least free GPU, and in words; under torchrun each process checks its own."""
    if device.type != "cuda":
        return None, None
    first = int(os.environ["LOCAL_RANK"]) if launched_by_torchrun() else device.index or 0
    indices = [first] if launched_by_torchrun() else range(first, first + gpus)
    free, index = min((machine.free_memory(index), index) for index in indices)
    return free, machine.memory_words(free, index)
