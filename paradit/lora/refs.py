"""What a run or a server is asked to apply: adapters by file and scale (``LoraRef``), the run's set of them
(``LoraSet``), and their command-line forms. Imports nothing heavy: ``generate --server`` parses them too."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from pathlib import Path

from paradit.errors import InvalidRequest

MODES = ("fused", "unfused")


@dataclass(frozen=True)
class LoraRef:
    """One adapter as asked for: ``source`` a ``.safetensors`` file, a folder holding one, or a hub repository id
    (``weight_name`` picks its file); ``scale`` multiplies its update (diffusers' ``set_adapters`` weight); ``name``
    what a server's requests call it."""

    source: str
    scale: float = 1.0
    weight_name: str | None = None
    name: str | None = None


@dataclass(frozen=True)
class LoraSet:
    """The adapters of a run: ``transformer``'s (Wan 2.2: the high-noise expert) and ``transformer_2``'s (the
    low-noise expert), fused into the weights at load or kept as side paths beside each linear (``unfused``).
    ``switchable``: named adapters loaded as side paths that each batch chooses among, with its own scales (a
    server's); otherwise every adapter applies to every request at its scale. ``cache``: how many of a server's
    choices (adapters and scales) are kept fused into weights of their own, the most recently used (0: none, every
    choice runs as side paths)."""

    transformer: tuple[LoraRef, ...] = ()
    transformer_2: tuple[LoraRef, ...] = ()
    mode: str = "fused"
    switchable: bool = False
    cache: int = 0

    def __bool__(self) -> bool:
        return bool(self.transformer or self.transformer_2)

    @property
    def fused(self) -> bool:
        """Whether the adapters become the weights (else they run as side paths)."""
        return self.mode == "fused" and not self.switchable

    def of(self, component: str) -> tuple[LoraRef, ...]:
        return self.transformer_2 if component == "transformer_2" else self.transformer

    def names(self) -> list[str]:
        return sorted({ref.name for ref in (*self.transformer, *self.transformer_2) if ref.name})


def adapter_key(ref: LoraRef, index: int) -> str:
    """What a side path calls an adapter: its name, or its place on the command line."""
    return ref.name or f"#{index}"


def parse_named(text: str) -> LoraRef:
    """A server's ``NAME=PATH``."""
    name, _, source = text.partition("=")
    if not name or not source or not re.fullmatch(r"[\w.-]+", name):
        raise InvalidRequest(f"--lora {text}: give NAME=PATH, NAME of letters, digits, '.', '-' or '_'")
    return LoraRef(source, name=name)


def adapters_in(folder: str) -> tuple[LoraRef, ...]:
    """Every ``.safetensors`` file of ``folder``, named by its stem."""
    files = sorted(Path(folder).expanduser().glob("*.safetensors"))
    if not files:
        raise InvalidRequest(f"--lora-dir {folder}: no .safetensors adapters there")
    return tuple(LoraRef(str(path), name=path.stem) for path in files)


def parse_lora(text: str, weight_name: str | None = None) -> LoraRef:
    """``PATH[:SCALE]``; a last part that is not a number belongs to the path."""
    source, _, last = text.rpartition(":")
    try:
        scale = float(last) if source else None
    except ValueError:
        scale = None
    if scale is None:
        return LoraRef(text, 1.0, weight_name)
    if not math.isfinite(scale):
        raise InvalidRequest(f"--lora {text}: the scale must be a finite number")
    return LoraRef(source, scale, weight_name)
