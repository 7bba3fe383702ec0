"""Video jobs' records in a folder (``--files-dir``): each job's last recorded status and its MP4's name, so that any
server process over that folder answers for the job, also once the process that ran it is gone."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

from paradit.outputs import replaced
from paradit.serving.schemas import VideoJob

JOB_ID = re.compile(r"[0-9a-f]{32}")  # Job.id, a uuid4's hex: a name from a URL never leaves the folder


@dataclass(frozen=True)
class Record:
    view: VideoJob
    content: str | None  # the MP4's name in the file store, once encoded
    created: float  # the job's time.time() at creation, which orders the records across processes


class JobRecords:
    """One JSON file a job, ``ID.json``, written under a temporary name and renamed, so that no reader sees half of
    one; removing it (DELETE, trimming) is what forgets the job, for every process over the folder."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        folder.mkdir(parents=True, exist_ok=True)

    def create(self, record: Record) -> None:
        fields = {"view": record.view.model_dump(mode="json"), "content": record.content, "created": record.created}
        with replaced(self._path(record.view.id)) as temporary:
            temporary.write_text(json.dumps(fields))

    def update(self, record: Record) -> bool:
        """``record`` over its job's last one, unless any process removed that meanwhile (a forgotten job stays
        forgotten); whether it was written. No lock spans the processes: a removal between the check and the write
        is undone by the write, and the next DELETE settles it."""
        if not self._path(record.view.id).exists():
            return False
        self.create(record)
        return True

    def load(self, video_id: str) -> Record | None:
        if not JOB_ID.fullmatch(video_id):
            return None
        try:
            fields = json.loads(self._path(video_id).read_text())
        except FileNotFoundError:  # never recorded, or removed by this process or another
            return None
        return Record(VideoJob.model_validate(fields["view"]), fields["content"], fields["created"])

    def remove(self, video_id: str) -> None:
        if JOB_ID.fullmatch(video_id):
            self._path(video_id).unlink(missing_ok=True)

    def trim(self, keep: int) -> list[Record]:
        """Every record past the newest ``keep`` removed, whichever process made it; the removed, for their files."""
        records = []
        for path in self.folder.iterdir():
            if path.suffix == ".json" and JOB_ID.fullmatch(path.stem):  # not a temporary name (a dot folder)
                records.append(self.load(path.stem))  # None: removed meanwhile by another process
        records = sorted((record for record in records if record is not None), key=lambda record: record.created)
        old = records[: max(0, len(records) - keep)]
        for record in old:
            self.remove(record.view.id)
        return old

    def _path(self, video_id: str) -> Path:
        return self.folder / f"{video_id}.json"
