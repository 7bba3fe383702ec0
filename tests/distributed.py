"""Run a function on N CPU processes joined by gloo, as the parallel tests need, and collect rank 0's answer."""

from __future__ import annotations

import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from paradit.parallel import ParallelConfig
from paradit.parallel.mesh import ParallelContext, init_process_group
from paradit.parallel.parallelize import parallelize
from tests.checkpoints import relative_l2

# (processes, plans): the sequence plans every family is checked with — Ulysses and Ring at 2, 3 and 4, USP at 4.
SEQUENCE_PLANS = [
    (2, [ParallelConfig(ulysses=2), ParallelConfig(ring=2)]),
    (3, [ParallelConfig(ulysses=3), ParallelConfig(ring=3)]),
    (4, [ParallelConfig(ulysses=4), ParallelConfig(ring=4), ParallelConfig(ulysses=2, ring=2)]),
]
# Each family's transformer at world sizes 2 and 4; world 3's uneven splits are held by test_sequence_parallel.py (every
# attention layout) and by Wan's Ring 3 runs, which keeps the suite inside its time budget.
FAMILY_SEQUENCE_PLANS = [SEQUENCE_PLANS[0], SEQUENCE_PLANS[2]]


def _entry(rank: int, world: int, folder: str, fn, args) -> None:
    torch.set_num_threads(1)
    init_process_group(torch.device("cpu"), rank, world, f"file://{folder}/rendezvous")
    try:
        result = fn(*args)
        if rank == 0:
            torch.save(result, Path(folder) / "result.pt")
    finally:
        dist.destroy_process_group()


def sequence_parallel_error(model, plan: ParallelConfig, run, serial: torch.Tensor) -> tuple[float, int]:
    """``run(m)`` (one call of ``m``) with ``model`` split by ``plan`` over this process group: the relative L2 of
    its output against ``serial``, and the bytes this rank sent. The split swaps the model's attention in place."""
    context = ParallelContext.build(plan, torch.device("cpu"))
    out = run(parallelize(model, None, context).forward)
    return relative_l2(out, serial), sum(context.stats.bytes_sent.values())


def run_on_processes(world: int, fn, *args):
    """``fn(*args)`` on ``world`` gloo processes; returns what rank 0's call returned."""
    with tempfile.TemporaryDirectory() as folder:
        mp.start_processes(_entry, args=(world, folder, fn, args), nprocs=world, start_method="spawn")
        return torch.load(Path(folder) / "result.pt", weights_only=False)
