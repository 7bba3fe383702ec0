"""Video jobs (``/v1/videos``), the last ``keep`` kept; MP4s are encoded in a thread pool, not in a group's thread.
With ``records`` (``--files-dir``), each job's status is recorded in a folder as it changes, and every server process
over that folder answers for every job recorded there; a job whose process died mid-run (its run with it) keeps its
last recorded status until it is trimmed."""

from __future__ import annotations

import asyncio
import logging
import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

from paradit.errors import ParaditError
from paradit.outputs import encode_mp4, sparse_record
from paradit.serving.jobs import CANCELLED, COMPLETED, FAILED, FINAL, Job, JobCancelled
from paradit.serving.media import file_metadata
from paradit.serving.records import JobRecords, Record
from paradit.serving.scheduler import Scheduler
from paradit.serving.schemas import ErrorInfo, VideoJob
from paradit.serving.store import DirectoryStore, FileStore

logger = logging.getLogger(__name__)

DEFAULT_FPS = 16  # for a model that names no frame rate
RECORD_EVERY_S = 1.0  # how often the progress of running jobs is recorded for the other processes over the folder


@dataclass
class VideoEntry:
    """A job this process runs (``job``), or one that another process over the folder runs or ran (``job`` None)."""

    job: Job | None
    content: str | None = None  # the MP4's name in the file store, once encoded
    encode_error: str | None = None
    recorded: VideoJob | None = None  # its status as last recorded in the folder

    @property
    def id(self) -> str:
        return self.recorded.id if self.job is None else self.job.id


class VideoJobs:
    def __init__(
        self,
        scheduler: Scheduler,
        files: FileStore | DirectoryStore,
        model: str,
        keep: int = 256,
        records: JobRecords | None = None,
    ) -> None:
        self.scheduler, self.files, self.model, self.keep, self.records = scheduler, files, model, keep, records
        self._entries: OrderedDict[str, VideoEntry] = OrderedDict()  # the jobs this process runs
        self._lock = threading.Lock()
        self._encoder = ThreadPoolExecutor(max_workers=2, thread_name_prefix="paradit-mp4")
        self._recording = threading.Lock()  # one status computed and written at a time: a later one is never undone
        self._closed = threading.Event()
        self._recorder = None
        if records is not None:
            self._recorder = threading.Thread(target=self._record_progress, name="paradit-records", daemon=True)
            self._recorder.start()

    def create(self, request) -> VideoEntry:
        entry = VideoEntry(self.scheduler.submit(request, video=True))
        if self.records is not None:  # recorded before the recorder can see it
            entry.recorded = self.view(entry)
            self.records.create(Record(entry.recorded, None, entry.job.created))
        with self._lock:
            self._entries[entry.job.id] = entry
            while len(self._entries) > self.keep:
                _, old = self._entries.popitem(last=False)
                self.files.remove(old.content)
        if self.records is not None:  # reading every record: in the pool, off the event loop
            self._encoder.submit(self._trim)
        entry.job.future.add_done_callback(lambda future: self._encode(entry, future))
        return entry

    def get(self, video_id: str) -> VideoEntry | None:
        with self._lock:
            entry = self._entries.get(video_id)
        if self.records is None:
            return entry
        record = self.records.load(video_id)
        if record is None:  # never recorded, or forgotten by a process over the folder (DELETE, trimming)
            self._forget(video_id)
            return None
        return entry or VideoEntry(None, record.content, recorded=record.view)

    async def delete(self, entry: VideoEntry) -> str:
        """Stop the job if this process runs it and it has not ended, forget it and its file; its last status. A job
        that another process over the folder runs is forgotten there too (its record and file removed), but its run
        goes on, and its MP4 is not kept."""
        if entry.job is not None and entry.job.state not in FINAL:
            self.scheduler.cancel(entry.job, JobCancelled("the video job was cancelled by DELETE"))
            ended = asyncio.wrap_future(entry.job.future)
            await asyncio.wait([ended])
            ended.exception()  # the cancellation this asked for (read, so that asyncio does not report it)
        status = self.view(entry).status
        self._forget(entry.id)
        if self.records is not None:
            self.records.remove(entry.id)
        self.files.remove(entry.content)
        return status

    def view(self, entry: VideoEntry) -> VideoJob:
        if entry.job is None:
            return entry.recorded
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
            entry.content = self.files.put(encode_mp4(frames, fps, metadata), "mp4")
        except (ParaditError, ValueError, OSError) as exc:  # PyAV's errors are OSError and ValueError subclasses
            entry.encode_error = f"the MP4 could not be written: {exc}"
        self._record(entry)

    def _record(self, entry: VideoEntry) -> None:
        """Record the job's status if it changed; a job forgotten meanwhile by any process over the folder is
        forgotten here too, its MP4 with it."""
        if self.records is None:
            return
        with self._recording:
            view = self.view(entry)
            if view == entry.recorded:
                return
            entry.recorded = view
            try:
                kept = self.records.update(Record(view, entry.content, entry.job.created))
            except ParaditError as exc:  # the folder's fault: the job runs on, its status answered from here
                logger.warning("video job %s: its status was not recorded: %s", entry.id, exc)
                return
        if not kept:
            self._forget(entry.id)
            self.files.remove(entry.content)

    def _record_progress(self) -> None:
        while not self._closed.wait(RECORD_EVERY_S):
            self._record_changes()

    def _record_changes(self) -> None:
        """Record each job whose status may have changed since it was last recorded: queued, running, or ended."""
        with self._lock:
            entries = [entry for entry in self._entries.values() if entry.recorded.status not in FINAL]
        for entry in entries:
            self._record(entry)

    def _trim(self) -> None:
        """The folder's jobs past the newest ``keep`` forgotten with their files, whichever process made them."""
        try:
            for old in self.records.trim(self.keep):
                self.files.remove(old.content)
        except OSError as exc:
            logger.warning("the video jobs' folder was not trimmed: %s", exc)

    def _forget(self, video_id: str) -> None:
        with self._lock:
            self._entries.pop(video_id, None)

    def close(self) -> None:
        """Stop, the MP4s being encoded written and, with a folder, every job's last status recorded there."""
        self._closed.set()
        if self._recorder is not None:
            self._recorder.join()
        self._encoder.shutdown(wait=True)
        if self.records is not None:
            self._record_changes()
