"""The worker processes never outlive the engine: real ``paradit generate --gpus 2`` runs on the CPU, signalled the
ways a terminal, a job scheduler or the OOM killer would, and scripts using ``paradit.Engine``. Each run gets its own
TMPDIR, so that the rendezvous folder it makes (and any other temporary file left behind) is found there. Linux only:
the processes are found and watched through /proc."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="watches processes through /proc")

REPO_ROOT = Path(__file__).resolve().parent.parent
STARTUP_S = 240  # three processes importing torch and the model code on two busy cores
GONE_S = 10  # what a stopped or orphaned worker gets to be gone, and its folder with it
# Steps enough that a run is still denoising when it is signalled (each step is tens of ms on the tiny model).
# 10,000 steps of about 18 ms: three minutes of denoising left whenever a test signals it, so a stop within
# ``STOP_S`` is the engine stopping its workers, never the request ending, however slow the machine's exits.
GENERATE = [
    "generate",
    "--device",
    "cpu",
    "--gpus",
    "2",
    "--prompt",
    "a fox",
    "--steps",
    "10000",
    "--height",
    "32",
    "--width",
    "32",
]
STOP_S = 20
PROGRESS_BAR = re.compile(r"denoise:[^\]\r\n]*\]?")  # one drawing of rank 0's tqdm bar


def process_id(pid: int) -> tuple[int, int] | None:
    """``(pid, start time)`` of a live process (the start time tells a reused PID apart), None for one gone or a
    zombie."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (FileNotFoundError, ProcessLookupError):
        return None
    return None if fields[0] in "ZX" else (pid, int(fields[19]))


def children(pid: int) -> list[tuple[int, int]]:
    """The live children of ``pid``."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except (FileNotFoundError, ProcessLookupError):  # ended while we looked
            continue
        if int(stat.rsplit(")", 1)[1].split()[1]) == pid and (ident := process_id(int(entry.name))):
            found.append(ident)
    return found


def descendants(pid: int) -> list[tuple[int, int]]:
    """The live processes below ``pid``: a paradit run's resource tracker, its forkserver and the workers forked from
    that."""
    found = children(pid)
    return found + [grandchild for child, _ in found for grandchild in descendants(child)]


def ignores_sigint(pid: int) -> bool:
    """Whether SIGINT is ignored (SIG_IGN) in process ``pid``."""
    mask = next(line for line in Path(f"/proc/{pid}/status").read_text().splitlines() if line.startswith("SigIgn:"))
    return bool(int(mask.split()[1], 16) & (1 << (signal.SIGINT - 1)))


def still_alive(idents: list[tuple[int, int]], timeout: float = GONE_S) -> list[tuple[int, int]]:
    """The processes of ``idents`` still running after up to ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while (alive := [i for i in idents if process_id(i[0]) == i]) and time.monotonic() < deadline:
        time.sleep(0.1)
    return alive


def leftovers(tmpdir: Path, timeout: float = GONE_S, prefixes: tuple[str, ...] = ("paradit-", "pymp-")) -> list[str]:
    """What paradit or multiprocessing left in a run's TMPDIR (the names starting with ``prefixes``) after up to
    ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while (left := sorted(p.name for p in tmpdir.iterdir() if p.name.startswith(prefixes))) and (
        time.monotonic() < deadline
    ):
        time.sleep(0.1)
    return left


class Run:
    """One subprocess in a session (a process group) of its own, its stderr gathered as it comes."""

    def __init__(self, argv: list[str], tmpdir: Path) -> None:
        self.tmpdir = tmpdir
        env = {**os.environ, "TMPDIR": str(tmpdir), "PYTHONUNBUFFERED": "1"}
        self.proc = subprocess.Popen(
            argv, cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True
        )
        self._stdout, self._stderr = [], []
        self._readers = [
            threading.Thread(target=self._read, args=(stream, chunks), daemon=True)
            for stream, chunks in ((self.proc.stdout, self._stdout), (self.proc.stderr, self._stderr))
        ]
        for reader in self._readers:
            reader.start()

    @staticmethod
    def _read(stream, chunks: list[bytes]) -> None:
        while chunk := stream.read1(65536):
            chunks.append(chunk)

    @property
    def stdout(self) -> str:
        return b"".join(self._stdout).decode(errors="replace")

    @property
    def stderr(self) -> str:
        return b"".join(self._stderr).decode(errors="replace")

    def wait(self, timeout: float) -> int:
        code = self.proc.wait(timeout=timeout)
        for reader in self._readers:
            reader.join(timeout=GONE_S)  # the pipes close once the workers, which share them, are gone too
        return code

    def wait_until(self, ready, what: str, timeout: float = STARTUP_S):
        """Poll ``ready()`` until it returns something true, and return that."""
        deadline = time.monotonic() + timeout
        while not (found := ready()):
            assert self.proc.poll() is None, f"the run ended before {what}: {self.proc.returncode}\n{self.stderr}"
            assert time.monotonic() < deadline, f"no {what} after {timeout} s\n{self.stderr}"
            time.sleep(0.1)
        return found

    def workers(self) -> list[tuple[int, int]]:
        """Wait until both workers exist and the parent is done starting them (it ignores SIGINT while it starts
        one); the workers, which the run's forkserver forked."""

        def started():
            servers = [pid for pid, _ in children(self.proc.pid) if b"forkserver" in cmdline(pid)]
            forked = [worker for server in servers for worker in children(server)]
            return forked if len(forked) == 2 and not ignores_sigint(self.proc.pid) else None

        return self.wait_until(started, "2 workers")

    def denoising(self) -> list[tuple[int, int]]:
        """Wait until rank 0 draws its progress bar (the request is being served); the run's workers and resource
        tracker."""
        self.wait_until(lambda: "denoise:" in self.stderr, "progress bar")
        return descendants(self.proc.pid)

    def messages(self) -> list[str]:
        """The lines of stderr, the progress bar's drawings left out."""
        return [line.strip() for line in re.split(r"[\r\n]", PROGRESS_BAR.sub("", self.stderr)) if line.strip()]

    def kill_all(self) -> None:
        """End whatever is left of the run: its workers stay in its process group even when orphaned."""
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait(timeout=GONE_S)


def cmdline(pid: int) -> bytes:
    """The command line of process ``pid`` (empty once it is gone)."""
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except (FileNotFoundError, ProcessLookupError):
        return b""


@pytest.fixture
def start():
    """``start(argv)`` runs ``python argv...`` with a TMPDIR of its own; everything it started is killed at the end
    of the test, whatever happened. The TMPDIRs are made in the system's temporary folder, not in the test's deeper
    one: the forkserver's socket lives there, and a deep path spawns the workers instead (worker_context)."""
    runs = []

    def start(argv: list[str]) -> Run:
        runs.append(Run([sys.executable, *argv], Path(tempfile.mkdtemp(prefix="run-"))))
        return runs[-1]

    yield start
    for run in runs:
        run.kill_all()
        shutil.rmtree(run.tmpdir, ignore_errors=True)


def generate(out_dir: Path, *extra: str) -> list[str]:
    """``paradit generate`` of a run long enough to be signalled while it goes, writing into ``out_dir``."""
    return ["-m", "paradit", *GENERATE, "--out", str(out_dir / "out.png"), *extra]


def assert_stopped(run: Run, code: int, message: str, processes: list[tuple[int, int]]) -> None:
    """The run ended with ``code`` and one line, ``message``, and left no process or temporary file behind."""
    assert code == {"paradit: interrupted": 130, "paradit: terminated": 143}[message], run.stderr
    assert "Traceback" not in run.stderr
    assert run.messages() == [message], run.stderr
    assert not still_alive(processes)
    assert not leftovers(run.tmpdir)


def test_ctrl_c_to_the_engine_process_stops_a_running_request_at_once(start, tmp_path):
    run = start(generate(tmp_path))
    processes = run.denoising()
    begun = time.monotonic()
    run.proc.send_signal(signal.SIGINT)
    code = run.wait(timeout=30)
    assert time.monotonic() - begun < STOP_S, "the engine waited for the request instead of stopping its workers"
    assert_stopped(run, code, "paradit: interrupted", processes)


def test_ctrl_c_in_a_terminal_reaches_the_workers_starting_and_they_leave_it_to_the_engine(start, tmp_path):
    run = start(generate(tmp_path, "--no-progress"))
    workers = run.workers()
    ignored = all(ignores_sigint(pid) for pid, _ in workers)  # from their first instruction, imports included
    processes = descendants(run.proc.pid)
    os.killpg(run.proc.pid, signal.SIGINT)  # what a terminal's Ctrl-C does: the whole foreground process group
    code = run.wait(timeout=30)
    assert_stopped(run, code, "paradit: interrupted", processes)
    assert ignored


def test_sigterm_to_the_engine_process_stops_the_workers(start, tmp_path):
    run = start(generate(tmp_path, "--no-progress"))
    run.workers()
    processes = descendants(run.proc.pid)
    run.proc.terminate()
    code = run.wait(timeout=30)
    assert_stopped(run, code, "paradit: terminated", processes)


def test_workers_of_a_killed_engine_process_remove_the_folder_and_exit(start, tmp_path):
    run = start(generate(tmp_path, "--no-progress"))
    run.workers()
    processes = descendants(run.proc.pid)  # the workers, the forkserver and multiprocessing's resource tracker
    run.proc.kill()
    assert run.wait(timeout=GONE_S) == -signal.SIGKILL
    assert not still_alive(processes)
    # A killed process cannot remove its own pymp- folder: waiting for that one would spend the whole timeout.
    assert not leftovers(run.tmpdir, prefixes=("paradit-",))


def test_an_engine_left_open_stops_its_workers_when_the_script_ends(start, tmp_path):
    """Interpreter exit without ``close()``: the workers stop, cleanly (``with`` and ``close()`` take the same way,
    after asking idle workers to finish; an interrupted ``with`` is the first test's)."""
    script = tmp_path / "script.py"
    script.write_text(
        textwrap.dedent(
            """
            from paradit import Engine, GenerationRequest, ParallelConfig

            if __name__ == "__main__":
                engine = Engine(device="cpu", parallel=ParallelConfig(ulysses=2))
                engine.generate(GenerationRequest(prompt="a fox", steps=1, height=32, width=32))
                print(*(worker.pid for worker in engine._group.processes))
            """
        )
    )
    run = start([str(script)])
    assert run.wait(timeout=STARTUP_S) == 0, run.stderr
    assert run.stderr == ""  # no traceback, nor the resource tracker's warning of semaphores left behind
    assert not [pid for pid in map(int, run.stdout.split()) if process_id(pid)]
    assert not leftovers(run.tmpdir)


def test_a_script_without_a_main_guard_gets_one_line(start, tmp_path):
    script = tmp_path / "unguarded.py"
    script.write_text(
        'from paradit import Engine, ParallelConfig\n\nEngine(device="cpu", parallel=ParallelConfig(ulysses=2))\n'
    )
    run = start([str(script)])
    assert run.wait(timeout=STARTUP_S) != 0
    assert "Traceback" not in run.stderr
    [line] = run.messages()
    assert line.startswith("paradit: error: a script that starts worker processes must guard its entry point"), line
    assert 'if __name__ == "__main__":' in line
    assert not leftovers(run.tmpdir)
