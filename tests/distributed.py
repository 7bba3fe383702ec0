"""Run a function on N CPU processes joined by gloo, as the parallel tests need, and collect rank 0's answer.

The processes are started once per test session (``ProcessPool``), forked from the forkserver that also forks the
engine's workers (it imported torch and the model code once), and each call runs in a fresh process group over the
first N of them: a new interpreter spends seconds of CPU importing torch, diffusers and transformers, which the
suite would otherwise pay again for every parallel test. Between calls a process is put back as a new one would be
(torch's seed, its default dtype and its thread count), so a test body cannot tell."""

from __future__ import annotations

import atexit
import functools
import os
import pickle
import tempfile
import time
import traceback
from multiprocessing.connection import Connection, wait

import torch
import torch.distributed as dist

from paradit.parallel import ParallelConfig
from paradit.parallel.mesh import ParallelContext, init_process_group
from paradit.parallel.parallelize import parallelize
from paradit.worker import worker_context
from tests.checkpoints import relative_l2

# (processes, plans): the sequence plans every family is checked with — Ulysses and Ring at 2, 3 and 4, USP at 4.
SEQUENCE_PLANS = [
    (2, [ParallelConfig(ulysses=2), ParallelConfig(ring=2)]),
    (3, [ParallelConfig(ulysses=3), ParallelConfig(ring=3)]),
    (4, [ParallelConfig(ulysses=4), ParallelConfig(ring=4), ParallelConfig(ulysses=2, ring=2)]),
]
POOL_SIZE = max(world for world, _ in SEQUENCE_PLANS)
CALL_S = 900  # a call still running after this is taken for hung (the slowest takes about a minute on 2 cores)
# After one rank fails, how long the others get to report: a rank waiting for the failed one in a collective never
# does, and is replaced.
FAILURE_GRACE_S = 10


def _serve(tasks: Connection) -> None:
    """A pooled process: run each ``(rank, world, folder, fn, args)`` it is sent in a process group of its own and
    send back ``("ok", rank 0's result)`` or ``("error", the trace)``; end when the pool's end of the pipe closes."""
    import diffusers  # noqa: F401 - imported once here rather than by the first test body that needs them
    import transformers  # noqa: F401

    initial_seed = torch.initial_seed()
    while True:
        try:
            rank, world, folder, fn, args = pickle.loads(tasks.recv_bytes())
        except EOFError:
            return
        torch.manual_seed(initial_seed)
        torch.set_default_dtype(torch.float32)
        torch.set_num_threads(1)
        try:
            init_process_group(torch.device("cpu"), rank, world, f"file://{folder}/rendezvous")
            try:
                result = fn(*args)
            finally:
                dist.destroy_process_group()
            reply = ("ok", result if rank == 0 else None)
        except BaseException:  # noqa: BLE001 - the test that sent it reports it
            reply = ("error", traceback.format_exc())
        tasks.send_bytes(pickle.dumps(reply))


class ProcessPool:
    """``size`` processes that have imported the heavy libraries, reused by every ``run``."""

    def __init__(self, size: int) -> None:
        self._context = worker_context("cpu")
        self._processes: list = [None] * size
        self._tasks: list[Connection | None] = [None] * size

    def _start_missing(self) -> None:
        """Every process not running, so that a call of any world size finds its ranks started."""
        for rank, process in enumerate(self._processes):
            if process is None:
                ours, theirs = self._context.Pipe()
                process = self._context.Process(target=_serve, args=(theirs,), daemon=True, name=f"gloo-pool-{rank}")
                process.start()
                theirs.close()
                self._processes[rank], self._tasks[rank] = process, ours

    def _replace(self, ranks) -> None:
        for rank in ranks:
            self._processes[rank].kill()
            self._processes[rank].join()
            self._tasks[rank].close()
            self._processes[rank] = self._tasks[rank] = None

    def run(self, world: int, fn, args: tuple):
        if world > len(self._processes):
            raise ValueError(f"world size {world} is larger than the pool's {len(self._processes)} processes")
        ranks = range(world)
        self._start_missing()
        with tempfile.TemporaryDirectory() as folder:
            for rank in ranks:
                self._tasks[rank].send_bytes(pickle.dumps((rank, world, folder, fn, args)))
            replies = self._collect(ranks)
        errors = [f"rank {rank}: {detail}" for rank, (kind, detail) in sorted(replies.items()) if kind != "ok"]
        if errors:
            raise RuntimeError(f"{fn.__qualname__} failed on {world} processes\n" + "\n".join(errors))
        return replies[0][1]

    def _collect(self, ranks: range) -> dict[int, tuple[str, object]]:
        """Each rank's reply; a rank that dies, or stays silent past its time, gets an error in its place and is
        replaced by a new process."""
        replies: dict[int, tuple[str, object]] = {}
        deadline = time.monotonic() + CALL_S
        while len(replies) < len(ranks):
            waiting = [rank for rank in ranks if rank not in replies]
            ready = wait(
                [self._tasks[r] for r in waiting] + [self._processes[r].sentinel for r in waiting],
                timeout=max(0.0, deadline - time.monotonic()),
            )
            for rank in waiting:
                if self._tasks[rank] in ready:
                    try:
                        replies[rank] = pickle.loads(self._tasks[rank].recv_bytes())
                    except EOFError:
                        pass
                if rank not in replies and self._processes[rank].sentinel in ready:
                    replies[rank] = ("error", f"the process died with exit code {self._processes[rank].exitcode}")
                    self._replace([rank])
            if not ready:
                silent = [rank for rank in ranks if rank not in replies]
                replies.update({rank: ("error", "silent past the call's time (hung?)") for rank in silent})
                self._replace(silent)
            elif any(kind != "ok" for kind, _ in replies.values()):
                deadline = min(deadline, time.monotonic() + FAILURE_GRACE_S)
        return replies

    def close(self) -> None:
        for tasks in self._tasks:
            if tasks is not None:
                tasks.close()  # each process ends when it sees its pipe close
        for process in self._processes:
            if process is not None:
                process.join(timeout=5)
                if process.is_alive():
                    process.kill()


@functools.cache
def _pool() -> ProcessPool:
    pool = ProcessPool(POOL_SIZE)
    atexit.register(pool.close)
    return pool


def sequence_parallel_error(model, plan: ParallelConfig, run, serial: torch.Tensor) -> tuple[float, int]:
    """``run(m)`` (one call of ``m``) with ``model`` split by ``plan`` over this process group: the relative L2 of
    its output against ``serial``, and the bytes this rank sent. The split swaps the model's attention in place."""
    context = ParallelContext.build(plan, torch.device("cpu"))
    out = run(parallelize(model, None, context).forward)
    return relative_l2(out, serial), sum(context.stats.bytes_sent.values())


def run_on_processes(world: int, fn, *args):
    """``fn(*args)`` on ``world`` gloo processes; returns what rank 0's call returned."""
    if os.environ.get("PARADIT_TEST_FRESH_PROCESSES"):  # a body suspected of leaking state: processes of its own
        pool = ProcessPool(world)
        try:
            return pool.run(world, fn, args)
        finally:
            pool.close()
    return _pool().run(world, fn, args)
