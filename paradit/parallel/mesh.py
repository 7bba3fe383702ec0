"""The process group, the device mesh and this rank's place in it. The heaviest traffic sits innermost, between
neighbouring ranks (one NVLink island or PCIe switch on most boxes): tensor parallelism's, then Ulysses'."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import cached_property

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from paradit.parallel.comm import CommStats, all_gather_uneven, broadcast
from paradit.parallel.config import MESH_DIMS, ParallelConfig


def init_process_group(device: torch.device, rank: int, world_size: int, init_method: str) -> None:
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.set_device(device)
    backend = "nccl" if cuda else "gloo"  # "nccl" names RCCL too on ROCm builds; gloo carries CPU tensors
    dist.init_process_group(
        backend, rank=rank, world_size=world_size, init_method=init_method, device_id=device if cuda else None
    )


def new_subgroup(config: ParallelConfig, dims: tuple[str, ...]) -> dist.ProcessGroup:
    """The ranks sharing this one's mesh coordinates but ``dims`` (last fastest); every rank must call it."""
    shape = tuple(degree for _, degree in config.degrees())
    axes = [MESH_DIMS.index(dim) for dim in dims]
    ranks = torch.arange(config.world_size).reshape(shape).movedim(axes, list(range(-len(axes), 0)))
    group, _ = dist.new_subgroups_by_enumeration(ranks.reshape(-1, math.prod(shape[a] for a in axes)).tolist())
    return group


@dataclass
class ParallelContext:
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
        return cls(config, device, mesh, new_subgroup(config, ("ring", "ulysses")))

    @cached_property
    def shard_mesh(self) -> DeviceMesh:
        """Groups of ``shard_weights`` consecutive ranks, each holding the whole model between them."""
        n, world = self.config.shard_weights, self.config.world_size
        if n == world:
            return init_device_mesh(self.device.type, (n,), mesh_dim_names=("shard",))
        return init_device_mesh(self.device.type, (world // n, n), mesh_dim_names=("replicate", "shard"))

    @property
    def is_leader(self) -> bool:
        return dist.get_rank() == 0

    def local_rank(self, dim: str) -> int:
        return self.mesh.get_local_rank(dim)

    def group(self, dim: str) -> dist.ProcessGroup:
        return self.mesh.get_group(dim)

    @property
    def sequence_rank(self) -> int:
        return dist.get_rank(self.sequence_group)

    def gather_int(self, value: int) -> list[int]:
        mine = torch.tensor([value], dtype=torch.int64, device=self.device)
        return all_gather_uneven(mine, 0, [1] * dist.get_world_size(), None).tolist()

    def sum_across(self, tensor: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(tensor)
        return tensor

    def share_from_leader(self, tensor: torch.Tensor | None) -> torch.Tensor:
        """The others pass None; bools travel as bytes for gloo."""
        meta = [(tuple(tensor.shape), tensor.dtype) if self.is_leader else None]
        dist.broadcast_object_list(meta, src=0, device=self.device if self.device.type == "cuda" else None)
        shape, dtype = meta[0]
        wire_dtype = torch.uint8 if dtype == torch.bool else dtype
        if self.is_leader:
            wire = tensor.to(wire_dtype).contiguous()
        else:
            wire = torch.empty(shape, dtype=wire_dtype, device=self.device)
        return broadcast(wire, src=0, group=None, stats=self.stats).to(dtype)
