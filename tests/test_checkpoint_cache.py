"""The shared checkpoint folders: built once for the same builder and arguments, built again when a test has written
into one (which a copy is for)."""

from __future__ import annotations

from pathlib import Path

from tests import checkpoint_cache
from tests.checkpoint_cache import cached, copy_of

BUILDS: list[tuple] = []


def write_folder(folder: Path, text: str) -> None:
    BUILDS.append((text,))
    (folder / "sub").mkdir()
    (folder / "sub" / "weights.txt").write_text(text)


def test_a_folder_is_built_once_per_arguments_and_again_once_written_into(tmp_path, monkeypatch):
    monkeypatch.setattr(checkpoint_cache, "ROOT", tmp_path / "cache")
    BUILDS.clear()
    first = cached(write_folder, "a")
    assert cached(write_folder, "a") == first and BUILDS == [("a",)]
    other = cached(write_folder, "b")
    assert other != first and BUILDS == [("a",), ("b",)]
    copy = copy_of(first, tmp_path / "copy")
    (copy / "sub" / "weights.txt").write_text("damaged")  # a copy's damage leaves the cache alone
    assert cached(write_folder, "a") == first and len(BUILDS) == 2
    (first / "sub" / "weights.txt").write_text("written into")
    assert cached(write_folder, "a") == first and len(BUILDS) == 3
    assert (first / "sub" / "weights.txt").read_text() == "a"
    (first / "sub" / "extra.bin").write_bytes(b"x")  # a file added is a change too
    cached(write_folder, "a")
    assert len(BUILDS) == 4 and not (first / "sub" / "extra.bin").exists()
