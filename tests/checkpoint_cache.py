"""Tiny checkpoint folders built once: ``cached(builder, *args)`` is the folder ``builder(folder, *args)`` writes,
built only when no folder exists for the same builder code, arguments and library versions. Every test that needs
a checkpoint gets the same folder, in this run and the next ones (under .pytest_cache/checkpoints, or
``PARADIT_TEST_CHECKPOINTS``); both test processes of ``make test`` share it.

A cached folder is read, never written: a test that damages or edits a checkpoint does so on ``copy_of`` it. Each
use checks the folder still holds exactly the files its build wrote (names, sizes and modification times), and
builds it again if not."""

from __future__ import annotations

import ast
import fcntl
import hashlib
import importlib.metadata
import inspect
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

TESTS = Path(__file__).resolve().parent
ROOT = Path(os.environ.get("PARADIT_TEST_CHECKPOINTS", TESTS.parent / ".pytest_cache" / "checkpoints"))
LIBRARIES = ("torch", "diffusers", "transformers", "tokenizers", "safetensors")
MANIFEST = "paradit-test-manifest.json"


def _sources(path: Path) -> list[Path]:
    """``path`` and the project modules it imports by name (``tests.*`` and ``paradit.*``, one level deep): the code
    a builder in it runs."""
    found = [path]
    for node in ast.walk(ast.parse(path.read_text())):
        names = [node.module or ""] if isinstance(node, ast.ImportFrom) else []
        names += [alias.name for alias in node.names] if isinstance(node, ast.Import) else []
        for name in names:
            if name.split(".")[0] in ("tests", "paradit") and (spec := _module_file(name)) is not None:
                found.append(spec)
    return found


def _module_file(name: str) -> Path | None:
    relative = Path(*name.split("."))
    for candidate in (TESTS.parent / relative.with_suffix(".py"), TESTS.parent / relative / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def _key(builder, args: tuple) -> str:
    digest = hashlib.sha256()
    digest.update(repr((builder.__module__, builder.__qualname__, args)).encode())
    digest.update(repr([importlib.metadata.version(name) for name in LIBRARIES] + [sys.version]).encode())
    for source in sorted(set(_sources(Path(inspect.getfile(builder))))):
        digest.update(source.read_bytes())
    return digest.hexdigest()[:20]


def _listing(folder: Path) -> dict[str, list[int]]:
    return {
        str(path.relative_to(folder)): [path.stat().st_size, path.stat().st_mtime_ns]
        for path in sorted(folder.rglob("*"))
        if path.is_file() and path.name != MANIFEST
    }


def _intact(folder: Path) -> bool:
    try:
        return json.loads((folder / MANIFEST).read_text()) == _listing(folder)
    except (OSError, ValueError):
        return False


def cached(builder, *args) -> Path:
    """The folder ``builder(folder, *args)`` writes (``builder`` returns anything); hashable, repr-stable args."""
    folder = ROOT / f"{builder.__name__}-{_key(builder, args)}"
    ROOT.mkdir(parents=True, exist_ok=True)
    with open(ROOT / f"{folder.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # a twin process building the same folder waits, then finds it built
        if not _intact(folder):
            shutil.rmtree(folder, ignore_errors=True)
            building = Path(tempfile.mkdtemp(prefix=f"{folder.name}.", dir=ROOT))
            builder(building, *args)
            (building / MANIFEST).write_text(json.dumps(_listing(building)))
            building.rename(folder)
    return folder


def copy_of(folder: Path, destination: Path) -> Path:
    """A writable copy of a cached folder at ``destination``."""
    shutil.copytree(folder, destination, ignore=shutil.ignore_patterns(MANIFEST))
    return destination
