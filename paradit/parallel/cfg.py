"""Classifier-free guidance's [conditional; unconditional] rows of the batch, on one rank or split (one all-gather)."""

from __future__ import annotations

import torch

from paradit.parallel.comm import all_gather_uneven


class BatchedBranches:
    """Both branches in one batch on this rank (one GPU, or a group without CFG parallelism)."""

    def local(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def combine(self, prediction: torch.Tensor) -> torch.Tensor:
        return prediction


class SplitBranches:
    """cfg rank 0 computes the conditional half, cfg rank 1 the unconditional half."""

    def __init__(self, context) -> None:
        self.context = context
        self.branch = context.local_rank("cfg")

    def local(self, x: torch.Tensor) -> torch.Tensor:
        return x.chunk(2)[self.branch]

    def combine(self, prediction: torch.Tensor) -> torch.Tensor:
        rows = prediction.shape[0]
        return all_gather_uneven(prediction, 0, [rows, rows], self.context.group("cfg"), self.context.stats)
