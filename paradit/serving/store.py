"""Encoded files the server hands out by address (url images, videos), up to a byte budget: in memory, or in a folder
(``--files-dir``) that every server process over it shares."""

from __future__ import annotations

import re
import secrets
import tempfile
import threading
import time
from collections import OrderedDict
from pathlib import Path

from paradit.errors import InvalidRequest
from paradit.outputs import replaced
from paradit.serving.media import MEDIA_TYPES

FILES, VIDEOS = "files", "videos"  # --files-dir's subfolders: the encoded files, the video jobs' records
# What DirectoryStore.put names a file: the time it was written, then an unguessable name and the media's suffix.
STORED_NAME = re.compile(rf"[0-9a-f]{{16}}-[A-Za-z0-9_-]+\.(?:{'|'.join(MEDIA_TYPES)})")


def unguessable(suffix: str) -> str:
    return f"{secrets.token_urlsafe(16)}.{suffix}"


class FileStore:
    def __init__(self, max_bytes: int) -> None:
        self.max_bytes, self._bytes = max_bytes, 0  # the budget, and the bytes kept
        self._files: OrderedDict[str, tuple[bytes, str]] = OrderedDict()
        self._lock = threading.Lock()

    def put(self, data: bytes, suffix: str) -> str:
        """``data``'s name, unguessable; older files leave to make room."""
        name = unguessable(suffix)
        with self._lock:
            self._files[name] = (data, MEDIA_TYPES[suffix])
            self._bytes += len(data)
            while self._bytes > self.max_bytes and len(self._files) > 1:
                _, (old, _) = self._files.popitem(last=False)
                self._bytes -= len(old)
        return name

    def get(self, name: str | None) -> tuple[bytes, str] | None:
        with self._lock:
            return self._files.get(name)

    def remove(self, name: str | None) -> None:
        with self._lock:
            data, _ = self._files.pop(name, (b"", ""))
            self._bytes -= len(data)


class DirectoryStore:
    """``FileStore``'s files in a folder: any process over it serves any file; each is written under a temporary name
    and renamed, so that no reader sees half of one; past the budget the oldest leave first, whoever wrote them."""

    def __init__(self, folder: Path, max_bytes: int) -> None:
        self.folder, self.max_bytes = folder, max_bytes
        folder.mkdir(parents=True, exist_ok=True)

    def put(self, data: bytes, suffix: str) -> str:
        # Listed by name, the folder is then oldest first, whichever process wrote each (mtimes tie within a tick).
        name = f"{time.time_ns():016x}-{unguessable(suffix)}"
        with replaced(self.folder / name) as temporary:
            temporary.write_bytes(data)
        self._trim(name)
        return name

    def get(self, name: str | None) -> tuple[bytes, str] | None:
        if name is None or not STORED_NAME.fullmatch(name):  # a name from a URL never leaves the folder
            return None
        try:
            return (self.folder / name).read_bytes(), MEDIA_TYPES[name.rpartition(".")[2]]
        except FileNotFoundError:  # never written, or removed by this process or another
            return None

    def remove(self, name: str | None) -> None:
        if name is not None and STORED_NAME.fullmatch(name):
            (self.folder / name).unlink(missing_ok=True)

    def _trim(self, newest: str) -> None:
        """The files older than ``newest`` out, oldest first, until the folder is within the budget; newer ones are
        their writers' to trim."""
        sizes = {}
        for path in sorted(self.folder.iterdir()):
            if STORED_NAME.fullmatch(path.name):  # not a temporary name (a dot folder) of a file being written
                try:
                    sizes[path.name] = path.stat().st_size
                except FileNotFoundError:  # another process removed it
                    pass
        total = sum(sizes.values())
        for name, size in sizes.items():
            if total <= self.max_bytes or name >= newest:
                break
            self.remove(name)
            total -= size


def files_folder(folder: Path) -> Path:
    """``--files-dir``, made if missing, checked before any model loads: refused in one line unless it is a folder
    this process can write to."""
    try:
        for each in (folder / FILES, folder / VIDEOS):
            each.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryFile(dir=each):  # permissions and read-only mounts answer here, not mkdir
                pass
    except OSError as exc:
        reason = "it is a file, not a folder" if folder.is_file() else exc.strerror or str(exc)
        raise InvalidRequest(f"--files-dir {folder}: {reason}; give a folder this server can write to") from None
    return folder
