"""Regional compilation: ``torch.compile`` each repeated block rather than the whole model.

All blocks of one kind share a single compiled graph (their weights are graph inputs), so compile time is that of
one or two blocks instead of the whole stack, and the stages between blocks (where the parallel runtime splits,
gathers and communicates) stay eager."""

from __future__ import annotations

import torch._dynamo
from torch import nn

# Every shape a process serves (resolutions, batch sizes, the local lengths of each parallel plan) and every
# attention implementation swapped in is one more compiled graph of the same block code. Dynamo's default of 8 per
# code object is soon spent by a server and then silently falls back to eager blocks, so allow many more.
RECOMPILE_LIMIT = 64


def model_blocks(model: nn.Module) -> list[nn.Module]:
    """The repeated blocks of a plain model, from the block stacks it lists in run order (``BLOCK_LISTS``): what
    compilation, the memory estimate and PipeFusion's stages all act on."""
    return [block for name in type(model).BLOCK_LISTS for block in getattr(model, name)]


def compile_blocks(model: nn.Module, mode: str | None = None) -> int:
    """Compile every repeated block in place; returns how many were wrapped."""
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, RECOMPILE_LIMIT)
    blocks = model_blocks(model)
    for block in blocks:
        block.compile(mode=mode, dynamic=False)
    return len(blocks)
