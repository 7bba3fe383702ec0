"""The process group, the device mesh (cfg x pipefusion x ring x ulysses x tensor) and this rank's place in it.

The heaviest traffic sits innermost, between neighbouring ranks (the same NVLink island or PCIe switch on most
boxes): tensor parallelism's per-layer reductions, then Ulysses' all-to-alls; the ring passes K/V between Ulysses
groups; PipeFusion stages pass one patch's activations per stage boundary; CFG halves exchange one noise prediction
per step.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from paradit.parallel.comm import CommStats, broadcast
from paradit.parallel.config import ParallelConfig

MESH_DIMS = ("cfg", "pipefusion", "ring", "ulysses", "tensor")


def backend_for(device: torch.device) -> str:
    # NCCL names RCCL too on ROCm builds; gloo carries CPU tensors.
    return "nccl" if device.type == "cuda" else "gloo"


def init_process_group(device: torch.device, rank: int, world_size: int, init_method: str) -> None:
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(
        backend_for(device), rank=rank, world_size=world_size, init_method=init_method,
        device_id=device if device.type == "cuda" else None,
    )  # fmt: skip


@dataclass
class ParallelContext:
    """What a parallelised pipeline needs to know about the group it runs in."""

    config: ParallelConfig
    device: torch.device
    mesh: DeviceMesh
    sequence_group: dist.ProcessGroup
    stats: CommStats = field(default_factory=CommStats)

    @classmethod
    def build(cls, config: ParallelConfig, device: torch.device) -> ParallelContext:
        shape = tuple(degree for _, degree in config.degrees())
        mesh = init_device_mesh(device.type, shape, mesh_dim_names=MESH_DIMS)
        # A sequence group is the ring x ulysses ranks sharing every other coordinate, in chunk order (ring-major).
        ranks = torch.arange(config.world_size).reshape(shape)
        groups = ranks.permute(0, 1, 4, 2, 3).reshape(-1, config.sequence_degree).tolist()
        sequence_group, _ = dist.new_subgroups_by_enumeration(groups)
        return cls(config, device, mesh, sequence_group)

    @property
    def rank(self) -> int:
        return dist.get_rank()

    @property
    def is_leader(self) -> bool:
        return self.rank == 0

    def local_rank(self, dim: str) -> int:
        return self.mesh.get_local_rank(dim)

    def group(self, dim: str) -> dist.ProcessGroup:
        return self.mesh.get_group(dim)

    def second_group(self, dim: str) -> dist.ProcessGroup:
        """A second communicator over the ranks of this rank's ``dim`` group. Its operations queue apart from the
        first one's (their own NCCL stream), so traffic flowing the other way need not wait in line behind it.
        Every rank must call this, in the same order."""
        shape = tuple(degree for _, degree in self.config.degrees())
        axis = MESH_DIMS.index(dim)
        ranks = torch.arange(self.config.world_size).reshape(shape).movedim(axis, -1).reshape(-1, shape[axis])
        group, _ = dist.new_subgroups_by_enumeration(ranks.tolist())
        return group

    @property
    def sequence_rank(self) -> int:
        return dist.get_rank(self.sequence_group)

    def gather_int(self, value: int) -> list[int]:
        """Every rank's ``value``, in rank order, on every rank (one tiny all-gather)."""
        mine = torch.tensor([value], dtype=torch.int64, device=self.device)
        everyone = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
        dist.all_gather(everyone, mine)
        return [int(v.item()) for v in everyone]

    def share_from_leader(self, tensor: torch.Tensor | None) -> torch.Tensor:
        """Rank 0's ``tensor`` on every rank (the others pass None). Shape and dtype travel first, so prompt
        embeddings of any length can be shared; bool tensors travel as bytes (gloo carries no bool)."""
        meta = [(tuple(tensor.shape), tensor.dtype) if self.is_leader else None]
        dist.broadcast_object_list(meta, src=0, device=self.device if self.device.type == "cuda" else None)
        shape, dtype = meta[0]
        wire_dtype = torch.uint8 if dtype == torch.bool else dtype
        if self.is_leader:
            wire = tensor.to(wire_dtype).contiguous()
        else:
            wire = torch.empty(shape, dtype=wire_dtype, device=self.device)
        return broadcast(wire, src=0, group=None, stats=self.stats).to(dtype)
