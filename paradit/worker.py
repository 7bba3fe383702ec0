"""Worker processes: one per GPU (or CPU process), each loading its share of the model and serving the requests the
engine broadcasts to the group. ``WorkerGroup`` is the engine's side of them.

If a worker fails, the group is stopped and the engine raises the worker's reason instead of waiting on a
collective that will never finish.
"""

from __future__ import annotations

import os
import queue
import tempfile
import time
import traceback
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from paradit.errors import ParaditError
from paradit.memory import hold_to_cap
from paradit.optimize import ExecutionOptions, apply_execution_options
from paradit.parallel.config import ParallelConfig
from paradit.parallel.mesh import ParallelContext, init_process_group
from paradit.pipelines import FAMILIES
from paradit.request import GenerationRequest, GenerationResult
from paradit.spec import ModelSpec

POLL_S = 0.5


class WorkerFailure(ParaditError):
    """A worker process died or raised; the group has been stopped."""


@dataclass(frozen=True)
class WorkerPlan:
    """Everything a worker needs to build its part of the pipeline (picklable, sent to each spawned process)."""

    spec: ModelSpec
    device_type: str
    dtype: torch.dtype
    dummy: bool
    parallel: ParallelConfig
    options: ExecutionOptions
    memory_cap: int | None
    init_method: str
    text_encoder_placement: str = "gpu"


def worker_device(device_type: str, local_rank: int) -> torch.device:
    return torch.device("cuda", local_rank) if device_type == "cuda" else torch.device("cpu")


def build_worker_pipeline(plan: WorkerPlan, rank: int, local_rank: int):
    """Join the group, build the mesh and load this rank's pipeline."""
    device = worker_device(plan.device_type, local_rank)
    if plan.memory_cap is not None:
        hold_to_cap(device, plan.memory_cap)
    init_process_group(device, rank, plan.parallel.world_size, plan.init_method)
    context = ParallelContext.build(plan.parallel, device)
    pipeline = FAMILIES[plan.spec.family].pipeline.load(
        plan.spec,
        device,
        plan.dtype,
        plan.dummy,
        parallel=context,
        quantize=plan.options.quantize,
        text_encoder_placement=plan.text_encoder_placement,
    )
    pipeline.transformer = apply_execution_options(pipeline.transformer, plan.options, device)
    return pipeline


def worker_main(rank: int, plan: WorkerPlan, requests: list[mp.Queue], results: mp.Queue) -> None:
    if plan.device_type == "cpu":
        # Processes sharing the CPU would otherwise each start one thread per core and thrash.
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // plan.parallel.world_size))
    try:
        pipeline = build_worker_pipeline(plan, rank, rank)
        results.put(("ready", rank, None))
        while (request := requests[rank].get()) is not None:
            result = pipeline.generate(request)
            if result is not None:
                result.timings.plan = plan.parallel.describe()
                results.put(("result", rank, result))
    except BaseException:  # noqa: BLE001 - whatever it is, the engine must hear it rather than hang
        results.put(("error", rank, traceback.format_exc(limit=8)))
        raise SystemExit(1) from None
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


class WorkerGroup:
    """Spawns ``plan.parallel.world_size`` workers on this host and talks to them through queues."""

    def __init__(self, plan: WorkerPlan) -> None:
        self.world_size = plan.parallel.world_size
        self._rendezvous = tempfile.TemporaryDirectory(prefix="paradit-")
        plan = WorkerPlan(**{**plan.__dict__, "init_method": f"file://{self._rendezvous.name}/store"})
        context = mp.get_context("spawn")
        self.requests = [context.Queue() for _ in range(self.world_size)]
        self.results = context.Queue()
        self.processes = [
            context.Process(target=worker_main, args=(rank, plan, self.requests, self.results), daemon=True)
            for rank in range(self.world_size)
        ]
        for process in self.processes:
            process.start()
        for _ in range(self.world_size):
            self._next_message()  # each worker says "ready" once its share of the model is loaded

    def _next_message(self) -> tuple[str, int, object]:
        """The next message from the workers; a worker's error or death stops the group and raises."""
        while True:
            try:
                kind, rank, payload = self.results.get(timeout=POLL_S)
            except queue.Empty:
                if any(p.exitcode is not None for p in self.processes):
                    raise self._failure() from None
                continue
            if kind == "error":
                raise self._failure(rank, payload)
            return kind, rank, payload

    def _failure(self, reporter: int | None = None, trace: str = "") -> WorkerFailure:
        """Stop the group and say why. A worker that died outright is the cause; the errors its peers then raise
        (a collective whose partner vanished) are consequences, so the dead are named first."""
        deadline = time.monotonic() + 2 * POLL_S
        while time.monotonic() < deadline and not self._dead(reporter):
            time.sleep(0.05)
        reasons = [f"worker {rank} exited with code {code}" for rank, code in self._dead(reporter)]
        if reporter is not None:
            reasons.append(f"worker {reporter} failed:\n{trace}")
        self.stop()
        return WorkerFailure("; ".join(reasons) + "\nthe worker group was stopped")

    def _dead(self, exclude: int | None) -> list[tuple[int, int]]:
        return [(r, p.exitcode) for r, p in enumerate(self.processes) if p.exitcode is not None and r != exclude]

    def generate(self, request: GenerationRequest) -> GenerationResult:
        if not self.processes:
            raise WorkerFailure("this engine's worker group was stopped; create a new Engine")
        for requests in self.requests:
            requests.put(request)
        _, _, result = self._next_message()
        return result

    def stop(self) -> None:
        for process in self.processes:
            if process.is_alive():
                process.terminate()
        for process in self.processes:
            process.join(timeout=10)
        self.processes = []
        self._rendezvous.cleanup()

    def close(self) -> None:
        """Ask the workers to finish, then stop whatever did not."""
        for requests in self.requests if self.processes else []:
            requests.put(None)
        for process in self.processes:
            process.join(timeout=30)
        self.stop()
