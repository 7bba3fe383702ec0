"""``paradit serve --ray``'s Ray Serve application: replicas that are each one paradit group (``build_scheduler``'s
scheduler over one group, its GPUs reserved through Ray), behind one front replica running ``create_app``'s FastAPI app
over them. The front checks every request with its replica's settled run before sending it on, draws its seed there
(so a request is idempotent: one lost with its replica is sent once more), and keeps the video jobs and files, which
outlive any replica. What a replica does not answer (its process died twice) is a 503 with ``Retry-After``. The
engine, the app and torch are imported where a replica builds them: the command that deploys needs none of them."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import math
import os
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import ray
from ray import serve
from ray.serve.exceptions import ReplicaUnavailableError, RequestCancelledError

from paradit.errors import ParaditError
from paradit.serving import jobs
from paradit.serving.jobs import Draining, GroupLost, Job, JobCancelled, JobTimeout, QueueFull
from paradit.serving.metrics import Metrics
from paradit.worker import RequestFailed, start_worker_server

if TYPE_CHECKING:
    from ray.serve.handle import DeploymentHandle, DeploymentResponse

    from paradit.options import ServeSettings
    from paradit.request import GenerationRequest, GenerationResult, ResolvedRequest
    from paradit.serving.server import ServerConfig

logger = logging.getLogger(__name__)

APP_NAME = "paradit"
FRONT_REQUESTS = 100_000  # the front's Ray Serve limit: far past --max-queue, so that paradit's own 429 is what answers
# A replica's process gone (killed, its node lost), as a call to it fails.
LOST = (ray.exceptions.RayActorError, ReplicaUnavailableError)
LOST_RETRIES = 1  # a request whose replica died is sent once more (its seed drawn at the front: the same image)
HEALTH_CHECK_S = 2  # how often Serve probes a replica (its default 10 s): a lost one is routed to until it notices


@dataclass(frozen=True)
class Refusal:
    """A ``ParaditError`` on its way back from a replica: pickle would rebuild it from its message alone, losing
    ``QueueFull``'s ``retry_after`` and ``InvalidRequest``'s ``param``."""

    kind: type[ParaditError]
    message: str
    state: dict[str, Any]

    @classmethod
    def of(cls, error: ParaditError) -> Refusal:
        return cls(type(error), str(error), dict(vars(error)))

    def error(self) -> ParaditError:
        error = self.kind.__new__(self.kind, self.message)
        error.args = (self.message,)
        vars(error).update(self.state)
        return error


@dataclass(frozen=True)
class ReplicaReport:
    """What a replica says of itself with each answer: the front's /health lists it (``workers``: the replica's process
    first), and ``start_s`` (how long it took to start) is the ``Retry-After`` of a request it was lost with."""

    actor_id: str
    state: str
    plan: str
    workers: list[int]
    restarts: int
    start_s: float


@dataclass(frozen=True)
class Ran:
    outcome: GenerationResult | Refusal
    replica: ReplicaReport


def eight_bit(result: GenerationResult) -> GenerationResult:
    """``result`` with its pixels as the 8-bit levels every answer is made of (``GenerationResult.images``' rounding):
    a quarter of the bytes to send from replica to front, which a long video's frames make worth it."""
    import torch

    return dataclasses.replace(result, pixels=(result.pixels * 255).round().to(torch.uint8))


def from_eight_bit(result: GenerationResult) -> GenerationResult:
    """Pixels in [0, 1] again, whose rounding gives back exactly the levels sent."""
    return dataclasses.replace(result, pixels=result.pixels.float() / 255)


class GroupReplica:
    """One paradit group in a Ray Serve replica: ``paradit serve``'s scheduler over the GPUs Ray reserved for it."""

    def __init__(self, settings: ServeSettings) -> None:
        started = time.monotonic()
        start_worker_server(settings.asked.device)
        from paradit.serving.launch import build_scheduler

        self.scheduler, self.config = build_scheduler(settings, Metrics())
        self.scheduler.start()
        self.start_s = time.monotonic() - started
        self.actor_id = ray.get_runtime_context().get_actor_id()

    def settled(self) -> tuple[Callable[[GenerationRequest], ResolvedRequest], ServerConfig]:
        """The request check of this replica's settled run (a partial of ``check_request``) and the app's config."""
        return self.scheduler.check, self.config

    async def run(self, request: GenerationRequest, video: bool) -> Ran:
        try:
            job = self.scheduler.submit(request, video=video)
            try:
                outcome = eight_bit(await asyncio.wrap_future(job.future))
            except asyncio.CancelledError:  # the front cancelled the call: its client left, or DELETE
                self.scheduler.cancel(job, JobCancelled("the request was cancelled"))
                raise
        except ParaditError as refused:
            outcome = Refusal.of(refused)
        return Ran(outcome, self.report())

    def report(self) -> ReplicaReport:
        _, _, (group,) = self.scheduler.health()
        workers = [os.getpid(), *group.workers]
        return ReplicaReport(self.actor_id, group.state, group.plan, workers, group.restarts, self.start_s)

    def check_health(self) -> None:
        """Ray Serve's probe: a group that stopped (it could not be rebuilt) has the replica replaced."""
        status, _, _ = self.scheduler.health()
        if self.report().state == "stopped" and status != "draining":
            raise RuntimeError("the replica's group stopped")

    def __del__(self) -> None:
        scheduler = getattr(self, "scheduler", None)
        if scheduler is not None:
            scheduler.close()


@dataclass
class ReplicaRow:
    """A replica as /health lists it (``schemas.GroupHealth``'s fields)."""

    index: int
    state: str
    plan: str
    workers: list[int]
    restarts: int


class ReplicaScheduler:
    """The front's ``Scheduler``: ``create_app`` and ``VideoJobs`` submit to it as to one; it checks each request with
    a replica's ``check`` and runs it on whichever replica Ray Serve's router picks (the least loaded of two)."""

    def __init__(self, groups: DeploymentHandle, check, metrics: Metrics, max_queue: int, timeout_s: float) -> None:
        self.groups, self.check, self.metrics = groups, check, metrics
        self.max_queue, self.timeout_s = max_queue, timeout_s
        self.accepting = True
        self._calls: dict[Job, DeploymentResponse | None] = {}  # every job not ended, and its call to a replica
        self._replicas: dict[str, ReplicaRow] = {}  # by actor id, as they answered
        self._start_s = 1.0  # a replica's start time, as the last one to answer measured it
        self._run_seconds: deque[float] = deque(maxlen=20)  # recent requests' times, sent to answered

    def submit(self, request: GenerationRequest, video: bool = False) -> Job:
        """Check and queue ``request`` (on the event loop's thread, as the app's handlers run); its seed drawn here."""
        resolved = self.check(request)
        if not self.accepting:
            raise Draining("the server is shutting down and takes no new requests")
        if len(self._calls) >= self.max_queue + len(self._replicas):
            message = f"the queue is full ({self.max_queue} requests waiting); retry later"
            raise QueueFull(message, self._retry_after())
        job = Job(resolved, None, deadline=time.monotonic() + self.timeout_s)
        self._calls[job] = None
        self.metrics.queue_depth.set(len(self._calls))
        seeded = dataclasses.replace(request, seed=resolved.seed)
        asyncio.get_running_loop().create_task(self._run(job, seeded, video))
        return job

    async def _run(self, job: Job, request: GenerationRequest, video: bool) -> None:
        job.state, job.started_at = jobs.IN_PROGRESS, time.monotonic()
        for attempt in range(LOST_RETRIES + 1):
            if job.future.done():  # cancelled while its call was out
                return
            call = self._calls[job] = self.groups.run.remote(request, video)
            try:
                ran = await asyncio.wait_for(asyncio.shield(call), job.deadline - time.monotonic())
            except TimeoutError:
                call.cancel()
                outcome = JobTimeout(f"the request did not finish within {self.timeout_s:g} s")
            except LOST as lost:
                self._replicas.pop(getattr(lost, "actor_id", None) or "", None)
                logger.warning("a replica was lost running request %s (attempt %d): %s", job.id, attempt + 1, lost)
                continue
            except (ray.exceptions.TaskCancelledError, RequestCancelledError):
                outcome = JobCancelled("the request was cancelled")
            except ray.exceptions.RayError as failed:  # not a paradit error: the replica's code failed
                outcome = RequestFailed(f"the replica failed the request: {failed}")
            else:
                return self._record(job, ran)
            return self._end(job, outcome)
        retry_after = math.ceil(self._start_s)
        message = f"the replica running the request was lost, twice; Ray is replacing it: retry in {retry_after} s"
        self._end(job, GroupLost(message, retry_after))

    def _record(self, job: Job, ran: Ran) -> None:
        report = ran.replica
        row = self._replicas.get(report.actor_id)
        if row is None:  # a replica's first answer; one that replaced a lost one takes the next index
            index = 1 + max((other.index for other in self._replicas.values()), default=-1)
            row = self._replicas[report.actor_id] = ReplicaRow(index, "", "", [], 0)
        row.state, row.plan, row.workers, row.restarts = report.state, report.plan, report.workers, report.restarts
        self._start_s = report.start_s
        job.plan = report.plan
        if isinstance(ran.outcome, Refusal):
            return self._end(job, ran.outcome.error())
        self.metrics.record_run(row.index, ran.outcome.timings, job.images)
        self._run_seconds.append(time.monotonic() - job.started_at)
        self._end(job, from_eight_bit(ran.outcome))

    def _end(self, job: Job, outcome: GenerationResult | ParaditError) -> None:
        self._calls.pop(job, None)
        self.metrics.queue_depth.set(len(self._calls))
        if job.future.done():  # cancelled while its call was out
            return
        job.finished_at = time.monotonic()
        if isinstance(outcome, ParaditError):
            job.state = jobs.CANCELLED if isinstance(outcome, JobCancelled) else jobs.FAILED
            job.future.set_exception(outcome)
        else:
            job.state, job.steps_done = jobs.COMPLETED, job.resolved.steps
            job.future.set_result(outcome)

    def _retry_after(self) -> int:
        """Seconds until the queue has room, from recent requests' times (as ``Scheduler``'s estimate)."""
        run_s = sum(self._run_seconds) / len(self._run_seconds) if self._run_seconds else 1.0
        return max(1, math.ceil(run_s * len(self._calls) / max(1, len(self._replicas))))

    def cancel(self, job: Job, reason: ParaditError) -> None:
        """End ``job`` with ``reason`` now; its replica stops the run at the next step (the call cancelled)."""
        call = self._calls.get(job)
        if call is not None:
            call.cancel()
        self._end(job, reason)

    def steps_done(self, job: Job) -> int:
        """The steps a job has run, as far as the front knows: none until its replica answers."""
        return job.steps_done

    def health(self) -> tuple[str, int, list[ReplicaRow]]:
        rows = sorted(self._replicas.values(), key=lambda row: row.index)
        states = {row.state for row in rows}
        status = "ok" if states <= {"serving"} else "degraded"
        return status if self.accepting else "draining", len(self._calls), rows

    async def drain(self) -> None:
        """Refuse new requests (503) and return once every accepted one has ended."""
        self.accepting = False
        while self._calls:
            await asyncio.sleep(0.05)


@serve.ingress()
class Front:
    """The HTTP front: ``create_app``'s app over a ``ReplicaScheduler``, built once a replica has settled its run."""

    def __init__(self, groups: DeploymentHandle, max_queue: int, timeout_s: float) -> None:
        self.groups, self.max_queue, self.timeout_s = groups, max_queue, timeout_s
        self.scheduler: ReplicaScheduler | None = None

    async def __serve_build_asgi_app__(self):
        from paradit.serving.server import create_app

        check, config = await self.groups.settled.remote()
        metrics = Metrics()
        self.scheduler = ReplicaScheduler(self.groups, check, metrics, self.max_queue, self.timeout_s)
        return create_app(self.scheduler, config, metrics)

    async def drain(self) -> None:
        await self.scheduler.drain()


def application(settings: ServeSettings):
    """The Ray Serve application for ``settings`` (checked by ``ServeSettings.check_replicas``)."""
    settings.check_replicas()
    size = settings.gpus_per_replica
    on_cpu = settings.asked.device == "cpu"
    # Processes on the CPU, GPUs otherwise: Ray sets CUDA_VISIBLE_DEVICES to the ones it reserved.
    resources = {"num_cpus": size, "num_gpus": 0} if on_cpu else {"num_cpus": 1, "num_gpus": size}
    if settings.max_replicas is not None:
        autoscaling = {
            "min_replicas": settings.min_replicas or 1,
            "max_replicas": settings.max_replicas,
            "target_ongoing_requests": settings.target_queue,
        }
        scale = {"autoscaling_config": autoscaling}
    else:
        scale = {"num_replicas": settings.replicas or 1}
    group = serve.deployment(
        GroupReplica,
        name="ParaditGroup",
        ray_actor_options=resources,
        # A batch running and one waiting: the rest wait at the front's router, for whichever replica frees first.
        max_ongoing_requests=2 * settings.max_batch,
        health_check_period_s=HEALTH_CHECK_S,
        **scale,
    )
    front = serve.deployment(
        Front,
        name="ParaditFront",
        num_replicas=1,
        ray_actor_options={"num_cpus": 0},
        max_ongoing_requests=FRONT_REQUESTS,
    )
    one_group = dataclasses.replace(settings, gpus=size, group_size=None)
    return front.bind(group.bind(one_group), settings.max_queue, settings.timeout_s)
