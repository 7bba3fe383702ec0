"""Regional compilation: each repeated block compiled (one graph per kind of block), so that compile time is one
block's and the stages between blocks, where the parallel runtime communicates, stay eager."""

from __future__ import annotations

from torch import nn

# Every shape a process serves and every attention swapped in is one more graph of the same block code: Dynamo's
# default of 8 per code object is soon spent by a server, which then silently falls back to eager blocks.
RECOMPILE_LIMIT = 64


def model_blocks(model: nn.Module) -> list[nn.Module]:
    """In run order."""
    return [block for name in type(model).BLOCK_LISTS for block in getattr(model, name)]


def compile_blocks(model: nn.Module, mode: str | None = None) -> int:
    import torch._dynamo  # here, where blocks are compiled: settling a run stays light

    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, RECOMPILE_LIMIT)
    blocks = model_blocks(model)
    for block in blocks:
        block.compile(mode=mode, dynamic=False)
    return len(blocks)
