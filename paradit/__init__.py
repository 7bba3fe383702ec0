"""paradit: multi-GPU inference for diffusion transformers.

Public API: ``Engine``, ``GenerationRequest``, ``GenerationResult``.
"""

from paradit.engine import Engine
from paradit.errors import CheckpointError, InvalidRequest, ParaditError
from paradit.request import GenerationRequest, GenerationResult, Timings

__all__ = [
    "Engine",
    "GenerationRequest",
    "GenerationResult",
    "Timings",
    "ParaditError",
    "InvalidRequest",
    "CheckpointError",
]
