"""What a real GPU needs of the memory plan, checked on the CPU: the allocator set up for the cap (the user's own
settings standing), an uncapped GPU run planned for the memory its GPUs have free (placing the prompt encoders as a
capped run would), an engine that gives back every tensor when it closes, and a device out-of-memory error (made by
``tests/oom_site``) told in one line naming the stage and the figures, exit 1, nothing written, no process left.
``benchmarks/gpu_checks.py`` runs the same on a GPU."""

from __future__ import annotations

import dataclasses
import gc
import os
import subprocess
import sys
import time
import weakref
from pathlib import Path

import pytest
import torch

from paradit import Engine, GenerationRequest
from paradit.device_memory import EXPANDABLE_SEGMENTS, configure_allocator
from paradit.errors import InvalidRequest
from paradit.machine import Machine
from paradit.memory import estimates
from paradit.parallel import ParallelConfig
from paradit.settings import Asked, settle
from paradit.worker import WorkerFailure
from tests.test_processes import GONE_S, leftovers

REPO_ROOT = Path(__file__).resolve().parents[1]
OOM_SITE = Path(__file__).parent / "oom_site"
# flux2-tiny's transformer attends over its 512 text tokens and the image's tokens (16 px a side each): a size no
# other attention of the run has (its prompt encoder attends over the 512 alone).
OOM_SIZE = 48
OOM_TOKENS = 512 + (OOM_SIZE // 16) ** 2


def oom_environment(tmp_path: Path) -> dict[str, str]:
    """The environment of a run whose transformer runs out of device memory at its first step (``tests/oom_site``)."""
    path = os.pathsep.join([str(OOM_SITE), os.environ.get("PYTHONPATH", "")])
    return {**os.environ, "PYTHONPATH": path, "PARADIT_TEST_OOM_TOKENS": str(OOM_TOKENS), "TMPDIR": str(tmp_path)}


def test_expandable_segments_unless_the_user_configured_the_allocator(monkeypatch):
    calls = []
    monkeypatch.setattr(torch._C, "_accelerator_setAllocatorSettings", calls.append, raising=False)
    for name in ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_HIP_ALLOC_CONF"):
        monkeypatch.delenv(name, raising=False)
    configure_allocator(torch.device("cpu"))
    assert calls == []
    configure_allocator(torch.device("cuda", 0))
    assert calls == [EXPANDABLE_SEGMENTS]
    for name in ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_HIP_ALLOC_CONF"):
        monkeypatch.setenv(name, "max_split_size_mb:128")
        configure_allocator(torch.device("cuda", 0))
        monkeypatch.delenv(name)
    assert calls == [EXPANDABLE_SEGMENTS]


@pytest.fixture
def two_gpus(monkeypatch):
    """settle's view of a machine with two GPUs, whose free memory the test sets (``free[index]``)."""
    free: dict[int, int] = {}
    monkeypatch.setattr(Machine, "detect", classmethod(lambda cls: Machine(2)))
    monkeypatch.setattr("paradit.machine.free_memory", free.__getitem__)
    return free


def test_an_uncapped_gpu_run_is_planned_for_the_memory_its_gpus_have_free(two_gpus):
    """Without a cap the plan used to be made for nothing, so a run that needed its encoders offloaded loaded them on
    the GPU and ran out of memory there. Now the least free GPU of the group is the cap a plan is made for, the
    encoders placed as under ``--max-gpu-memory`` of that much, and no cap is held."""
    spec = settle(Asked("flux2-tiny", device="cpu")).spec
    plans = estimates(spec, ParallelConfig(ulysses=2), torch.float32, False, compiled=True)
    resident, offloaded = plans["gpu"].total, plans["offload"].total
    assert offloaded < resident
    asked = Asked("flux2-tiny", device="cuda", dtype="fp32", parallel=ParallelConfig(ulysses=2))
    two_gpus.update({0: resident, 1: resident})
    roomy = settle(asked)
    assert roomy.text_encoder_placement == "gpu" and roomy.memory_cap is None
    assert roomy.memory_plan.total == resident and roomy.memory_limit.endswith("free on GPU 0")
    two_gpus[1] = resident - 1  # the group's other GPU has less: it is the one that must fit
    squeezed = settle(asked)
    assert squeezed.text_encoder_placement == "offload" and squeezed.memory_cap is None
    assert squeezed.memory_limit.endswith("free on GPU 1")
    assert squeezed.memory_budget.estimate == squeezed.memory_plan.total == offloaded
    two_gpus[1] = offloaded - 1
    with pytest.raises(InvalidRequest, match=r"does not fit under the .* GiB free on GPU 1: .*, or free memory on it"):
        settle(asked)
    two_gpus[1] = 0  # a cap given is the limit, whatever the GPUs have free
    capped = settle(dataclasses.replace(asked, max_gpu_memory=resident))
    assert capped.memory_cap == resident and capped.memory_limit == f"--max-gpu-memory {resident / 2**30:.3g} GiB"


def test_closing_an_engine_releases_every_tensor_it_held():
    """``close()`` used to stop workers only: an engine running in this process kept its pipeline (13 GiB of
    FLUX.2-klein-4B on a GPU) until its last reference went. Every module and tensor of it is now freed."""
    engine = Engine("flux2-tiny", device="cpu")
    engine.generate(GenerationRequest(prompt="a fox", steps=1, height=32, width=32))
    pipeline = engine.pipeline
    held = [pipeline, pipeline.vae, *pipeline.prompt_encoder.modules(), *pipeline.runtime.model.modules()]
    held += list(pipeline.runtime.model.parameters())
    refs = [weakref.ref(each) for each in held]
    del pipeline, held
    engine.close()
    gc.collect()
    assert [ref for ref in refs if ref() is not None] == []
    with pytest.raises(WorkerFailure, match="this engine was closed; create a new Engine"):
        engine.generate(GenerationRequest(prompt="a fox", steps=1, height=32, width=32))


def session_processes(session: int, timeout: float = GONE_S) -> list[int]:
    """The processes of process session ``session`` still running after up to ``timeout`` seconds (a resource
    tracker ends a moment after the process it served)."""
    deadline = time.monotonic() + timeout
    while (found := _session_members(session)) and time.monotonic() < deadline:
        time.sleep(0.1)
    return found


def _session_members(session: int) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except (FileNotFoundError, NotADirectoryError, ProcessLookupError):
            continue
        if int(fields[3]) == session and fields[0] not in "ZX":
            found.append(int(entry.name))
    return found


@pytest.mark.parametrize("plan", [[], ["--gpus", "2"]], ids=["1 process", "2 workers"])
def test_running_out_of_device_memory_is_one_line_naming_the_stage_and_the_figures(plan, tmp_path):
    """It was "internal error: OutOfMemoryError ..." and a trace file. Now: where the run was, what was asked for,
    the plan's estimate and the limit it was made for, and what would need less; exit 1, no image, no process or
    folder left behind."""
    out = tmp_path / "x.png"
    argv = [
        sys.executable,
        "-m",
        "paradit",
        "generate",
        "--model",
        "flux2-tiny",
        "--device",
        "cpu",
        "--prompt",
        "a fox",
        "--steps",
        "2",
        "--height",
        str(OOM_SIZE),
        "--width",
        str(OOM_SIZE),
        "--max-gpu-memory",
        "1GiB",
        "--no-progress",
        "--out",
        str(out),
        *plan,
    ]
    run = subprocess.Popen(
        argv,
        cwd=REPO_ROOT,
        env=oom_environment(tmp_path),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    _, err = run.communicate(timeout=240)
    lines = err.strip().splitlines()
    assert run.returncode == 1, err
    assert len(lines) == 1 and lines[0].startswith("paradit: error: out of memory on cpu at denoise step 1 of 2: "), err
    for fragment in (
        "2.00 GiB more was asked for",
        "against the plan's ",
        "GiB for --max-gpu-memory 1.0 GiB",
        "; to need less: ",
        "--text-encoder-placement offload",
        "or a smaller size",
    ):
        assert fragment in lines[0], err
    assert "trace" not in err and not out.exists()
    assert session_processes(run.pid) == [] and not leftovers(tmp_path)
