"""Weights sharded over neighbouring ranks (``ParallelConfig.shard_weights``) by FSDP2, each block as soon as it has
loaded, so a rank never holds more than its shares and one whole block; each block's gather prefetches the next's.
A prefix-caching model's ``encode_prefix`` (``layers/prefix_attention.py``) gathers the same way: the root's weights
around it, each block's around its ``run_prefix``."""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.fsdp import fully_shard, register_fsdp_forward_method
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

    def encode_prefix(self, *args, **kwargs):
        """Out of inference mode, as ``__call__``, around FSDP's gathers (``sharded_encode_prefix``)."""
        with torch.inference_mode(False), torch.no_grad():
            return self.sharded_encode_prefix(*args, **kwargs)

    def sharded_encode_prefix(self, *args, **kwargs):
        """A forward method of FSDP's (``shard_root``): the root's weights gathered around it."""
        return self.inner.encode_prefix(*args, **kwargs)


def shard_module(module: nn.Module, context: ParallelContext) -> None:
    """``fully_shard`` the parameters no inner module has sharded, counting what each gather sends (FSDP2 does not)."""
    degree = context.config.shard_weights
    own = [p for p in module.parameters() if not isinstance(p, DTensor)]
    share = sum(-(-p.shape[0] // degree) * (p[0].numel() if p.dim() else 1) * p.element_size() for p in own)
    fully_shard(module, mesh=context.shard_mesh, reshard_after_forward=True)
    if hasattr(module, "run_prefix"):  # a prefix-caching block: its weights gathered for the prefix too
        register_fsdp_forward_method(module, "run_prefix")

    @torch.compiler.disable  # a side effect on the host's counters, outside any compiled graph
    def count(*_) -> None:
        context.stats.add(share * (degree - 1))

    module.register_forward_pre_hook(count)


def shard_root(forward: nn.Module, model: nn.Module, context: ParallelContext) -> ShardRoot:
    """Once every block is sharded; each prefetches the next one's weights."""
    root = ShardRoot(forward)
    shard_module(root, context)
    if hasattr(forward, "encode_prefix"):
        register_fsdp_forward_method(root, "sharded_encode_prefix")
    chain = [root, *model_blocks(model)]
    for current, following in zip(chain, chain[1:]):
        current.set_modules_to_forward_prefetch([following])
    return root
