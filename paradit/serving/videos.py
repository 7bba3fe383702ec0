"""Video jobs (``/v1/videos``), the last ``keep`` kept; MP4s are encoded in a thread pool, not in a group's thread."""

from __future__ import annotations

import asyncio
import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

from paradit.errors import ParaditError
from paradit.outputs import encode_mp4, sparse_record
from paradit.serving.jobs import CANCELLED, COMPLETED, FAILED, FINAL, Job, JobCancelled
from paradit.serving.media import MEDIA_TYPES, file_metadata
from paradit.serving.scheduler import Scheduler
from paradit.serving.schemas import ErrorInfo, VideoJob
from paradit.serving.store import FileStore

DEFAULT_FPS = 16  # for a model that names no frame rate


@dataclass
class VideoEntry:
    job: Job
    content: str | None = None  # the MP4's name in the file store, once encoded
    encode_error: str | None = None


class VideoJobs:
    def __init__(self, scheduler: Scheduler, files: FileStore, model: str, keep: int = 256) -> None:
        self.scheduler, self.files, self.model, self.keep = scheduler, files, model, keep
        self._entries: OrderedDict[str, VideoEntry] = OrderedDict()
        self._lock = threading.Lock()
        self._encoder = ThreadPoolExecutor(max_workers=2, thread_name_prefix="paradit-mp4")

    def create(self, request) -> VideoEntry:
        entry = VideoEntry(self.scheduler.submit(request, video=True))
        with self._lock:
            self._entries[entry.job.id] = entry
            while len(self._entries) > self.keep:
                _, old = self._entries.popitem(last=False)
                self.files.remove(old.content)
        entry.job.future.add_done_callback(lambda future: self._encode(entry, future))
        return entry

    def get(self, video_id: str) -> VideoEntry | None:
        with self._lock:
            return self._entries.get(video_id)

    async def delete(self, entry: VideoEntry) -> str:
        """Stop the job if it has not ended, forget it and its file; its last status."""
        if entry.job.state not in FINAL:
            self.scheduler.cancel(entry.job, JobCancelled("the video job was cancelled by DELETE"))
            ended = asyncio.wrap_future(entry.job.future)
            await asyncio.wait([ended])
            ended.exception()  # the cancellation this asked for (read, so that asyncio does not report it)
        status = self.view(entry).status
        with self._lock:
            self._entries.pop(entry.job.id, None)
        self.files.remove(entry.content)
        return status

    def view(self, entry: VideoEntry) -> VideoJob:
        job, resolved = entry.job, entry.job.resolved
        status, error = job.state, None
        if job.state == COMPLETED and entry.content is None:  # the frames are back; the file is being written
            status = FAILED if entry.encode_error else "in_progress"
            if entry.encode_error:
                error = ErrorInfo(message=entry.encode_error, type="server_error")
        elif job.state in (FAILED, CANCELLED):
            error = ErrorInfo(message=str(job.future.exception()), type=type(job.future.exception()).__name__)
        steps_done = self.scheduler.steps_done(job)
        sparse = sparse_record(job.future.result().timings) if job.state == COMPLETED and job.future.done() else None
        return VideoJob(
            id=job.id,
            model=self.model,
            status=status,
            progress=100 * steps_done // resolved.steps,
            steps_done=steps_done,
            steps=resolved.steps,
            created_at=int(job.created),
            completed_at=int(job.created + job.finished_at - job.queued_at) if status == COMPLETED else None,
            size=f"{resolved.width}x{resolved.height}",
            frames=resolved.frames,
            seed=resolved.seed,
            error=error,
            sparse_attention=sparse,
        )

    def _encode(self, entry: VideoEntry, future: Future) -> None:
        if future.cancelled() or future.exception() is not None:
            return
        result = future.result()
        metadata = file_metadata(sparse_record(result.timings))
        self._encoder.submit(self._write, entry, result.frames[0], entry.job.resolved.fps or DEFAULT_FPS, metadata)

    def _write(self, entry: VideoEntry, frames, fps: int, metadata: dict[str, str]) -> None:
        try:
            entry.content = self.files.put(encode_mp4(frames, fps, metadata), MEDIA_TYPES["mp4"], "mp4")
        except (ParaditError, ValueError, OSError) as exc:  # PyAV's errors are OSError and ValueError subclasses
            entry.encode_error = f"the MP4 could not be written: {exc}"

    def close(self) -> None:
        self._encoder.shutdown(wait=True)
