"""Collectives the runtime uses, each counting the bytes this process sends. Sequence lengths and head counts need not
divide the degree: all-to-alls carry per-rank sizes instead of padding, and gathers pad only in transit."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

import torch
import torch.distributed as dist


@dataclass
class CommStats:
    """Bytes this process sent, by phase ("denoise", "setup", ...)."""

    bytes_sent: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    phase: str = "setup"

    def add(self, nbytes: int) -> None:
        self.bytes_sent[self.phase] += nbytes

    def reset(self) -> None:
        self.bytes_sent = defaultdict(int)
        self.phase = "setup"


def split_sizes(total: int, parts: int) -> list[int]:
    """torch.tensor_split's sizes: the first ``total % parts`` parts one longer."""
    base, extra = divmod(total, parts)
    return [base + (1 if i < extra else 0) for i in range(parts)]


def start_all_to_all_uneven(
    send: torch.Tensor, send_numels: list[int], recv_numels: list[int], group: dist.ProcessGroup, stats: CommStats
) -> tuple[torch.Tensor, dist.Work]:
    """``*_numels[j]``: elements for group rank j of flat ``send`` and the returned buffer (read after the work)."""
    recv = send.new_empty(sum(recv_numels))
    work = dist.all_to_all_single(recv, send, recv_numels, send_numels, group=group, async_op=True)
    me = dist.get_rank(group)
    stats.add((send.numel() - send_numels[me]) * send.element_size())
    return recv, work


def all_gather_uneven(
    x: torch.Tensor, dim: int, sizes: list[int], group: dist.ProcessGroup | None, stats: CommStats | None = None
) -> torch.Tensor:
    """Rank j holds ``sizes[j]`` rows along ``dim``; uncounted without ``stats``."""
    longest = max(sizes)
    if x.shape[dim] < longest:
        pad_shape = list(x.shape)
        pad_shape[dim] = longest - x.shape[dim]
        x = torch.cat([x, x.new_zeros(pad_shape)], dim=dim)
    x = x.contiguous()  # collectives want dense tensors; empty_like would copy a channels-last layout
    parts = [torch.empty_like(x) for _ in sizes]
    dist.all_gather(parts, x, group=group)
    if stats is not None:
        stats.add(x.nbytes * (len(sizes) - 1))
    return torch.cat([part.narrow(dim, 0, size) for part, size in zip(parts, sizes)], dim=dim)


@torch.compiler.disable  # compiled blocks break their graph here, as around the sequence-parallel collectives
def all_reduce_sum(x: torch.Tensor, group: dist.ProcessGroup, stats: CommStats) -> torch.Tensor:
    """In place; counted as NCCL's ring all-reduce sends: 2 (T - 1) / T of ``x`` per rank."""
    dist.all_reduce(x, group=group)
    degree = dist.get_world_size(group)
    stats.add(2 * (degree - 1) * x.nbytes // degree)
    return x


def broadcast(x: torch.Tensor, src: int, group: dist.ProcessGroup | None, stats: CommStats) -> torch.Tensor:
    dist.broadcast(x, src=src, group=group)
    if dist.get_rank() == src:
        stats.add(x.nbytes * (dist.get_world_size(group) - 1))
    return x


class RingExchange:
    """Async send to the next rank and receive from the previous."""

    def __init__(self, group: dist.ProcessGroup, stats: CommStats) -> None:
        self.group = group
        self.stats = stats
        ranks = dist.get_process_group_ranks(group)
        me = ranks.index(dist.get_rank())
        self.next_rank = ranks[(me + 1) % len(ranks)]
        self.prev_rank = ranks[(me - 1) % len(ranks)]

    def start(self, send: list[torch.Tensor], recv_shapes: list[tuple[int, ...]]) -> tuple[list[torch.Tensor], list]:
        recv = [tensor.new_empty(shape) for tensor, shape in zip(send, recv_shapes)]
        ops = [dist.P2POp(dist.isend, t.contiguous(), self.next_rank, self.group) for t in send]
        ops += [dist.P2POp(dist.irecv, t, self.prev_rank, self.group) for t in recv]
        self.stats.add(sum(t.nbytes for t in send))
        return recv, dist.batch_isend_irecv(ops)
