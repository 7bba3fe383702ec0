"""Plans checked against the machine before anything starts: a group of CPU processes past the cores is one line
and exit 2, and no worker is spawned."""

from __future__ import annotations

from paradit.cli import main
from paradit.parallel.config import ParallelConfig
from paradit.settings import Asked, settle


def test_a_thousand_cpu_processes_are_refused_before_one_starts(capsys, monkeypatch):
    started = []
    monkeypatch.setattr("paradit.worker.WorkerGroup.__init__", lambda *args, **kwargs: started.append(args))
    assert main(["generate", "--device", "cpu", "--gpus", "1000", "--prompt", "a", "--out", "/tmp/x.png"]) == 2
    error = capsys.readouterr().err
    assert error.startswith("paradit: error: 1000 CPU processes asked for on ") and "give at most" in error
    assert started == []


def test_a_cpu_group_whose_weights_pass_the_memory_available_is_refused_before_one_starts(capsys, monkeypatch):
    """flux2-dev's 32B parameters in float32 (120 GiB) were spawned on a 24 GB machine, to be killed by the OOM
    killer; the bound counts only each process's share of the transformer, so it never refuses what fits."""
    started = []
    monkeypatch.setattr("paradit.worker.WorkerGroup.__init__", lambda *args, **kwargs: started.append(args))
    monkeypatch.setattr("paradit.settings.available_memory", lambda: 100 * 2**30)
    argv = ["generate", "--device", "cpu", "--model", "flux2-dev", "--load-format", "dummy", "--prompt", "a"]
    assert main([*argv, "--gpus", "2", "--out", "/tmp/x.png"]) == 2
    error = capsys.readouterr().err
    assert (
        error.startswith(
            "paradit: error: 2 CPU process(es) would hold 240.1 GiB of flux2-dev's transformer weights "
            "in float32, past the 100.0 GiB"
        )
        and "--dtype bf16" in error
    ), error
    assert started == []
    fitting = Asked("flux2-dev", "cpu", "bf16", "dummy", parallel=ParallelConfig(tensor=2))  # 60 GiB of shares
    assert settle(fitting).parallel.tensor == 2
