"""The parallel runtime: applies parallelism to plain single-device models from outside.

``parallelize`` is the one entry; one readable module per strategy: ``tensor`` (weights and heads sharded, Megatron
style), ``sequence`` (split/gather of the token streams; Ulysses, Ring and their hybrid USP), ``pipefusion``
(pipeline stages over the blocks, image patches against stale K/V; it composes with sequence and tensor parallelism
inside each stage) with its denoise loop ``patch_loop``, ``cfg`` (guidance branches on separate ranks), ``vae``
(patch-parallel VAE decode and encode). Beside them: ``comm`` (collectives that count their bytes), ``transport``
(FP8 on the wire), ``mesh`` (the process group and device mesh a plan needs), ``config`` (the plan and its
validation).
"""

from paradit.parallel.config import ParallelConfig

__all__ = ["ParallelConfig"]
