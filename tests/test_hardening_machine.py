"""Plans checked against the machine before anything starts: a group of CPU processes past the cores is one line
and exit 2, and no worker is spawned."""

from __future__ import annotations

from paradit.cli import main


def test_a_thousand_cpu_processes_are_refused_before_one_starts(capsys, monkeypatch):
    started = []
    monkeypatch.setattr("paradit.worker.WorkerGroup.__init__", lambda *args, **kwargs: started.append(args))
    assert main(["generate", "--device", "cpu", "--gpus", "1000", "--prompt", "a", "--out", "/tmp/x.png"]) == 2
    error = capsys.readouterr().err
    assert error.startswith("paradit: error: 1000 CPU processes asked for on ") and "give at most" in error
    assert started == []
