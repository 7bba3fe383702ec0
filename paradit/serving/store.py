"""Encoded files the server hands out by address (url images, videos), in memory up to a byte budget."""

from __future__ import annotations

import secrets
import threading
from collections import OrderedDict


class FileStore:
    def __init__(self, max_bytes: int) -> None:
        self.max_bytes, self._bytes = max_bytes, 0  # the budget, and the bytes kept
        self._files: OrderedDict[str, tuple[bytes, str]] = OrderedDict()
        self._lock = threading.Lock()

    def put(self, data: bytes, media_type: str, suffix: str) -> str:
        """``data``'s name, unguessable; older files leave to make room."""
        name = f"{secrets.token_urlsafe(16)}.{suffix}"
        with self._lock:
            self._files[name] = (data, media_type)
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
