"""Whole requests across CPU processes (gloo): every plan gives the one-process image, and a dead worker stops the
group with its reason instead of hanging."""

from __future__ import annotations

import dataclasses
import os
import re
import signal
import tempfile
import time

import numpy as np
import pytest
import torch
from PIL import Image

from paradit import Engine, GenerationRequest, InvalidRequest
from paradit.cli import main
from paradit.options import ExecutionOptions
from paradit.parallel import ParallelConfig
from paradit.worker import WorkerFailure, worker_context

# 15 image tokens and 512 text tokens: the image split is uneven at 2 and 4, the text split at 3; the tiny
# preset's 4 heads split unevenly over Ulysses 3.
REQUEST = GenerationRequest(prompt=["a red fox", "a blue bird"], height=48, width=80, steps=2, seed=11, guidance=3.0)


@pytest.fixture(scope="module")
def serial_pixels() -> torch.Tensor:
    return Engine("flux2-tiny", device="cpu", dtype="fp32").generate(REQUEST).pixels


@pytest.mark.parametrize(
    "plan",
    [
        ParallelConfig(cfg=2),
        ParallelConfig(ulysses=3),
        ParallelConfig(ring=3),
        ParallelConfig(cfg=2, ulysses=2),
        ParallelConfig(cfg=2, ring=2),
    ],
    ids=lambda plan: plan.describe(),
)
def test_plan_gives_the_serial_image(plan, serial_pixels):
    with Engine("flux2-tiny", device="cpu", dtype="fp32", parallel=plan) as engine:
        result = engine.generate(REQUEST)
        assert result.timings.plan == plan.describe()
        assert result.timings.comm_bytes_per_step > 0
        # Every worker reports its own peak (process RSS on the CPU: at least the tiny model and the interpreter).
        peaks = result.timings.peak_memory_per_rank
        assert len(peaks) == plan.world_size and min(peaks) > 100 * 2**20
        assert peaks[0] == result.timings.peak_memory_bytes
        # The group keeps serving: a second request with another seed differs and is again exact.
        again = engine.generate(REQUEST)
    assert result.pixels.shape == serial_pixels.shape
    assert (result.pixels - serial_pixels).abs().max().item() <= 1e-4
    assert torch.equal(again.pixels, result.pixels)


@pytest.mark.parametrize(
    "plan",
    [
        ParallelConfig(ulysses=2),
        ParallelConfig(ring=2),
        ParallelConfig(cfg=2),
        ParallelConfig(tensor=2),
        ParallelConfig(pipefusion=2, patches=2, warmup_steps=REQUEST.steps),  # warm-up only: exact
    ],
    ids=lambda plan: plan.describe(),
)
def test_a_request_without_a_seed_gives_the_one_process_image_of_the_seed_it_reports(plan):
    """The seed is drawn once, by the engine: every rank denoises the same noise, and the result names its seed."""
    unseeded = dataclasses.replace(REQUEST, seed=None)
    with Engine("flux2-tiny", device="cpu", dtype="fp32", parallel=plan) as engine:
        result = engine.generate(unseeded)
    alone = Engine("flux2-tiny", device="cpu", dtype="fp32").generate(dataclasses.replace(REQUEST, seed=result.seed))
    assert (result.pixels - alone.pixels).abs().max().item() <= 1e-4


def test_cli_seed_random_across_processes_writes_the_image_of_the_seed_it_prints(tmp_path, capsys):
    args = [
        "generate",
        "--device",
        "cpu",
        "--prompt",
        "a castle",
        "--steps",
        "2",
        "--height",
        "48",
        "--width",
        "64",
        "--no-progress",
    ]
    assert main([*args, "--gpus", "2", "--ulysses", "2", "--seed", "random", "--out", str(tmp_path / "two.png")]) == 0
    printed = int(re.search(r"^seed\s+(\d+)$", capsys.readouterr().out, re.MULTILINE).group(1))
    assert main([*args, "--seed", str(printed), "--out", str(tmp_path / "one.png")]) == 0
    one = np.asarray(Image.open(tmp_path / "one.png"), dtype=np.int16)
    two = np.asarray(Image.open(tmp_path / "two.png"), dtype=np.int16)
    assert np.abs(one - two).max() <= 1


def test_compiled_blocks_under_ulysses_give_the_serial_image(serial_pixels):
    """Execution options compose with the parallel runtime: compiled blocks, attention collectives between them."""
    options = ExecutionOptions(compile=True)
    with Engine(
        "flux2-tiny", device="cpu", dtype="fp32", parallel=ParallelConfig(ulysses=2), options=options
    ) as engine:
        result = engine.generate(REQUEST)
    assert (result.pixels - serial_pixels).abs().max().item() <= 1e-4


def test_a_temporary_folder_too_deep_for_the_forkserver_spawns_the_workers(serial_pixels, tmp_path, monkeypatch):
    """The forkserver listens on a Unix socket in the temporary folder, whose path has a length limit (108 bytes on
    Linux); under a deeper TMPDIR the workers are spawned instead, and serve the same image."""
    deep = tmp_path / ("d" * 60) / ("e" * 60)
    deep.mkdir(parents=True)
    monkeypatch.setattr(tempfile, "tempdir", str(deep))
    assert worker_context("cpu").get_start_method() == "spawn"
    with Engine("flux2-tiny", device="cpu", dtype="fp32", parallel=ParallelConfig(ring=2)) as engine:
        result = engine.generate(REQUEST)
    assert (result.pixels - serial_pixels).abs().max().item() <= 1e-4
    monkeypatch.undo()
    assert worker_context("cpu").get_start_method() == "forkserver"


def test_cli_parallel_png_equals_single_process_png(tmp_path, capsys):
    args = ["generate", "--device", "cpu", "--dtype", "fp32", "--prompt", "a castle", "--steps", "2", "--seed", "5"]
    args += ["--height", "48", "--width", "64", "--no-progress"]
    assert main([*args, "--out", str(tmp_path / "one.png")]) == 0
    assert main([*args, "--gpus", "2", "--ulysses", "2", "--verify-serial", "--out", str(tmp_path / "two.png")]) == 0
    out = capsys.readouterr().out
    assert "ulysses 2 image equals the 1-process image" in out and "sent per step" in out
    one = np.asarray(Image.open(tmp_path / "one.png"), dtype=np.int16)
    two = np.asarray(Image.open(tmp_path / "two.png"), dtype=np.int16)
    assert one.shape == two.shape == (48, 64, 3)
    assert np.abs(one - two).max() <= 1


def test_impossible_plans_are_refused_with_the_working_ones():
    with pytest.raises(InvalidRequest, match="plans for 4 GPUs: cfg 2 x ulysses 2"):
        ParallelConfig(ulysses=3).validate(4, has_cfg=True, heads=4)
    with pytest.raises(InvalidRequest, match="exceeds the 4 attention heads each rank holds"):
        ParallelConfig(ulysses=8).validate(8, has_cfg=True, heads=4)
    with pytest.raises(InvalidRequest, match="cfg parallel needs a model run with classifier-free guidance"):
        Engine("flux2-klein-4b", device="cpu", load_format="dummy", parallel=ParallelConfig(cfg=2))


def test_a_dead_worker_stops_the_group_with_its_reason():
    engine = Engine("flux2-tiny", device="cpu", parallel=ParallelConfig(ulysses=2))
    victim = engine._group.processes[1]
    os.kill(victim.pid, signal.SIGKILL)
    victim.join(timeout=10)
    start = time.monotonic()
    with pytest.raises(WorkerFailure, match="^worker 1 exited with code -9"):
        engine.generate(GenerationRequest(prompt="a fox", steps=1, height=32, width=32))
    assert time.monotonic() - start < 30
    assert all(not p.is_alive() for p in engine._group.processes) or not engine._group.processes
    with pytest.raises(WorkerFailure, match="stopped"):
        engine.generate(GenerationRequest(prompt="a fox", steps=1, height=32, width=32))
