"""The parallel runtime: applies parallelism to plain single-device models from outside, through ``parallelize``."""

from paradit.parallel.config import ParallelConfig

__all__ = ["ParallelConfig"]
