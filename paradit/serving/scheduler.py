"""The server's bounded job queue and its groups (an ``Engine`` and a thread each): batching, deadlines, rebuilds."""

from __future__ import annotations

import logging
import math
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING

from paradit.errors import InvalidRequest, ParaditError
from paradit.pipelines.requests import batch_key
from paradit.serving import jobs
from paradit.serving.jobs import Draining, Job, JobCancelled, JobTimeout, QueueFull
from paradit.worker import RequestCancelled, RequestFailed, WorkerFailure

if TYPE_CHECKING:
    from paradit.engine import Engine
    from paradit.request import GenerationRequest, GenerationResult, ResolvedRequest
    from paradit.serving.metrics import Metrics
    from paradit.serving.pace import Pace

logger = logging.getLogger(__name__)

STARTING, SERVING, RESTARTING, STOPPED = "starting", "serving", "restarting", "stopped"
RESTART_BACKOFF_S = 2.0  # between attempts to rebuild a group whose rebuild failed
WATCH_S = 0.05  # how often deadlines are checked
CLOSE_S = 30  # how long closing waits for a group's thread to end its run
# How long past a step's estimated time a cancelled run may take to reach a step boundary before its workers are
# killed: rebuilding a group costs a reload, holding the queue behind a run costs every request in it.
STOP_GRACE_S = 3.0
ESTIMATE_MARGIN = 3  # how far past the deadline a request's estimate must be for it to be refused


class Group:
    """One engine and the thread that serves the queue with it; ``build(index)`` makes (and remakes) the engine."""

    def __init__(self, index: int, build: Callable[[int], Engine], scheduler: Scheduler) -> None:
        self.index, self._build, self._scheduler = index, build, scheduler
        self.plan, self.state, self.restarts = "", STARTING, 0
        self.engine: Engine | None = None
        self.batch: list[Job] = []
        self.stop_by: float | None = None  # when a cancelled run that has not stopped gets its workers killed
        self.error: BaseException | None = None  # why its first start failed
        self.thread = threading.Thread(target=self._serve, name=f"paradit-group-{index}", daemon=True)

    @property
    def workers(self) -> list[int]:
        return self.engine.worker_pids if self.engine is not None else []

    def _serve(self) -> None:
        scheduler = self._scheduler
        while not scheduler.closing:
            if self.engine is None and not self._start():
                break
            if (batch := scheduler.take(self)) is None:
                break
            self._run(batch)
        if self.engine is not None:
            self.engine.close()
        scheduler.set_state(self, STOPPED)

    def _start(self) -> bool:
        """Build the engine; a first start that fails ends the group (the server reports it), a rebuild is retried."""
        while not self._scheduler.closing:
            try:
                engine = self._build(self.index)
            except Exception as exc:  # noqa: BLE001 - reported, or retried
                if self.restarts == 0:
                    self.error = exc
                    return False
                logger.exception("group %d could not be rebuilt; retrying in %s s", self.index, RESTART_BACKOFF_S)
                time.sleep(RESTART_BACKOFF_S)
                continue
            self.engine, self.plan = engine, engine.plan
            self._scheduler.set_state(self, SERVING)
            return True
        return False

    def _run(self, batch: list[Job]) -> None:
        scheduler = self._scheduler
        try:
            results = self.engine.generate([job.resolved for job in batch])
        except WorkerFailure as exc:
            scheduler.finish(self, exc)
            logger.error("group %d: %s; rebuilding it", self.index, exc)
            self.engine.close()
            self.engine = None
            self.restarts += 1
            scheduler.metrics.restarts.labels(str(self.index)).inc()
            scheduler.set_state(self, RESTARTING)
        except RequestCancelled:
            scheduler.finish(self, JobCancelled("the request was cancelled"))
        except RequestFailed as exc:
            logger.error("group %d failed a batch: %s", self.index, exc)
            scheduler.finish(self, exc)
        except ParaditError as exc:
            scheduler.finish(self, exc)
        except Exception as exc:  # noqa: BLE001 - a fault on the engine's side of this batch: the group serves on
            logger.exception("group %d failed a batch", self.index)
            scheduler.finish(self, RequestFailed(f"{type(exc).__name__}: {exc}"))
        else:
            scheduler.metrics.record_run(self.index, results[0].timings, sum(job.images for job in batch))
            if scheduler.pace is not None:
                scheduler.pace.record([job.resolved for job in batch], results[0].timings.step_ms)
            scheduler.finish(self, results)


class Scheduler:
    """``build(index)`` makes group ``index``'s engine; ``check(request)`` resolves a request, running nothing."""

    def __init__(
        self,
        build: Callable[[int], Engine],
        groups: int,
        check: Callable[[GenerationRequest], ResolvedRequest],
        metrics: Metrics,
        max_batch: int = 1,
        max_queue: int = 64,
        timeout_s: float = 600.0,
        auto: bool = False,
        pace: Pace | None = None,
    ) -> None:
        self.check, self.metrics, self.pace = check, metrics, pace
        self.max_batch, self.max_queue, self.timeout_s, self.auto = max_batch, max_queue, timeout_s, auto
        self._split: bool | None = None  # under auto: whether the last batch ran split across every GPU
        self.accepting, self.closing = True, False
        self.groups = [Group(index, build, self) for index in range(groups)]
        self._queue: list[Job] = []
        self._changed = threading.Condition()
        self._run_seconds: deque[float] = deque(maxlen=20)  # recent batches' run times, for Retry-After
        self._watch = threading.Thread(target=self._watch_deadlines, name="paradit-deadlines", daemon=True)

    def start(self) -> None:
        """Start every group (together) and wait until each serves; raises the first group's start failure."""
        for group in self.groups:
            group.thread.start()
        self._watch.start()
        with self._changed:
            self._changed.wait_for(lambda: all(g.state != STARTING for g in self.groups))
        failed = next((g.error for g in self.groups if g.error is not None), None)
        if failed is not None:
            self.close()
            raise failed

    def submit(self, request: GenerationRequest, video: bool = False) -> Job:
        """Queue a request, its seed drawn now if it has none; raises InvalidRequest, QueueFull or Draining."""
        resolved = self.check(request)
        self._check_deadline(resolved)
        key = None if video else batch_key(resolved)
        job = Job(resolved, key, deadline=time.monotonic() + self.timeout_s)
        with self._changed:
            if not self.accepting:
                raise Draining("the server is shutting down and takes no new requests")
            if len(self._queue) >= self.max_queue:
                message = f"the queue is full ({self.max_queue} requests waiting); retry later"
                raise QueueFull(message, self._retry_after())
            self._queue.append(job)
            self.metrics.queue_depth.set(len(self._queue))
            self._changed.notify_all()
        return job

    def _step_seconds(self, requests: list[ResolvedRequest]) -> float | None:
        return self.pace.step_seconds(requests) if self.pace is not None else None

    def _check_deadline(self, resolved: ResolvedRequest) -> None:
        step_s = self._step_seconds([resolved])
        if step_s is not None and step_s * resolved.steps > ESTIMATE_MARGIN * self.timeout_s:
            spec = self.pace.spec
            param = "size" if resolved.height * resolved.width > spec.height * spec.width else "steps"
            raise InvalidRequest(
                f"{resolved.width}x{resolved.height} with {resolved.steps} steps would take about "
                f"{step_s * resolved.steps:.0f} s here (this server's measured pace), past its {self.timeout_s:g} s "
                f"timeout; ask for {'a smaller size' if param == 'size' else 'fewer steps'}",
                param=param,
            )

    def cancel(self, job: Job, reason: ParaditError) -> None:
        """End a queued job with ``reason`` now; a running batch stops once no job of it is waited for."""
        with self._changed:
            self._abandon(job, reason)

    def steps_done(self, job: Job) -> int:
        with self._changed:
            group = self._group_of(job)
            return group.engine.steps_done if group is not None else job.steps_done

    def health(self) -> tuple[str, int, list[Group]]:
        """(status, queue length, groups): ok when every group serves, degraded while one restarts or is stopped."""
        with self._changed:
            states = {group.state for group in self.groups}
            starting = STARTING in states and SERVING not in states
            status = "ok" if states == {SERVING} else "starting" if starting else "degraded"
            return status if self.accepting else "draining", len(self._queue), list(self.groups)

    def drain(self) -> None:
        with self._changed:
            self.accepting = False
            self._changed.wait_for(lambda: not self._queue and not any(group.batch for group in self.groups))

    def close(self) -> None:
        """Stop: queued jobs end with Draining, running batches are stopped, the engines closed."""
        with self._changed:
            self.accepting, self.closing = False, True
            for job in list(self._queue):
                self._abandon(job, Draining("the server stopped before running the request"))
            for group in self.groups:
                for job in group.batch:
                    self._abandon(job, Draining("the server stopped while running the request"))
            self._changed.notify_all()
        for group in self.groups:
            if group.thread.is_alive():
                group.thread.join(CLOSE_S)
            if group.thread.is_alive() and group.engine is not None:  # still in a run that would not stop
                group.engine.close()

    def take(self, group: Group) -> list[Job] | None:
        """The next batch for ``group`` (waiting for one), or None when the server closes."""
        with self._changed:
            self._changed.wait_for(lambda: self.closing or self._may_take(group))
            if self.closing:
                return None
            if self.auto and self._split is not None and self._split != (group is self.groups[0]):
                self.metrics.mode_switches.inc()
            self._split = group is self.groups[0]
            first = self._queue[0]
            batch, images = [first], first.images
            for job in self._queue[1:] if first.key is not None else []:
                if job.key == first.key and images + job.images <= self.max_batch:
                    batch.append(job)
                    images += job.images
            now = time.monotonic()
            for job in batch:
                self._queue.remove(job)
                job.state, job.started_at, job.plan = jobs.IN_PROGRESS, now, group.plan
                self.metrics.latency.labels("queue").observe(now - job.queued_at)
            self.metrics.queue_depth.set(len(self._queue))
            group.batch, group.stop_by = batch, None
            return batch

    def finish(self, group: Group, outcome: list[GenerationResult] | ParaditError) -> None:
        """End ``group``'s batch: each job with its result, or all with the error (an abandoned job with its reason)."""
        with self._changed:
            batch, group.batch = group.batch, []
            if isinstance(outcome, list):
                self._run_seconds.append(time.monotonic() - batch[0].started_at)
            for index, job in enumerate(batch):
                job.steps_done = group.engine.steps_done if group.engine is not None else 0
                self._end(job, job.abandoned or (outcome[index] if isinstance(outcome, list) else outcome))
            self._changed.notify_all()

    def set_state(self, group: Group, state: str) -> None:
        with self._changed:
            group.state = state
            self._changed.notify_all()

    # Under the lock.

    def _may_take(self, group: Group) -> bool:
        """Under ``auto``, group 0 (every GPU) takes a short queue (one batch's images) while the one-GPU groups are
        idle, they take the rest while it is; a side not serving (being rebuilt) leaves the queue to the other."""
        if not self._queue:
            return False
        if not self.auto:
            return True
        spanning, singles = self.groups[0], self.groups[1:]
        short = sum(job.images for job in self._queue) <= self.max_batch
        if group is spanning:
            return not any(g.batch for g in singles) and (short or all(g.state != SERVING for g in singles))
        return not spanning.batch and (not short or any(g.batch for g in singles) or spanning.state != SERVING)

    def _group_of(self, job: Job) -> Group | None:
        return next((group for group in self.groups if job in group.batch), None)

    def _abandon(self, job: Job, reason: ParaditError) -> None:
        if job.state == jobs.QUEUED:
            self._queue.remove(job)
            self.metrics.queue_depth.set(len(self._queue))
            self._end(job, reason)
        elif job.state == jobs.IN_PROGRESS and job.abandoned is None:
            job.abandoned = reason
            group = self._group_of(job)
            if group is not None and all(other.abandoned for other in group.batch):
                group.engine.cancel()
                step_s = self._step_seconds([other.resolved for other in group.batch]) or 0.0
                group.stop_by = time.monotonic() + STOP_GRACE_S + step_s

    def _end(self, job: Job, outcome: GenerationResult | ParaditError) -> None:
        job.finished_at = time.monotonic()
        if isinstance(outcome, ParaditError):
            job.state = jobs.CANCELLED if isinstance(outcome, JobCancelled) else jobs.FAILED
            job.future.set_exception(outcome)
        else:
            job.state, job.steps_done = jobs.COMPLETED, job.resolved.steps
            job.future.set_result(outcome)

    def _retry_after(self) -> int:
        """Seconds until the queue has room, estimated from recent batches' run times."""
        run_s = sum(self._run_seconds) / len(self._run_seconds) if self._run_seconds else 1.0
        return max(1, math.ceil(run_s * len(self._queue) / (len(self.groups) * self.max_batch)))

    def _watch_deadlines(self) -> None:
        with self._changed:
            while not self.closing:
                now = time.monotonic()
                late = [job for job in self._queue if job.deadline <= now]
                late += [job for group in self.groups for job in group.batch if job.deadline <= now]
                for job in late:
                    self._abandon(job, JobTimeout(f"the request did not finish within {self.timeout_s:g} s"))
                for group in self.groups:
                    if group.batch and group.stop_by is not None and group.stop_by <= now:
                        logger.warning(
                            "group %d: a cancelled run did not reach a step boundary in time; killing its workers",
                            group.index,
                        )
                        group.stop_by = None
                        group.engine.abort()
                self._changed.wait(WATCH_S)
