"""paradit: multi-GPU inference for diffusion transformers (names imported on first use: no torch for ``--help``)."""

from importlib import import_module
from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("paradit")
except PackageNotFoundError:  # a source tree that was never installed
    __version__ = "0+unknown"

_EXPORTS = {
    "Engine": "paradit.engine",
    "GenerationRequest": "paradit.request",
    "GenerationResult": "paradit.request",
    "Timings": "paradit.request",
    "ParallelConfig": "paradit.parallel.config",
    "ParaditError": "paradit.errors",
    "InvalidRequest": "paradit.errors",
    "CheckpointError": "paradit.errors",
}
__all__ = list(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'paradit' has no attribute {name!r}")
