"""Pipelines, one per model family: prompt encoding, latents, the denoise loop, decoding.

Pipelines reach other ranks only through the parallel runtime's ``ParallelContext`` and guidance branches.
"""

from paradit.pipelines.flux2 import Flux2Pipeline, resolve_request

# family -> (pipeline class, request validator)
PIPELINES = {"flux2": (Flux2Pipeline, resolve_request)}
