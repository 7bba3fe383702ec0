"""The Engine: turns a model name (preset, checkpoint folder or hub id) into a loaded pipeline and serves requests.

Every check of a setting or a request is made here, once, before anything loads: a request that fails raises
``InvalidRequest`` (before any worker sees it) and leaves the engine ready for the next one.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from pathlib import Path
from typing import Literal

import torch

from paradit.compile import model_blocks
from paradit.errors import InvalidRequest
from paradit.families import DEFAULT_MODEL, FAMILIES, PRESETS, spec_from_folder
from paradit.loader import WorkerPlan, build_pipeline
from paradit.memory import check_fits, check_placement, parse_size
from paradit.optimize import ExecutionOptions
from paradit.parallel.config import ParallelConfig, default_plan
from paradit.parallel.tensor import check_tensor_plan
from paradit.pipelines.base import ResolvedRequest
from paradit.quantize import PRESET_FILE, fp8_checkpoint_layers, spec_with_fp8_transformer
from paradit.request import GenerationRequest, GenerationResult
from paradit.spec import ModelSpec, RandomWeights
from paradit.weights import resolve_checkpoint
from paradit.worker import StepSignals, WorkerGroup

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
LOAD_FORMATS = ("auto", "dummy")


def parse_dtype(dtype: str | torch.dtype | None, device: torch.device) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype is None:
        return torch.bfloat16 if device.type != "cpu" else torch.float32
    if dtype not in DTYPES:
        raise InvalidRequest(f"unknown dtype {dtype!r}; choose one of {', '.join(DTYPES)}")
    return DTYPES[dtype]


def parse_device(device: str | torch.device | None) -> torch.device:
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(device)
    if device.type not in ("cuda", "cpu"):
        raise InvalidRequest(f"unknown device {str(device)!r}; choose cuda (CUDA or ROCm builds) or cpu")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise InvalidRequest("device cuda was asked for but this PyTorch build sees no GPU; use --device cpu")
    return device


def resolve_model(model: str, load_format: str = "auto", allow_pickle: bool = False) -> ModelSpec:
    """The spec of a preset, checkpoint folder or hub id, with its weight source: a preset with a hub id resolves to
    its checkpoint; ``dummy`` (or a preset without a checkpoint) gives random weights of the same architecture."""
    if load_format not in LOAD_FORMATS:
        raise InvalidRequest(f"unknown load format {load_format!r}; choose one of {', '.join(LOAD_FORMATS)}")
    path = Path(model).expanduser()
    if model in PRESETS:
        spec = PRESETS[model]
        if load_format == "auto" and spec.hub_id is not None:
            spec = spec_from_folder(resolve_checkpoint(spec.hub_id), allow_pickle)
    elif (path / PRESET_FILE).is_file():
        spec = spec_with_fp8_transformer(path)
    elif path.is_dir() or model.count("/") == 1:
        spec = spec_from_folder(resolve_checkpoint(model), allow_pickle)
    else:
        raise InvalidRequest(
            f"{model!r} is neither a preset ({', '.join(PRESETS)}) nor a checkpoint folder or hub id (org/name)"
        )
    return dataclasses.replace(spec, weights=RandomWeights()) if load_format == "dummy" else spec


def default_plan_for(
    spec: ModelSpec, gpus: int, request: GenerationRequest | None = None, device: str | torch.device | None = None
) -> ParallelConfig:
    """The plan ``--gpus N`` alone gets. On GPUs of a known hardware profile, the planner's (the tuned entry for the
    request, else a plan made for it: ``paradit.planner.choose``). Elsewhere (CPU processes, an unknown GPU): CFG
    parallel only when the request (or, without one, the model's defaults) runs both guidance branches, so that no
    half of the group idles; the rest Ulysses, then Ring."""
    from paradit.planner.choose import settings_for

    planned = settings_for(spec, gpus, request, device) if gpus > 1 else None
    if planned is not None:
        return planned.parallel
    pipeline = FAMILIES[spec.family].pipeline
    request = request or GenerationRequest(prompt="a")
    guides = spec.guidance_mode == "cfg" and pipeline.uses_cfg(spec, pipeline.resolve_request(spec, request))
    return default_plan(gpus, guides, spec.attention_heads)


def launched_by_torchrun() -> bool:
    return int(os.environ.get("WORLD_SIZE", "1")) > 1 and "LOCAL_RANK" in os.environ


class Engine:
    """``Engine(model="flux2-dev").generate(GenerationRequest(prompt="..."))``.

    ``model`` is a preset name, a checkpoint folder, a hub id, or a ModelSpec already resolved. ``options`` selects
    FP8 linears and regional compilation (on by default on GPUs). ``max_gpu_memory`` ("32GiB") is checked against
    the plan's estimate before anything loads, and every GPU worker holds its allocator to it.
    ``text_encoder_placement`` is ``gpu`` (prompt encoders resident on rank 0's GPU), ``fp8`` (resident with FP8
    linears; FP8 runs only), ``offload`` (kept in CPU memory and streamed to the GPU while encoding) or ``auto``: under
    a cap, the first of those that fits (the choice is ``memory_plan.text_encoder_placement``); without one, resident.
    ``request``, when given, is checked too before anything loads (the CLI's one request). ``allow_pickle`` lets a
    checkpoint folder's pickle weights load (they can run code).

    With a ``ParallelConfig`` of more than one GPU, the engine spawns one worker process per GPU on this host
    (``cpu`` spawns CPU processes joined by gloo), using the GPUs from ``device``'s index on; ``isolate`` spawns one
    worker for a one-GPU plan too, so that a crash of the model code cannot take the caller down (the server's groups).
    ``cpu_threads``: torch's threads per CPU worker process (default: the cores shared among the group). In a script
    started by torchrun, each process is one worker of the torchrun group, and ``generate`` returns the result on rank
    0 and None elsewhere.
    """

    def __init__(
        self,
        model: str | ModelSpec = DEFAULT_MODEL,
        device: str | torch.device | None = None,
        dtype: str | torch.dtype | None = None,
        load_format: Literal["auto", "dummy"] = "auto",
        parallel: ParallelConfig | None = None,
        options: ExecutionOptions | None = None,
        max_gpu_memory: str | int | None = None,
        text_encoder_placement: Literal["auto", "gpu", "fp8", "offload"] = "auto",
        request: GenerationRequest | None = None,
        allow_pickle: bool = False,
        isolate: bool = False,
        cpu_threads: int | None = None,
    ) -> None:
        self.device = parse_device(device)
        self.dtype = parse_dtype(dtype, self.device)
        self.options = options or ExecutionOptions()
        self.parallel = parallel or ParallelConfig()
        if self.options.cuda_graphs and self.parallel.pipefusion > 1:
            # PipeFusion counts steps on the host to choose warm-up or patched steps; a graph replay would skip that.
            raise InvalidRequest("CUDA graphs do not combine with pipefusion yet; drop --cuda-graphs or --pipefusion")
        self.spec = model if isinstance(model, ModelSpec) else resolve_model(model, load_format, allow_pickle)
        if fp8_checkpoint_layers(self.spec.transformer) is not None:  # it runs in FP8 or not at all
            if self.options.quantize != "fp8":
                raise InvalidRequest(f"{self.spec.name} holds an FP8 transformer; run it with --quantize fp8")
            try:
                self.options.validate(self.device)
            except InvalidRequest:  # its own advice (drop --quantize fp8) would lead to the refusal above
                raise InvalidRequest(
                    f"{self.spec.name} holds an FP8 transformer, which needs a GPU with FP8 kernels (compute "
                    "capability 8.9+, MI300 or RDNA 4); on this device run the checkpoint it was quantized from"
                ) from None
        self.options.validate(self.device)
        check_plan(self.spec, self.parallel, self.device)
        resolved = None if request is None else self.check(request)
        fp8 = self.options.quantize == "fp8"
        check_placement(text_encoder_placement, fp8)
        self.memory_cap = None if max_gpu_memory is None else parse_size(max_gpu_memory)
        self.memory_plan = None
        self.text_encoder_placement = "gpu" if text_encoder_placement == "auto" else text_encoder_placement
        if self.memory_cap is not None:  # estimated at the request's size when there is one, else the model's
            sized = self.spec
            if resolved is not None:
                frames = {} if resolved.frames is None else {"extra": {**self.spec.extra, "frames": resolved.frames}}
                sized = dataclasses.replace(self.spec, height=resolved.height, width=resolved.width, **frames)
            fits = functools.partial(check_fits, sized, self.parallel, self.dtype, fp8, self.memory_cap,
                                     text_encoder_placement)  # fmt: skip
            try:
                self.memory_plan = fits(swap_experts=self.options.swap_experts)
            except InvalidRequest:
                # Experts that do not fit side by side may take turns: the idle one waits in host memory.
                if self.options.swap_experts or not FAMILIES[self.spec.family].pipeline.expert_configs(self.spec):
                    raise
                self.memory_plan = fits(swap_experts=True)
                self.options = dataclasses.replace(self.options, swap_experts=True)
                self.options.validate(self.device)
            self.text_encoder_placement = self.memory_plan.text_encoder_placement
        plan = WorkerPlan(
            self.spec, self.device.type, self.dtype, self.parallel, self.options, self.memory_cap,
            text_encoder_placement=self.text_encoder_placement,
            vae_tiled=self.memory_plan is not None and self.memory_plan.vae_tiled,
        )  # fmt: skip
        self._pipeline = self._group = self._signals = None
        if self.parallel.world_size == 1 and not isolate:
            self._pipeline = build_pipeline(plan, 0, self.device.index or 0)
            self._signals = StepSignals(1)
        elif launched_by_torchrun():  # each process is its own engine: there is no one to agree a cancellation with
            self._pipeline = build_pipeline(plan, int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"]))
        else:
            self._group = WorkerGroup(plan, self.device.index or 0, cpu_threads)
            self._signals = self._group.signals

    def check(self, request: GenerationRequest) -> ResolvedRequest:
        """The request with the model's defaults filled in, or InvalidRequest for one this engine's model cannot
        serve (nothing runs)."""
        return FAMILIES[self.spec.family].pipeline.resolve_request(self.spec, request)

    @property
    def pipeline(self):
        """The pipeline this process runs (None when the work happens in spawned worker processes)."""
        return self._pipeline

    def generate(
        self, request: GenerationRequest | list[GenerationRequest], progress: bool = False
    ) -> GenerationResult | list[GenerationResult] | None:
        """The request's result; for a list of requests that differ only in prompts, seeds and image counts, one
        batch and a list of results, each what its request gives alone (``DiffusionPipeline.generate``). Raises
        RequestCancelled when ``cancel`` stopped it."""
        # Resolved here once, and each seed drawn here: the ranks resolve what they are sent, and a seed each rank drew
        # for itself would give each rank other noise, and the result a seed that is not its image's.
        each_request = request if isinstance(request, list) else [request]
        pinned = [dataclasses.replace(each, seed=self.check(each).seed) for each in each_request]
        request = pinned if isinstance(request, list) else pinned[0]
        if self._group is not None:
            result = self._group.generate(request, progress)
        else:
            signals = self._signals
            on_step = None if signals is None else functools.partial(signals.check, 0, signals.begin())
            result = self._pipeline.generate(request, progress=progress, on_step=on_step)
        if result is not None:
            timings = (result[0] if isinstance(result, list) else result).timings  # one run: the batch shares them
            timings.plan = self.plan
            # "gpu" names the device the encoders stay resident on; on the CPU that is the CPU's memory.
            placement = self.text_encoder_placement
            timings.text_encoders = "resident" if self.device.type == "cpu" and placement == "gpu" else placement
        return result

    @property
    def plan(self) -> str:
        """The parallel plan in words ("cfg 2 x ulysses 2", "1 GPU"; "1 process" on the CPU)."""
        plan = self.parallel.describe()
        return plan.replace("1 GPU", "1 process") if self.device.type == "cpu" else plan

    def cancel(self) -> None:
        """Stop the ``generate`` call in flight (called from another thread) at its next step boundary, where it
        raises RequestCancelled; nothing happens if it is past its last step. Not under torchrun."""
        self._signals.cancel()

    @property
    def worker_pids(self) -> list[int]:
        """The process ids of the spawned workers (none when the engine runs in this process)."""
        return [] if self._group is None else [process.pid for process in self._group.processes]

    @property
    def steps_done(self) -> int:
        """Denoise steps the ``generate`` call in flight has done (0 under torchrun)."""
        return 0 if self._signals is None else self._signals.steps_done()

    def close(self) -> None:
        """Stop the worker processes, if any, and remove their rendezvous folder; a request cut short (an interrupt)
        is not waited for. Also done when the engine is garbage-collected or the interpreter exits. The engine serves
        no more requests after this."""
        if self._group is not None:
            self._group.close()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()


def check_plan(spec: ModelSpec, parallel: ParallelConfig, device: torch.device) -> None:
    """Refuse a plan the model or the machine cannot run, naming the plans that work."""
    gpus = parallel.world_size
    parallel.validate(gpus, has_cfg=spec.guidance_mode == "cfg", heads=spec.attention_heads)
    if parallel.tensor > 1 or parallel.pipefusion > 1:  # the model on the meta device tells its widths and blocks
        family = FAMILIES[spec.family]
        with torch.device("meta"):
            model = family.pipeline.build_transformer(spec)
        if parallel.tensor > 1:
            check_tensor_plan(family.tensor_plan, model, parallel.tensor)
        if parallel.pipefusion > len(model_blocks(model)):
            raise InvalidRequest(
                f"pipefusion {parallel.pipefusion} exceeds the model's {len(model_blocks(model))} blocks; give at most "
                f"{len(model_blocks(model))} stages"
            )
        if parallel.pipefusion > 1 and family.pipeline.expert_configs(spec):
            # The patch loop drives one pipeline of stages; a second transformer would need its own.
            raise InvalidRequest(f"pipefusion does not run {spec.name}'s second transformer yet; drop --pipefusion")
    if device.type == "cuda" and not launched_by_torchrun() and (device.index or 0) + gpus > torch.cuda.device_count():
        start = "" if device.index is None else f" from {device}"
        raise InvalidRequest(f"{gpus} GPUs{start} asked for, but this machine has {torch.cuda.device_count()}")
