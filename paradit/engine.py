"""The Engine: turns a model name (preset, checkpoint folder or hub id) into a loaded pipeline and serves requests.

A request that fails validation raises ``InvalidRequest`` (before any worker sees it) and leaves the engine ready
for the next one.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Literal

import torch

from paradit.errors import InvalidRequest
from paradit.memory import check_fits, check_placement, hold_to_cap, parse_size
from paradit.optimize import ExecutionOptions, apply_execution_options
from paradit.parallel.config import ParallelConfig
from paradit.parallel.tensor import tensor_plan
from paradit.pipelines import FAMILIES, spec_from_folder
from paradit.presets import PRESETS
from paradit.quantize import PRESET_FILE, fp8_checkpoint_layers, spec_with_fp8_transformer
from paradit.request import GenerationRequest, GenerationResult
from paradit.spec import ModelSpec
from paradit.weights import resolve_checkpoint
from paradit.worker import WorkerGroup, WorkerPlan, build_worker_pipeline

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


def resolve_model(model: str, load_format: str = "auto") -> ModelSpec:
    """The spec of a preset, checkpoint folder or hub id. A preset with real weights to load (load format auto and a
    hub id) resolves to its checkpoint; a spec without a checkpoint folder runs on random weights."""
    if load_format not in LOAD_FORMATS:
        raise InvalidRequest(f"unknown load format {load_format!r}; choose one of {', '.join(LOAD_FORMATS)}")
    if model in PRESETS:
        spec = PRESETS[model]
        if load_format == "dummy" or spec.hub_id is None:
            return spec
        return spec_from_folder(resolve_checkpoint(spec.hub_id))
    if (Path(model).expanduser() / PRESET_FILE).is_file():
        return spec_with_fp8_transformer(Path(model).expanduser())
    if not Path(model).expanduser().is_dir() and model.count("/") != 1:
        raise InvalidRequest(
            f"{model!r} is neither a preset ({', '.join(PRESETS)}) nor a checkpoint folder or hub id (org/name)"
        )
    return spec_from_folder(resolve_checkpoint(model))


def validate_request(spec: ModelSpec, request: GenerationRequest) -> None:
    """Raises InvalidRequest for a request ``spec``'s model cannot serve, before any weight is loaded."""
    FAMILIES[spec.family].resolve_request(spec, request)


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
    With a
    ``ParallelConfig`` of more than one GPU, the engine spawns one worker process per GPU on this host (``cpu``
    spawns CPU processes joined by gloo); in a script started by torchrun, each process is one worker of the
    torchrun group, and ``generate`` returns the result on rank 0 and None elsewhere.
    """

    def __init__(
        self,
        model: str | ModelSpec = "flux2-tiny",
        device: str | torch.device | None = None,
        dtype: str | torch.dtype | None = None,
        load_format: Literal["auto", "dummy"] = "auto",
        parallel: ParallelConfig | None = None,
        options: ExecutionOptions | None = None,
        max_gpu_memory: str | int | None = None,
        text_encoder_placement: Literal["auto", "gpu", "fp8", "offload"] = "auto",
    ) -> None:
        self.device = parse_device(device)
        self.dtype = parse_dtype(dtype, self.device)
        self.options = options or ExecutionOptions()
        if self.options.cuda_graphs and parallel is not None and parallel.pipefusion > 1:
            # PipeFusion counts steps on the host to choose warm-up or patched steps; a graph replay would skip that.
            raise InvalidRequest("CUDA graphs do not combine with pipefusion yet; drop --cuda-graphs or --pipefusion")
        self.options.validate(self.device)
        self.spec = model if isinstance(model, ModelSpec) else resolve_model(model, load_format)
        self.parallel = parallel or ParallelConfig()
        if fp8_checkpoint_layers(self.spec.transformer) is not None and self.options.quantize != "fp8":
            raise InvalidRequest(f"{self.spec.name} holds an FP8 transformer; run it with --quantize fp8")
        check_plan(self.spec, self.parallel, self.parallel.world_size, self.device)
        fp8 = self.options.quantize == "fp8"
        check_placement(text_encoder_placement, fp8)
        self.memory_cap = None if max_gpu_memory is None else parse_size(max_gpu_memory)
        self.memory_plan = None
        self.text_encoder_placement = "gpu" if text_encoder_placement == "auto" else text_encoder_placement
        if self.memory_cap is not None:
            self.memory_plan = check_fits(
                self.spec, self.parallel, self.dtype, fp8, self.memory_cap, text_encoder_placement
            )
            self.text_encoder_placement = self.memory_plan.text_encoder_placement
        dummy = load_format == "dummy" or "folder" not in self.spec.extra
        self._pipeline = self._group = None
        if self.parallel.world_size == 1:
            if self.memory_cap is not None:
                hold_to_cap(self.device, self.memory_cap)
            self._pipeline = FAMILIES[self.spec.family].pipeline.load(
                self.spec,
                self.device,
                self.dtype,
                dummy=dummy,
                quantize=self.options.quantize,
                text_encoder_placement=self.text_encoder_placement,
            )
            self._pipeline.transformer = apply_execution_options(self._pipeline.transformer, self.options, self.device)
            return
        plan = WorkerPlan(
            self.spec, self.device.type, self.dtype, dummy, self.parallel, self.options, self.memory_cap, "env://",
            text_encoder_placement=self.text_encoder_placement,
        )  # fmt: skip
        if launched_by_torchrun():
            rank, local_rank = int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"])
            self._pipeline = build_worker_pipeline(plan, rank, local_rank)
        else:
            self._group = WorkerGroup(plan)

    @property
    def pipeline(self):
        """The pipeline this process runs (None when the work happens in spawned worker processes)."""
        return self._pipeline

    def generate(self, request: GenerationRequest, progress: bool = False) -> GenerationResult | None:
        validate_request(self.spec, request)
        if self._group is not None:
            result = self._group.generate(request)
        else:
            result = self._pipeline.generate(request, progress=progress)
            if result is not None:
                result.timings.plan = self.parallel.describe()
        if result is not None:
            result.timings.text_encoders = self.text_encoder_placement
        return result

    def close(self) -> None:
        """Stop the worker processes, if any. The engine serves no more requests after this."""
        if self._group is not None:
            self._group.close()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()


def check_plan(spec: ModelSpec, parallel: ParallelConfig, gpus: int, device: torch.device) -> None:
    """Refuse a plan the model or the machine cannot run, naming the plans that work."""
    parallel.validate(gpus, has_cfg=spec.guidance_mode == "cfg", heads=spec.attention_heads)
    if parallel.pipefusion > 1 and spec.family not in ("flux2", "qwen_image", "sd3", "zimage"):
        raise InvalidRequest(f"pipefusion supports FLUX.2, Qwen-Image, SD3.5 and Z-Image, not the {spec.family} family")
    if parallel.tensor > 1:  # the MLP widths must split too; the model on the meta device tells them
        with torch.device("meta"):
            tensor_plan(FAMILIES[spec.family].pipeline.build_transformer(spec), parallel.tensor)
    if device.type == "cuda" and not launched_by_torchrun() and gpus > torch.cuda.device_count():
        raise InvalidRequest(f"{gpus} GPUs asked for, but this machine has {torch.cuda.device_count()}")
