"""Run a function on N CPU processes joined by gloo, as the parallel tests need, and collect rank 0's answer."""

from __future__ import annotations

import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from paradit.parallel.mesh import init_process_group


def _entry(rank: int, world: int, folder: str, fn, args) -> None:
    torch.set_num_threads(1)
    init_process_group(torch.device("cpu"), rank, world, f"file://{folder}/rendezvous")
    try:
        result = fn(*args)
        if rank == 0:
            torch.save(result, Path(folder) / "result.pt")
    finally:
        dist.destroy_process_group()


def run_on_processes(world: int, fn, *args):
    """``fn(*args)`` on ``world`` gloo processes; returns what rank 0's call returned."""
    with tempfile.TemporaryDirectory() as folder:
        mp.start_processes(_entry, args=(world, folder, fn, args), nprocs=world, start_method="spawn")
        return torch.load(Path(folder) / "result.pt", weights_only=False)
