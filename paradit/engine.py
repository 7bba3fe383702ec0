"""The Engine: turns a model name (preset, checkpoint folder or hub id) into a loaded pipeline and serves requests.

A request that fails validation raises ``InvalidRequest`` and leaves the engine ready for the next one.
Must not import torch.distributed.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import torch

from paradit.errors import InvalidRequest
from paradit.pipelines.flux2 import Flux2Pipeline, resolve_request, spec_from_folder
from paradit.presets import PRESETS, ModelSpec
from paradit.request import GenerationRequest, GenerationResult
from paradit.weights import resolve_checkpoint

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
LOAD_FORMATS = ("auto", "dummy")
PIPELINES = {"flux2": Flux2Pipeline}
REQUEST_RESOLVERS = {"flux2": resolve_request}


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
    if not Path(model).expanduser().is_dir() and model.count("/") != 1:
        raise InvalidRequest(
            f"{model!r} is neither a preset ({', '.join(PRESETS)}) nor a checkpoint folder or hub id (org/name)"
        )
    return spec_from_folder(resolve_checkpoint(model))


def validate_request(spec: ModelSpec, request: GenerationRequest) -> None:
    """Raises InvalidRequest for a request ``spec``'s model cannot serve, before any weight is loaded."""
    REQUEST_RESOLVERS[spec.family](spec, request)


class Engine:
    """``Engine(model="flux2-dev").generate(GenerationRequest(prompt="..."))``.

    ``model`` is a preset name, a checkpoint folder, a hub id, or a ModelSpec already resolved.
    """

    def __init__(
        self,
        model: str | ModelSpec = "flux2-tiny",
        device: str | torch.device | None = None,
        dtype: str | torch.dtype | None = None,
        load_format: Literal["auto", "dummy"] = "auto",
    ) -> None:
        self.device = parse_device(device)
        self.dtype = parse_dtype(dtype, self.device)
        self.spec = model if isinstance(model, ModelSpec) else resolve_model(model, load_format)
        dummy = load_format == "dummy" or "folder" not in self.spec.extra
        self.pipeline = PIPELINES[self.spec.family].load(self.spec, self.device, self.dtype, dummy=dummy)

    def generate(self, request: GenerationRequest, progress: bool = False) -> GenerationResult:
        return self.pipeline.generate(request, progress=progress)
