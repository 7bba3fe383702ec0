"""Execution options (``options.ExecutionOptions``) applied to a transformer from outside: FP8 linears (converted as
read by ``load_transformer``: the high-precision model never exists whole), regional compilation, CUDA graphs."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from paradit.compile import compile_blocks
from paradit.cuda_graphs import GraphedModule
from paradit.parallel.parallelize import Parallelized

if TYPE_CHECKING:
    from paradit.options import ExecutionOptions


def apply_execution_options(transformer: Parallelized, options: ExecutionOptions, device: torch.device) -> nn.Module:
    """Compiles the plain model's blocks in place; returns the module to call in place of ``transformer.forward``
    (itself, or its CUDA-graphed wrapper). FP8 is not applied here: ``options.quantize`` goes to the loader."""
    if options.compiles(device):
        compile_blocks(transformer.model)
    return GraphedModule(transformer.forward) if options.cuda_graphs else transformer.forward
