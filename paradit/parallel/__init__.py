"""The parallel runtime: applies parallelism to plain single-device models from outside. ``parallelize`` is the one
entry, with one module per strategy beside it (``docs/architecture.md`` lists them)."""

from paradit.parallel.config import ParallelConfig

__all__ = ["ParallelConfig"]
