"""Worker processes and ``WorkerGroup``, the engine's side; a worker sets up its signals before importing torch."""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import functools
import multiprocessing
import multiprocessing.forkserver
import os
import pickle
import queue
import shutil
import signal
import sys
import tempfile
import threading
import time
import traceback
import weakref
from multiprocessing import reduction
from multiprocessing.connection import wait
from typing import TYPE_CHECKING

from paradit.errors import ParaditError, report_warnings

if TYPE_CHECKING:
    from multiprocessing.connection import Connection
    from multiprocessing.process import BaseProcess
    from multiprocessing.queues import Queue

    from paradit.request import GenerationResult, ResolvedRequest
    from paradit.settings import WorkerPlan

POLL_S = 0.5
FAILURE_GRACE_S = 10  # a failed worker's peers get this long to end the request before the group is stuck
CLOSE_S = 30  # idle workers asked to finish get this long, together, before they are terminated
STOP_S = 10  # terminated workers get this long, together, before they are killed
ORPHAN_EXIT_S = 3  # an orphan's grace to unwind after its SIGTERM
FORKSERVER_PRELOAD = ["torch", "torch.distributed", "paradit.loader"]
UNIX_SOCKET_PATH_MAX = 103 if sys.platform == "darwin" else 107  # sun_path's bytes less the closing NUL

UNGUARDED_MAIN_EXIT = 87  # a spawned child re-running an unguarded main script exits with this
UNGUARDED_MAIN = (
    'paradit: error: a script that starts worker processes must guard its entry point with `if __name__ == "__main__":`'
    " (spawned workers import the main module)"
)


class WorkerFailure(ParaditError):
    """A worker process died or raised; the group has been stopped."""


class RequestCancelled(ParaditError):
    """The request was stopped between two denoise steps (``Engine.cancel``); the engine still serves."""


class RequestFailed(ParaditError):
    """The request raised an unexpected error in the workers; the engine still serves."""


def reportable(error: BaseException) -> ParaditError:
    """What the engine's side can receive: paradit's errors pickle; any other is one line naming its trace's file."""
    if isinstance(error, ParaditError):
        return error
    with tempfile.NamedTemporaryFile("w", prefix="paradit-error-", suffix=".log", delete=False) as log:
        traceback.print_exception(error, file=log)
    return RequestFailed(f"{type(error).__name__}: {error}; full trace in {log.name}")


class StepSignals:
    """Progress and cancellation of numbered runs, in memory the engine shares with its workers."""

    def __init__(self, world_size: int, context: multiprocessing.context.BaseContext | None = None) -> None:
        # [current run, run to stop, steps at which it stops, then (run, steps done) per rank]
        self._state = (context or multiprocessing.get_context("spawn")).Array("q", 3 + 2 * world_size)
        self._world_size = world_size

    def begin(self) -> int:
        with self._state.get_lock():
            self._state[0] += 1
            return self._state[0]

    def check(self, rank: int, run: int, steps: int) -> None:
        with self._state.get_lock():
            self._state[3 + 2 * rank], self._state[4 + 2 * rank] = run, steps
            if self._state[1] == run and steps >= self._state[2]:
                raise RequestCancelled(f"the request was cancelled after {steps} denoise steps")

    def cancel(self) -> None:
        """Stop the run one step past the furthest any rank reported, which all ranks reach; a stop once set stays."""
        with self._state.get_lock():
            run = self._state[0]
            if self._state[1] == run:
                return
            reached = [self._state[4 + 2 * r] for r in range(self._world_size) if self._state[3 + 2 * r] == run]
            self._state[1], self._state[2] = run, max(reached, default=-1) + 1

    def steps_done(self) -> int:
        with self._state.get_lock():
            return self._state[4] if self._state[3] == self._state[0] else 0


def worker_context(device_type: str) -> multiprocessing.context.BaseContext:
    """A forkserver that preloaded ``FORKSERVER_PRELOAD``; spawn where it cannot serve, and on ROCm (CUDA checks)."""
    from unittest import mock

    import torch

    socket = os.path.join(tempfile.gettempdir(), "pymp-12345678", "listener-12345678")  # the names it would use
    too_long = len(os.fsencode(socket)) > UNIX_SOCKET_PATH_MAX
    rocm = device_type != "cpu" and torch.version.hip is not None
    if "forkserver" not in multiprocessing.get_all_start_methods() or too_long or rocm:
        return multiprocessing.get_context("spawn")
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(FORKSERVER_PRELOAD)  # read once, when the forkserver first starts
    # diffusers asks torch.cuda.is_available() at import; answered through NVML, it initialises no CUDA here.
    with mock.patch.dict(os.environ, {"PYTORCH_NVML_BASED_CUDA_CHECK": "1"}), sigint_ignored_by_children():
        multiprocessing.forkserver.ensure_running()
    return context


class EngineStreams:
    """This process's stdout and stderr for a starting worker, which, forked, would write to the forkserver's."""

    def __reduce__(self):
        return _detach_all, (reduction.DupFd(1), reduction.DupFd(2))


def _detach_all(*fds) -> list[int]:
    return [fd.detach() for fd in fds]


def start_worker_server(device: str | None) -> None:
    """Start the forkserver now, so that its imports run beside this process's own instead of after them."""
    import torch

    worker_context(torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu")).type)


def worker_main(
    rank: int,
    pickled_plan: bytes,
    requests: list[Queue],
    results: Queue,
    rendezvous: str,
    signals: StepSignals,
    lifeline: Connection,
    environment: dict[str, str],
    streams: list[int] | None,
    first_device: int = 0,
    threads: int | None = None,
) -> None:
    """Build this rank's pipeline and serve requests until a None; ``streams``: ``EngineStreams``' descriptors."""
    # A terminal's Ctrl-C reaches the whole process group; the engine stops the workers, without a traceback each.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, exit_on_sigterm)
    threading.Thread(target=exit_with_lifeline, args=(lifeline, rendezvous), name="lifeline", daemon=True).start()
    os.environ.clear()
    os.environ.update(environment)
    for standard, fd in enumerate(streams or [], start=1):
        os.dup2(fd, standard)
        os.close(fd)
    report_warnings()
    # Imported only now, so the above covers them too; torch also registers the reductions that share tensors' memory.
    import torch
    import torch.distributed as dist
    from tqdm import tqdm

    from paradit.loader import build_pipeline, run_requests

    # tqdm's default lock is a named semaphore, which a worker killed inside a step (Engine.abort) would leak.
    tqdm.set_lock(threading.RLock())

    plan: WorkerPlan = pickle.loads(pickled_plan)
    if plan.device_type == "cpu":
        # Processes sharing the CPU would otherwise each start one thread per core and thrash.
        torch.set_num_threads(threads or max(1, (os.cpu_count() or 1) // plan.parallel.world_size))
    try:
        pipeline = build_pipeline(plan, rank, first_device + rank)
        results.put(("ready", rank, None))
        while (message := requests[rank].get()) is not None:
            run, request, progress = message
            try:
                result = run_requests(
                    pipeline, plan, request, progress and rank == 0, functools.partial(signals.check, rank, run)
                )
            except Exception as exc:  # noqa: BLE001 - the request's failure, not the worker's: it serves on
                results.put(("failed", rank, reportable(exc)))
            else:
                results.put(("done", rank, result))
    except SystemExit:  # stopped (exit_on_sigterm): nothing to report
        raise
    except BaseException as exc:  # noqa: BLE001 - whatever it is, the engine must hear it rather than hang
        if signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
            # Stopped, and the SystemExit surfaced as another error (code it interrupted wrapped it): nothing to report.
            raise SystemExit(128 + signal.SIGTERM) from None
        results.put(("error", rank, reportable(exc)))
        raise SystemExit(1) from None
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def exit_on_sigterm(signum: int, frame) -> None:
    """Leave through Python's exit, so that multiprocessing's finalizers unlink this worker's semaphores and files."""
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    raise SystemExit(128 + signum)


def exit_with_lifeline(lifeline: Connection, rendezvous: str) -> None:
    """Once the engine's process is gone, however it died (it holds the lifeline's only write end), end this worker."""
    wait([lifeline])
    shutil.rmtree(rendezvous, ignore_errors=True)
    if hasattr(signal, "pthread_kill"):  # POSIX: sent to the main thread, it also interrupts a blocking read there
        signal.pthread_kill(threading.main_thread().ident, signal.SIGTERM)
        time.sleep(ORPHAN_EXIT_S)
    os._exit(1)  # no SIGTERM to unwind with, or the main thread is stuck in a collective that will never finish


@contextlib.contextmanager
def sigint_ignored_by_children():
    """Processes started inside inherit SIGINT ignored, so a Ctrl-C while they start prints no traceback."""
    previous = signal.getsignal(signal.SIGINT)
    if threading.current_thread() is not threading.main_thread() or previous is None:
        yield
        return
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


def stop_processes(processes: list[BaseProcess], rendezvous: tempfile.TemporaryDirectory, lifeline: Connection) -> None:
    """Terminate the workers, kill those that outlast ``STOP_S``; the lifeline last (first, it would kill outright)."""
    for process in processes:
        if process.is_alive():
            process.terminate()
    deadline = time.monotonic() + STOP_S
    for process in processes:
        process.join(timeout=max(0.0, deadline - time.monotonic()))
        if process.is_alive():
            process.kill()
            process.join(timeout=STOP_S)
    rendezvous.cleanup()
    lifeline.close()


class WorkerGroup:
    """``threads``: torch's CPU threads per worker (default: the cores shared among the group)."""

    def __init__(self, plan: WorkerPlan, first_device: int = 0, threads: int | None = None) -> None:
        if getattr(multiprocessing.current_process(), "_inheriting", False):
            # A worker re-running an unguarded main script (not SystemExit: the forkserver would make it exit 1).
            os._exit(UNGUARDED_MAIN_EXIT)
        self.world_size = plan.parallel.world_size
        context = worker_context(plan.device_type)
        self._rendezvous = tempfile.TemporaryDirectory(prefix="paradit-")
        # Pickled here, unpickled by each worker once its signal handling is set up (unpickling imports torch).
        plan = pickle.dumps(dataclasses.replace(plan, init_method=f"file://{self._rendezvous.name}/store"))
        lifeline, self._lifeline = context.Pipe(duplex=False)
        self.requests = [context.Queue() for _ in range(self.world_size)]
        self.results = context.Queue()
        self.signals = StepSignals(self.world_size, context)
        self.processes: list[BaseProcess] = []  # the started ones: stop_processes joins only those
        # Also at exit, before multiprocessing's own handler joins the workers without a time limit.
        self._stop = weakref.finalize(self, stop_processes, self.processes, self._rendezvous, self._lifeline)
        atexit.register(self._stop)
        self._in_flight = False  # a request is being served: close() does not wait for it
        try:
            streams = EngineStreams() if context.get_start_method() == "forkserver" else None
            shared = (
                plan,
                self.requests,
                self.results,
                self._rendezvous.name,
                self.signals,
                lifeline,
                dict(os.environ),
                streams,
                first_device,
                threads,
            )
            for rank in range(self.world_size):
                process = context.Process(target=worker_main, args=(rank, *shared), daemon=True)
                with sigint_ignored_by_children():
                    process.start()
                self.processes.append(process)
            lifeline.close()
            for _ in range(self.world_size):
                self._next_message()  # each worker says "ready" once its share of the model is loaded
        except BaseException:  # an interrupt while loading, or a worker's failure: no worker outlives the engine
            self.stop()
            raise

    def _next_message(self, deadline: float | None = None) -> tuple[str, int, object] | None:
        """The workers' next message, or None once ``deadline`` passes; a worker's error or death raises."""
        while True:
            try:
                kind, rank, payload = self.results.get(timeout=POLL_S)
            except queue.Empty:
                if any(p.exitcode is not None for p in self.processes):
                    raise self._failure() from None
                if deadline is not None and time.monotonic() > deadline:
                    return None
                continue
            if kind == "error":
                raise self._failure(rank, payload)
            return kind, rank, payload

    def _failure(self, reporter: int | None = None, error: ParaditError | None = None) -> ParaditError | SystemExit:
        """Stop the group and say why: a worker that died is the cause, its peers' errors consequences."""
        deadline = time.monotonic() + 2 * POLL_S
        while time.monotonic() < deadline and not self._dead(reporter):
            time.sleep(0.05)
        dead = self._dead(reporter)
        self.stop()
        if any(code == UNGUARDED_MAIN_EXIT for _, code in dead):
            return SystemExit(UNGUARDED_MAIN)
        if reporter is not None:  # peers that exited with 1 reported their own failure (worker_main): not a cause
            dead = [(rank, code) for rank, code in dead if code != 1]
            if not dead and not isinstance(error, RequestFailed):
                return error
        reasons = [f"worker {rank} exited with code {code}" for rank, code in dead]
        reasons += [f"worker {reporter} failed: {error}"] if reporter is not None else []
        return WorkerFailure("; ".join(reasons) + "; the worker group was stopped")

    def _dead(self, exclude: int | None) -> list[tuple[int, int]]:
        return [(r, p.exitcode) for r, p in enumerate(self.processes) if p.exitcode is not None and r != exclude]

    def generate(self, request: list[ResolvedRequest], progress: bool = False) -> list[GenerationResult]:
        """Rank 0's results; an error that leaves other ranks silent stops the group."""
        if not self.processes:
            raise WorkerFailure("this engine's worker group was stopped; create a new Engine")
        self._in_flight = True
        run = self.signals.begin()
        for requests in self.requests:
            requests.put((run, request, progress))
        ends: dict[int, tuple[str, object]] = {}
        deadline = None
        while len(ends) < self.world_size:
            message = self._next_message(deadline)
            if message is None:
                silent = sorted(set(range(self.world_size)) - ends.keys())
                failed = sorted(rank for rank, (kind, _) in ends.items() if kind == "failed")
                self.stop()
                raise WorkerFailure(
                    f"workers {silent} did not end a request that workers {failed} failed "
                    f"({ends[failed[0]][1]}); the worker group was stopped"
                )
            kind, rank, payload = message
            ends[rank] = (kind, payload)
            if kind == "failed" and deadline is None:
                deadline = time.monotonic() + FAILURE_GRACE_S
        self._in_flight = False
        failures = [payload for kind, payload in ends.values() if kind == "failed"]
        if failures:  # a cancellation is what every rank reports; any other error is the news
            raise next((f for f in failures if not isinstance(f, RequestCancelled)), failures[0])
        return ends[0][1]

    def stop(self) -> None:
        self._stop()
        atexit.unregister(self._stop)
        self.processes = []

    def close(self) -> None:
        """Ask idle workers to finish, then stop whatever did not; a request cut short is not awaited."""
        if not self._in_flight:
            for requests in self.requests if self.processes else []:
                requests.put(None)
            deadline = time.monotonic() + CLOSE_S
            for process in self.processes:
                process.join(timeout=max(0.0, deadline - time.monotonic()))
        self.stop()
