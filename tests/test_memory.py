"""The per-GPU memory cap: sizes parse, the estimate counts the real modules, and a plan over the cap is refused
with its numbers before anything loads."""

from __future__ import annotations

import time

import pytest
import torch

from paradit import Engine, InvalidRequest
from paradit.cli import main
from paradit.memory import estimate, parse_size
from paradit.parallel import ParallelConfig
from paradit.presets import PRESETS


@pytest.mark.parametrize(
    "text,expected", [("32GiB", 32 * 2**30), ("30GB", 30 * 10**9), ("512 MiB", 512 * 2**20), ("1.5gib", 3 * 2**29)]
)
def test_sizes_parse(text, expected):
    assert parse_size(text) == expected


def test_bad_size_names_the_accepted_forms():
    with pytest.raises(InvalidRequest, match="'32 parsecs' is not understood; write e.g. 32GiB"):
        parse_size("32 parsecs")


def param_bytes(modules) -> int:
    return sum(p.numel() * p.element_size() for module in modules for p in module.parameters())


def test_estimate_counts_exactly_what_the_engine_loads():
    engine = Engine("flux2-tiny", device="cpu", dtype="fp32", max_gpu_memory="1GiB")
    plan = engine.memory_plan
    pipeline = engine.pipeline
    assert plan.transformer == param_bytes([pipeline.transformer])
    assert plan.text_encoders == param_bytes([pipeline.prompt_encoder.decoder])
    assert plan.vae == param_bytes([pipeline.vae])
    assert 0 < plan.activations < plan.total


def test_tensor_parallel_and_fp8_shrink_the_transformer_share():
    spec = PRESETS["flux2-dev"]
    whole = estimate(spec, ParallelConfig(), torch.bfloat16, fp8=False)
    assert 59 * 2**30 < whole.transformer < 61 * 2**30  # 32.2B parameters in bf16
    halves = estimate(spec, ParallelConfig(tensor=2), torch.bfloat16, fp8=False)
    fp8 = estimate(spec, ParallelConfig(), torch.bfloat16, fp8=True)
    assert 0.49 < halves.transformer / whole.transformer < 0.52
    assert 0.49 < fp8.transformer / whole.transformer < 0.52
    assert halves.text_encoders == whole.text_encoders  # rank 0 still holds the whole prompt encoder


def test_a_plan_over_the_cap_is_refused_before_loading(capsys):
    start = time.monotonic()
    args = ["generate", "--model", "flux2-dev", "--load-format", "dummy", "--device", "cpu", "--dtype", "bf16"]
    assert main([*args, "--prompt", "x", "--max-gpu-memory", "32GiB"]) == 2
    assert time.monotonic() - start < 10  # nothing was built: a 32B model would take far longer
    error = capsys.readouterr().err.strip()
    assert error.startswith("paradit: error: flux2-dev with 1 GPU does not fit under --max-gpu-memory 32.0 GiB")
    assert "transformer weights 60.0" in error and "text encoders 32.3" in error and len(error.splitlines()) == 1
