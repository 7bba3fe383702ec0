"""The Engine: runs a loaded pipeline, in this process or a group of workers."""

from __future__ import annotations

import functools
import os
from typing import Literal

import torch

from paradit.device_memory import release_cached
from paradit.errors import InvalidRequest
from paradit.families.default import DEFAULT_MODEL
from paradit.options import ExecutionOptions
from paradit.parallel.config import ParallelConfig
from paradit.pipelines.requests import one_batch
from paradit.request import GenerationRequest, GenerationResult, ResolvedRequest
from paradit.settings import Asked, RunSettings, WorkerPlan, launched_by_torchrun, settle
from paradit.spec import ModelSpec
from paradit.worker import StepSignals, WorkerFailure, WorkerGroup

Request = GenerationRequest | ResolvedRequest


class Engine:
    """``Asked`` settled with ``request``; a worker per GPU (``isolate``: even one); torchrun's ranks but 0 get None."""

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
        settings: RunSettings | None = None,
    ) -> None:
        if settings is None:
            asked = Asked(
                model,
                device,
                dtype,
                load_format,
                allow_pickle,
                parallel=parallel or ParallelConfig(),
                options=options or ExecutionOptions(),
                max_gpu_memory=max_gpu_memory,
                text_encoder_placement=text_encoder_placement,
            )
            settings = settle(asked, request)
        self.settings = settings
        self.spec, self.device, self.dtype = settings.spec, settings.device, settings.dtype
        self.parallel, self.options = settings.parallel, settings.options
        self.memory_cap, self.memory_plan = settings.memory_cap, settings.memory_plan
        self.text_encoder_placement = settings.text_encoder_placement
        self._plan = WorkerPlan(
            self.spec,
            self.device.type,
            self.dtype,
            self.parallel,
            self.options,
            self.memory_cap,
            text_encoder_placement=self.text_encoder_placement,
            vae_tiled=self.memory_plan is not None and self.memory_plan.vae_tiled,
            budget=settings.memory_budget,
        )
        self.pipeline = self._group = self._signals = None
        self._closed = False
        if self.parallel.world_size == 1 and not isolate and not self.parallel.shard_weights:
            from paradit.loader import build_pipeline  # here, where this process builds one: workers import their own

            self.pipeline = build_pipeline(self._plan, 0, self.device.index or 0)
            self._signals = StepSignals(1)
        elif launched_by_torchrun():  # each process is its own engine: there is no one to agree a cancellation with
            from paradit.loader import build_pipeline

            self.pipeline = build_pipeline(self._plan, int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"]))
        else:
            self._group = WorkerGroup(self._plan, self.device.index or 0, cpu_threads)
            self._signals = self._group.signals

    def check(self, request: GenerationRequest) -> ResolvedRequest:
        """The request resolved and checked against this run, or InvalidRequest (nothing runs)."""
        return self.settings.resolve(request)

    def generate(
        self, request: Request | list[Request] | None = None, progress: bool = False
    ) -> GenerationResult | list[GenerationResult] | None:
        """The request's result; for a list of requests that can share a batch, one batch and a list of results."""
        # Resolved here once, each seed drawn here: a seed each rank drew for itself would give each rank other noise.
        request = self.settings.request if request is None else request
        if request is None:
            raise InvalidRequest("generate() needs a request: this engine was settled for none")
        resolved = [
            each if isinstance(each, ResolvedRequest) else self.check(each)
            for each in (request if isinstance(request, list) else [request])
        ]
        one_batch(resolved)  # requests that cannot share a batch are refused before any rank sees them
        if self._closed:  # as a closed group of workers answers
            raise WorkerFailure("this engine was closed; create a new Engine")
        if self._group is not None:
            results = self._group.generate(resolved, progress)
        else:
            from paradit.loader import run_requests  # imported with the pipeline this process built

            signals = self._signals
            on_step = None if signals is None else functools.partial(signals.check, 0, signals.begin())
            results = run_requests(self.pipeline, self._plan, resolved, progress, on_step)
        if results is None:
            return None
        result = results if isinstance(request, list) else results[0]
        timings = results[0].timings  # one run: the batch shares them
        timings.plan = self.plan
        timings.memory_estimate_bytes = self.memory_plan.total if self.memory_plan is not None else 0
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
        """Stop the ``generate`` in flight (from another thread) at its next step boundary. Not under torchrun."""
        self._signals.cancel()

    def abort(self) -> None:
        """Kill the workers now, for a run that does not reach a step boundary; the engine serves no more."""
        for process in self._group.processes:
            process.kill()

    @property
    def worker_pids(self) -> list[int]:
        return [] if self._group is None else [process.pid for process in self._group.processes]

    @property
    def steps_done(self) -> int:
        """Denoise steps the ``generate`` call in flight has done (0 under torchrun)."""
        return 0 if self._signals is None else self._signals.steps_done()

    def close(self) -> None:
        if self._group is not None:
            self._group.close()
        if self.pipeline is not None:
            self.pipeline = None
            release_cached(self.device)
        self._closed = True

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()
