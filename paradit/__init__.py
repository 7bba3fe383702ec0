"""paradit: multi-GPU inference for diffusion transformers.

Public API: ``Engine``, ``GenerationRequest``, ``GenerationResult``, ``ParallelConfig``.
"""

from paradit.engine import Engine
from paradit.errors import CheckpointError, InvalidRequest, ParaditError
from paradit.parallel import ParallelConfig
from paradit.request import GenerationRequest, GenerationResult, Timings

__all__ = [
    "Engine",
    "GenerationRequest",
    "GenerationResult",
    "ParallelConfig",
    "Timings",
    "ParaditError",
    "InvalidRequest",
    "CheckpointError",
]
