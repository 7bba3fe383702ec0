"""The front's scheduler under ``paradit serve --ray``: it checks and seeds each request as ``Scheduler.submit`` does,
then runs it on a replica (a paradit group elsewhere) through ``run``, once more on another if that replica dies."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Awaitable, Callable

from paradit.errors import ParaditError
from paradit.request import GenerationRequest, GenerationResult, ResolvedRequest
from paradit.serving.jobs import CANCELLED, COMPLETED, FAILED, IN_PROGRESS, Draining, Job

RETRY_AFTER_S = 10  # about a replica's restart on the tiny models; a client told to wait longer would idle


class ReplicaLost(ParaditError):
    """The replica running the request died, and so did the one it was retried on: 503 with ``retry_after``."""

    def __init__(self, message: str, retry_after: int = RETRY_AFTER_S) -> None:
        super().__init__(message)
        self.retry_after = retry_after


# run(seeded request, video) -> (result, the plan of the group that ran it); raises ``lost`` when its replica died
RunOnReplica = Callable[[GenerationRequest, bool], Awaitable[tuple[GenerationResult, str]]]


class RemoteScheduler:
    """What ``create_app`` asks of a scheduler (submit, check, cancel, steps_done, health, drain, close) remotely."""

    def __init__(
        self,
        check: Callable[[GenerationRequest], ResolvedRequest],
        run: RunOnReplica,
        lost: tuple[type[BaseException], ...],
        timeout_s: float,
    ) -> None:
        self.check, self.run, self.lost, self.timeout_s = check, run, lost, timeout_s
        self.accepting = True
        self._running: dict[Job, asyncio.Task] = {}

    def submit(self, request: GenerationRequest, video: bool = False) -> Job:
        """Called on the front's event loop: the job runs there as a task, its seed drawn here once for every try."""
        if not self.accepting:
            raise Draining("the server is shutting down and takes no new requests")
        resolved = self.check(request)
        job = Job(resolved, None, deadline=time.monotonic() + self.timeout_s)
        seeded = dataclasses.replace(request, seed=resolved.seed)
        self._running[job] = asyncio.get_running_loop().create_task(self._run(job, seeded, video))
        return job

    async def _run(self, job: Job, request: GenerationRequest, video: bool) -> None:
        job.state, job.started_at = IN_PROGRESS, time.monotonic()
        try:
            try:
                result, job.plan = await asyncio.wait_for(self.run(request, video), self.timeout_s)
            except self.lost:  # the same seed on another replica: the same image
                result, job.plan = await asyncio.wait_for(self.run(request, video), self.timeout_s)
        except self.lost as twice:
            self._end(job, FAILED, ReplicaLost(f"the replicas running this request died ({type(twice).__name__})"))
        except asyncio.CancelledError:
            self._end(job, CANCELLED, job.abandoned or Draining("the server stopped while running the request"))
        except ParaditError as refused:
            self._end(job, FAILED, refused)
        else:
            job.steps_done = job.resolved.steps
            self._end(job, COMPLETED, result)

    def _end(self, job: Job, state: str, outcome) -> None:
        job.state, job.finished_at = state, time.monotonic()
        self._running.pop(job, None)
        if isinstance(outcome, BaseException):
            job.future.set_exception(outcome)
        else:
            job.future.set_result(outcome)

    def cancel(self, job: Job, reason: ParaditError) -> None:
        job.abandoned = reason
        task = self._running.get(job)
        if task is not None:
            task.cancel()

    def steps_done(self, job: Job) -> int:
        return job.steps_done

    def health(self) -> tuple[str, int, list]:
        """(status, requests in flight, groups): the replicas' own health is Ray Serve's to watch."""
        return "ok" if self.accepting else "draining", len(self._running), []

    def drain(self) -> None:
        self.accepting = False

    async def finished(self) -> None:
        """Once every accepted request has ended (each task sets its job's outcome before it ends)."""
        await asyncio.gather(*self._running.values(), return_exceptions=True)

    def close(self) -> None:
        self.accepting = False
        for task in list(self._running.values()):
            task.cancel()
