"""Weights sharded over neighbouring ranks (``ParallelConfig.shard_weights``) by FSDP2, each block as soon as it has
loaded, so a rank never holds more than its shares and one whole block; each block's gather prefetches the next's."""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from paradit.compile import model_blocks
from paradit.parallel.mesh import ParallelContext


class ShardRoot(nn.Module):
    """The FSDP root, over the model (or its sequence-parallel wrapper): what is outside the blocks."""

    def __init__(self, forward: nn.Module) -> None:
        super().__init__()
        self.inner = forward

    @property
    def config(self):
        return self.inner.config

    def __call__(self, *args, **kwargs) -> torch.Tensor:
        # Outside inference mode, FSDP's hooks included: FSDP2 before torch 2.13 reads the version counter of each
        # weight it gathers, which inference tensors lack. The inputs may be inference tensors: they are only read.
        with torch.inference_mode(False), torch.no_grad():
            return super().__call__(*args, **kwargs)

    def forward(self, *args, **kwargs) -> torch.Tensor:
        return self.inner(*args, **kwargs)


def shard_module(module: nn.Module, context: ParallelContext) -> None:
    """``fully_shard`` the parameters no inner module has sharded, counting what each gather sends (FSDP2 does not)."""
    degree = context.config.shard_weights
    own = [p for p in module.parameters() if not isinstance(p, DTensor)]
    share = sum(-(-p.shape[0] // degree) * (p[0].numel() if p.dim() else 1) * p.element_size() for p in own)
    fully_shard(module, mesh=context.shard_mesh, reshard_after_forward=True)

    @torch.compiler.disable  # a side effect on the host's counters, outside any compiled graph
    def count(*_) -> None:
        context.stats.add(share * (degree - 1))

    module.register_forward_pre_hook(count)


def shard_root(forward: nn.Module, model: nn.Module, context: ParallelContext) -> ShardRoot:
    """Once every block is sharded; each prefetches the next one's weights."""
    root = ShardRoot(forward)
    shard_module(root, context)
    chain = [root, *model_blocks(model)]
    for current, following in zip(chain, chain[1:]):
        current.set_modules_to_forward_prefetch([following])
    return root
