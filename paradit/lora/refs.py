"""What a run or a server is asked to apply; imports nothing heavy (``generate --server`` parses it too)."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from pathlib import Path

from paradit.errors import InvalidRequest

MODES = ("fused", "unfused")


@dataclass(frozen=True)
class LoraRef:
    """``source``: a ``.safetensors`` file, a folder holding one, or a hub repository id (``weight_name`` picks its
    file); ``scale``: diffusers' ``set_adapters`` weight; ``name``: what a server's requests call it."""

    source: str
    scale: float = 1.0
    weight_name: str | None = None
    name: str | None = None


@dataclass(frozen=True)
class LoraSet:
    """``transformer_2``: the low-noise expert's (Wan 2.2); ``switchable``: a server's named adapters, side paths each
    batch chooses among; ``cache``: how many choices are kept fused into weights of their own (0: side paths only)."""

    transformer: tuple[LoraRef, ...] = ()
    transformer_2: tuple[LoraRef, ...] = ()
    mode: str = "fused"
    switchable: bool = False
    cache: int = 0

    def __bool__(self) -> bool:
        return bool(self.transformer or self.transformer_2)

    @property
    def fused(self) -> bool:
        return self.mode == "fused" and not self.switchable

    def of(self, component: str) -> tuple[LoraRef, ...]:
        return self.transformer_2 if component == "transformer_2" else self.transformer

    def names(self) -> list[str]:
        return sorted({ref.name for ref in (*self.transformer, *self.transformer_2) if ref.name})


def adapter_key(ref: LoraRef, index: int) -> str:
    return ref.name or f"#{index}"


# A hub repository id, and a file in one (huggingface_hub checks the finer rules).
HUB_ID = re.compile(r"[\w.-]+/[\w.-]+")
HUB_FILE = re.compile(r"(?P<repo>[\w.-]+/[\w.-]+)/(?P<file>(?:[\w.-]+/)*[\w.-]+\.safetensors)")
NAME = re.compile(r"[\w.-]+")


def parse_adapter(text: str, flag: str = "--lora", weight_name: str | None = None, named: bool = False) -> LoraRef:
    """A command line's adapter: a run's ``SOURCE[:SCALE]`` (a client's ``NAME[:SCALE]`` too), or with ``named`` a
    server's ``NAME=SOURCE``, whose requests give the scales; what ``SOURCE`` is, is ``locate``'s."""
    if named:
        name, _, source = text.partition("=")
        if not name or not source or not NAME.fullmatch(name):
            raise InvalidRequest(f"{flag} {text}: give NAME=PATH, NAME of letters, digits, '.', '-' or '_'")
        if _scale_part(source) is not None:
            raise InvalidRequest(f"{flag} {text}: a server's adapters take no scale here; each request gives its own")
        return LoraRef(source, name=name)
    scale = _scale_part(text)
    source = text if scale is None else text[: -len(scale) - 1]
    if not source:
        raise InvalidRequest(f"{flag} {text!r}: give an adapter's file, folder or hub id (OWNER/NAME), then :SCALE")
    if scale is None:
        return LoraRef(source, 1.0, weight_name)
    if _scale_part(source) is not None:
        raise InvalidRequest(f"{flag} {text}: more than one ':SCALE'; give PATH[:SCALE] with one scale")
    try:
        value = float(scale)
    except ValueError:
        value = math.nan
    if not math.isfinite(value):
        raise InvalidRequest(
            f"{flag} {text}: the scale {scale!r} is not a finite number; give PATH[:SCALE], SCALE a number such as "
            "0.8 (1 without it)"
        )
    return LoraRef(source, value, weight_name)


def _scale_part(text: str) -> str | None:
    """What follows the last ':' of ``text``, unless that is a path's (an existing one, or holding a '/')."""
    _, colon, tail = text.rpartition(":")
    if not colon or "/" in tail or Path(text).expanduser().exists():
        return None
    return tail


@dataclass(frozen=True)
class Location:
    """``path`` on disk, or ``repo`` on the hub with ``filename`` in it (None: ``weight_name``'s, else diffusers')."""

    path: Path | None = None
    repo: str | None = None
    filename: str | None = None


def locate(source: str) -> Location:
    """A path starting with '.', '/' or '~', or not of a hub shape, is local (missing: refused, the hub not asked); the
    hub's are ``owner/name`` and ``owner/name/path/in/it.safetensors`` (Wan 2.2's experts' adapters share a repo)."""
    path = Path(source).expanduser()
    if path.exists():
        return Location(path=path)
    if not source.startswith((".", "/", "~")):
        if HUB_ID.fullmatch(source) and not source.endswith(".safetensors"):
            return Location(repo=source)
        if match := HUB_FILE.fullmatch(source):
            return Location(repo=match["repo"], filename=match["file"])
    raise InvalidRequest(
        f"--lora {source}: no such file or folder (a local path, not looked up on the hub, whose adapters are "
        "OWNER/NAME or OWNER/NAME/FILE.safetensors)"
    )


def adapters_in(folder: str) -> tuple[LoraRef, ...]:
    files = sorted(Path(folder).expanduser().glob("*.safetensors"))
    if not files:
        raise InvalidRequest(f"--lora-dir {folder}: no .safetensors adapters there")
    return tuple(LoraRef(str(path), name=path.stem) for path in files)
