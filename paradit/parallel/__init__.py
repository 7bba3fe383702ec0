"""The parallel runtime: applies parallelism to plain single-device models from outside.

One readable piece per strategy: ``sequence`` (split/gather, Ulysses, Ring, their hybrid), ``cfg`` (guidance
branches on separate ranks), ``comm`` (collectives that count their bytes), ``mesh`` (the process group and device
mesh a plan needs), ``config`` (the plan and its validation).
"""

from paradit.parallel.config import ParallelConfig

__all__ = ["ParallelConfig"]
