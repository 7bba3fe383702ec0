"""A server request's life: the ``Job`` the scheduler queues, runs and ends, and its errors."""

from __future__ import annotations

import time
import uuid
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from paradit.errors import ParaditError

if TYPE_CHECKING:
    from paradit.request import GenerationResult, ResolvedRequest

QUEUED, IN_PROGRESS, COMPLETED, FAILED, CANCELLED = "queued", "in_progress", "completed", "failed", "cancelled"
FINAL = (COMPLETED, FAILED, CANCELLED)


class QueueFull(ParaditError):
    """The queue holds ``--max-queue`` requests; ``retry_after`` estimates when there will be room, in seconds."""

    def __init__(self, message: str, retry_after: int) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class Draining(ParaditError):
    """The server is shutting down: it finishes the work it accepted and takes no more."""


class JobTimeout(ParaditError):
    """The request outlived the server's ``--timeout``."""


class JobCancelled(ParaditError):
    """The request was cancelled (``DELETE``, or its client went away) before it finished."""


@dataclass(eq=False)
class Job:
    """One API request, its seed drawn once; equal ``key``s may share a forward pass. The scheduler's lock guards it."""

    resolved: ResolvedRequest
    key: tuple | None
    deadline: float  # time.monotonic() past which it times out
    id: str = field(default_factory=lambda: uuid.uuid4().hex)
    created: float = field(default_factory=time.time)
    queued_at: float = field(default_factory=time.monotonic)
    started_at: float | None = None
    finished_at: float | None = None
    state: str = QUEUED
    plan: str = ""  # the plan of the group that runs it
    # Why nobody waits for it any more (a cancellation, a timeout); a running batch stops once all its jobs have one.
    abandoned: ParaditError | None = None
    future: Future[GenerationResult] = field(default_factory=Future)
    steps_done: int = 0  # while it runs, the scheduler reads the engine's count instead

    @property
    def images(self) -> int:
        return self.resolved.batch
