"""PipeFusion on gloo: with every step a warm-up step it equals the one-process FLUX.2 transformer over a short
denoise-like run; patched steps are exact when the stale K/V happen to be fresh, and measured otherwise."""

from __future__ import annotations

import copy

import pytest
import torch

from paradit import Engine, GenerationRequest, InvalidRequest
from paradit.models.flux2 import Flux2Config, Flux2Transformer
from paradit.optimize import ExecutionOptions
from paradit.parallel import ParallelConfig
from paradit.parallel.mesh import ParallelContext
from paradit.parallel.pipefusion import parallelize_pipefusion
from tests.checkpoints import randomize, tiny_transformer_config
from tests.distributed import run_on_processes

ROWS, COLS, TEXT = 5, 3, 7  # 15 image tokens: 4 patches of (4, 4, 4, 3)
STEPS = 4


def _model_and_inputs():
    torch.manual_seed(0)
    config = tiny_transformer_config(guidance_embeds=True, heads=2)
    # 2 double + 3 single blocks: 2 stages are (d0 d1 s0 | s1 s2), a stage mixing both kinds; 4 are (d0 d1 | s0 | ...).
    config["num_single_layers"] = 3
    model = Flux2Transformer(Flux2Config.from_dict(config))
    randomize(model)
    gen = torch.Generator().manual_seed(1)
    one = torch.arange(1)
    batch = 2
    inputs = dict(
        hidden_states=torch.randn(batch, ROWS * COLS, model.config.in_channels, generator=gen),
        encoder_hidden_states=torch.randn(batch, TEXT, model.config.joint_attention_dim, generator=gen),
        img_ids=torch.cartesian_prod(one, torch.arange(ROWS), torch.arange(COLS), one),
        txt_ids=torch.cartesian_prod(one, one, one, torch.arange(TEXT)),
        guidance=torch.full((batch,), 3.0),
    )
    return model.eval(), inputs


def _denoise(model, inputs: dict, sigmas: list[float]) -> list[torch.Tensor]:
    """An Euler flow-matching loop as the pipeline runs it; the prediction of every step."""
    latents = inputs["hidden_states"]
    predictions = []
    for sigma, sigma_next in zip(sigmas, sigmas[1:]):
        timestep = torch.full((latents.shape[0],), sigma)
        prediction = model(**{**inputs, "hidden_states": latents, "timestep": timestep})
        predictions.append(prediction)
        latents = latents + (sigma_next - sigma) * prediction
    return predictions


def _relative_errors(plans: list[ParallelConfig], sigmas: list[float]) -> dict:
    """Per plan: each step's prediction's relative L2 against serial, and the bytes this rank sent."""
    model, inputs = _model_and_inputs()
    results = {}
    with torch.no_grad():
        serial = _denoise(model, inputs, sigmas)
        for plan in plans:
            context = ParallelContext.build(plan, torch.device("cpu"))
            pipelined = parallelize_pipefusion(copy.deepcopy(model), context)
            for _ in range(2):  # a second request must start afresh with its warm-up steps
                pipelined.begin_request()
                outputs = _denoise(pipelined, inputs, sigmas)
            errors = [((out - ref).norm() / ref.norm()).item() for out, ref in zip(outputs, serial)]
            results[plan.describe()] = errors
            results[plan.describe() + " bytes"] = sum(context.stats.bytes_sent.values())
    return results


SIGMAS = [1 - i / STEPS for i in range(STEPS + 1)]


@pytest.mark.parametrize("world", [2, 4])
def test_warmup_only_equals_serial(world):
    plans = [
        ParallelConfig(pipefusion=world, warmup_steps=STEPS),
        ParallelConfig(pipefusion=world, patches=4, warmup_steps=STEPS),
    ]
    results = run_on_processes(world, _relative_errors, plans, SIGMAS)
    for plan in plans:
        assert max(results[plan.describe()]) <= 1e-5, results
        assert results[plan.describe() + " bytes"] > 0, results  # the last stage broadcast the prediction


def test_patched_step_with_unchanged_inputs_is_exact():
    """Steps with the same latents and timestep leave the stale K/V equal to fresh ones, so the patched steps must
    reproduce serial exactly: this checks each patch's rows, rotary tables and the text riding with patch 0."""
    plan = ParallelConfig(pipefusion=2, patches=4, warmup_steps=1)
    sigmas = [0.7, 0.7, 0.7]
    errors = run_on_processes(2, _relative_errors, [plan], sigmas)[plan.describe()]
    assert max(errors) <= 1e-5, errors


@pytest.mark.parametrize(
    "sigmas,bound",
    [
        # A tiny random model is very sensitive to the timestep (t * 1000 feeds sinusoids; nothing was trained to be
        # smooth in it), so 0.25 apart the K/V of neighbouring steps are far apart: measured 0.33-0.41 relative L2.
        (SIGMAS, 0.6),
        # Steps 1e-4 apart: the stale K/V are nearly fresh and the deviation shrinks with them (measured 8e-3).
        ([0.5, 0.4999, 0.4998, 0.4997], 2e-2),
    ],
    ids=["coarse", "fine"],
)
def test_patched_steps_deviate_boundedly_from_serial(sigmas, bound):
    plan = ParallelConfig(pipefusion=2, patches=4, warmup_steps=1)
    errors = run_on_processes(2, _relative_errors, [plan], sigmas)[plan.describe()]
    assert errors[0] <= 1e-5, errors  # the warm-up step is exact
    assert 1e-5 < max(errors[1:]) <= bound, errors  # stale K/V: a real deviation, but bounded


ENGINE_REQUEST = GenerationRequest(prompt=["a red fox", "a blue bird"], height=48, width=80, steps=3, seed=11)


@pytest.fixture(scope="module")
def serial_pixels() -> torch.Tensor:
    return Engine("flux2-tiny", device="cpu", dtype="fp32").generate(ENGINE_REQUEST).pixels


@pytest.mark.parametrize(
    "plan",
    [
        ParallelConfig(pipefusion=2, patches=2, warmup_steps=ENGINE_REQUEST.steps),
        ParallelConfig(cfg=2, pipefusion=2, patches=2, warmup_steps=ENGINE_REQUEST.steps),
    ],
    ids=lambda plan: plan.describe(),
)
def test_engine_with_warmup_only_gives_the_serial_image(plan, serial_pixels):
    with Engine("flux2-tiny", device="cpu", dtype="fp32", parallel=plan) as engine:
        result = engine.generate(ENGINE_REQUEST)
        again = engine.generate(ENGINE_REQUEST)  # the step count restarts with each request
    assert result.timings.comm_bytes_per_step > 0
    assert (result.pixels - serial_pixels).abs().max().item() <= 1e-4
    assert torch.equal(again.pixels, result.pixels)


def test_cuda_graphs_are_refused_with_pipefusion():
    options = ExecutionOptions(cuda_graphs=True)
    with pytest.raises(InvalidRequest, match="CUDA graphs do not combine with pipefusion yet"):
        Engine("flux2-tiny", device="cpu", parallel=ParallelConfig(pipefusion=2), options=options)
