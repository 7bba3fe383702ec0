"""Tensor parallelism equals one process: every planned family's transformer sharded at T = 2 and 4 (and T x Ulysses,
T x Ring) on gloo (Wan's Q/K norms over all heads included), whole requests through the Engine (T, CFG x T) and the
CLI, and the refusals of what cannot be sharded."""

from __future__ import annotations

import dataclasses
import re
import time

import numpy as np
import pytest
import torch
from PIL import Image
from torch import nn

from paradit import Engine, GenerationRequest, InvalidRequest
from paradit.cli import main
from paradit.families import FAMILIES as REGISTRY
from paradit.families.flux2.model import Flux2Config, Flux2Transformer
from paradit.families.qwen_image.model import QwenImageConfig, QwenImageTransformer
from paradit.families.sd3.model import SD3Config, SD3Transformer
from paradit.families.wan.model import WanConfig, WanTransformer
from paradit.families.zimage.model import ZImageConfig, ZImageTransformer
from paradit.parallel import ParallelConfig
from paradit.parallel.mesh import ParallelContext
from paradit.parallel.parallelize import parallelize
from paradit.parallel.tensor import check_tensor_plan
from tests import qwen_image_checkpoints, sd3_checkpoints, zimage_checkpoints
from tests.checkpoints import randomize, tiny_transformer_config
from tests.distributed import run_on_processes
from tests.test_flux2_reference import transformer_inputs as flux2_inputs
from tests.test_qwen_image import transformer_inputs as qwen_inputs
from tests.test_sd3 import transformer_inputs as sd3_inputs
from tests.test_wan_model import TEXT_DIM, first_frame_timesteps, tiny_config
from tests.test_zimage import caption_batch
from tests.test_zimage import transformer_inputs as zimage_inputs

HEADS = 4  # divisible by T = 2 and 4; the MLP widths below are too
ROWS, COLS, TEXT = 5, 3, 7  # 15 image + 7 text tokens: uneven sequence splits when composed with Ulysses / Ring


def _flux2(guidance: bool):
    torch.manual_seed(0)
    config = tiny_transformer_config(guidance_embeds=guidance, heads=HEADS)
    model = Flux2Transformer(Flux2Config.from_dict(config))
    randomize(model)
    cases = {}
    for batch in (1, 2):
        inputs = flux2_inputs(config, batch, ROWS, COLS, TEXT, seed=batch)
        cases[f"batch {batch}"] = dict(inputs, guidance=torch.full((batch,), 3.0) if guidance else None)
    return model, cases


def _qwen_image():
    torch.manual_seed(0)
    model = QwenImageTransformer(QwenImageConfig.from_dict(qwen_image_checkpoints.tiny_transformer_config(HEADS)))
    randomize(model)
    config = dataclasses.asdict(model.config)
    cases = {}
    for name, batch, text_lengths in (("batch 1", 1, None), ("batch 2 masked", 2, [7, 3])):
        cases[name] = dict(qwen_inputs(config, batch, ROWS, COLS, text_lengths, seed=batch), rows=ROWS, cols=COLS)
    return model, cases


def _sd3():
    # The first block has SD3.5-medium's image-only attention, the last is context-pre-only (no to_add_out).
    config = sd3_checkpoints.tiny_transformer_config(heads=HEADS, head_dim=8, dual_attention_layers=(0,))
    torch.manual_seed(0)
    model = SD3Transformer(SD3Config.from_dict(config))
    randomize(model, std=0.1)
    cases = {f"batch {batch}": sd3_inputs(config, batch, 10, 6, TEXT, seed=batch) for batch in (1, 2)}
    return model, cases


def _zimage():
    # dim 96: MLP hidden width int(96 / 3 * 8) = 256, divisible by 4.
    config = zimage_checkpoints.tiny_transformer_config(heads=HEADS, head_dim=24, axes_dims=(8, 8, 8))
    torch.manual_seed(0)
    model = ZImageTransformer(ZImageConfig.from_dict(config))
    randomize(model)
    cases = {}
    for lengths in ([7], [40, 9]):  # the second batch's shorter caption is masked
        latents, timestep, captions = zimage_inputs(config, ROWS, COLS, lengths, seed=len(lengths))
        cases[f"captions {lengths}"] = (latents, timestep, *caption_batch(captions))
    return model, cases


def _wan():
    # ffn_dim 40 and 4 heads of 12: both divide by T = 2 and 4. One timestep per sample, and TI2V's one per token.
    torch.manual_seed(0)
    config = WanConfig.from_dict(tiny_config(16, 16, heads=HEADS, head_dim=12))
    model = WanTransformer(config)
    randomize(model, std=0.1)
    gen = torch.Generator().manual_seed(1)
    latents = torch.randn(2, 16, 3, 6, 10, generator=gen)
    text = torch.randn(2, TEXT, TEXT_DIM, generator=gen)
    timesteps = torch.tensor([937.0, 281.5])
    per_token = first_frame_timesteps(config.token_grid(3, 6, 10), timesteps)
    return model, {"batch 2": (latents, timesteps, text), "batch 2 per token": (latents, per_token, text)}


FAMILIES = {
    "FLUX.2": lambda: _flux2(guidance=False),
    "FLUX.2 guidance": lambda: _flux2(guidance=True),
    "Qwen-Image": _qwen_image,
    "SD3.5": _sd3,
    "Z-Image": _zimage,
    "Wan": _wan,
}


# Each case's family in the registry, whose tensor plan shards it.
REGISTERED = {
    "FLUX.2": "flux2",
    "FLUX.2 guidance": "flux2",
    "Qwen-Image": "qwen_image",
    "SD3.5": "sd3",
    "Z-Image": "zimage",
    "Wan": "wan",
}


def _call(model, inputs):
    return model(*inputs) if isinstance(inputs, tuple) else model(**inputs)


def _compare_plans(plans: list[ParallelConfig]) -> dict[str, float]:
    """Relative L2 of every family's sharded output against its one-process output, and the bytes each plan sent."""
    results = {}
    with torch.no_grad():
        for family, build in FAMILIES.items():
            model, cases = build()
            serial = {name: _call(model.eval(), inputs) for name, inputs in cases.items()}
            for plan in plans:
                model, _ = build()  # a fresh copy: sharding acts on the model in place
                context = ParallelContext.build(plan, torch.device("cpu"))
                sharded = parallelize(model.eval(), REGISTRY[REGISTERED[family]].tensor_plan, context).forward
                for name, inputs in cases.items():
                    out = _call(sharded, inputs)
                    error = ((out - serial[name]).norm() / serial[name].norm()).item()
                    results[f"{family} {plan.describe()} {name}"] = error
                results[f"{family} {plan.describe()} bytes"] = sum(context.stats.bytes_sent.values())
    return results


# One spawn of 4 processes (each spawn costs seconds). Under "cfg 2 x tensor 2" the transformer is sharded at T = 2 in
# each CFG half (both halves compute the whole batch here): plain T = 2, in a group of 4.
PLANS = [
    ParallelConfig(cfg=2, tensor=2),
    ParallelConfig(tensor=4),
    ParallelConfig(ulysses=2, tensor=2),
    ParallelConfig(ring=2, tensor=2),
]


def test_sharded_transformers_equal_serial():
    results = run_on_processes(4, _compare_plans, PLANS)
    for family in FAMILIES:
        for plan in PLANS:
            errors = {k: v for k, v in results.items() if k.startswith(f"{family} {plan.describe()} batch")}
            errors |= {k: v for k, v in results.items() if k.startswith(f"{family} {plan.describe()} captions")}
            assert len(errors) == 2, results
            assert max(errors.values()) <= 1e-5, errors
            assert results[f"{family} {plan.describe()} bytes"] > 0  # the row-parallel sums really communicated


def test_what_cannot_be_sharded_is_refused():
    with pytest.raises(InvalidRequest, match="no plan for Linear"):
        check_tensor_plan(None, nn.Linear(4, 4), 2)
    # Z-Image at dim 64: 4 heads, but an MLP hidden width of int(64 / 3 * 8) = 170, which 4 does not divide.
    zimage = ZImageTransformer(ZImageConfig.from_dict(zimage_checkpoints.tiny_transformer_config(heads=4)))
    with pytest.raises(InvalidRequest, match="tensor degree 4 does not divide Z-Image's MLP hidden width 170"):
        check_tensor_plan(REGISTRY["zimage"].tensor_plan, zimage, 4)
    assert check_tensor_plan(REGISTRY["zimage"].tensor_plan, zimage, 2).family == "Z-Image"
    flux2 = Flux2Transformer(Flux2Config.from_dict(tiny_transformer_config(guidance_embeds=False, heads=3)))
    with pytest.raises(InvalidRequest, match="tensor degree 2 does not divide FLUX.2's 3 attention heads"):
        check_tensor_plan(REGISTRY["flux2"].tensor_plan, flux2, 2)


REQUEST = GenerationRequest(prompt=["a red fox", "a blue bird"], height=48, width=80, steps=2, seed=11, guidance=3.0)


def test_engine_cfg_and_tensor_parallel_give_the_serial_image():
    serial_pixels = Engine("flux2-tiny", device="cpu", dtype="fp32").generate(REQUEST).pixels
    plan = ParallelConfig(cfg=2, tensor=2)
    with Engine("flux2-tiny", device="cpu", dtype="fp32", parallel=plan) as engine:
        result = engine.generate(REQUEST)
    assert result.timings.plan == plan.describe() and result.timings.comm_bytes_per_step > 0
    assert result.pixels.shape == serial_pixels.shape
    assert (result.pixels - serial_pixels).abs().max().item() <= 1e-4


def test_cli_tensor_parallel_gives_the_serial_image(tmp_path, capsys):
    """Also the Engine-level check of plain T = 2: ``--verify-serial`` runs the request through a 1-process Engine
    and prints the largest pixel difference."""
    args = ["generate", "--device", "cpu", "--dtype", "fp32", "--prompt", "a castle", "--steps", "2", "--seed", "5"]
    args += ["--height", "48", "--width", "64", "--no-progress", "--out", str(tmp_path / "two.png")]
    assert main([*args, "--gpus", "2", "--tensor", "2", "--verify-serial"]) == 0
    out = capsys.readouterr().out
    assert "tensor 2 image equals the 1-process image" in out and "sent per step" in out
    assert float(re.search(r"max diff (\S+) on \[0, 1\]", out).group(1)) <= 1e-4
    assert np.asarray(Image.open(tmp_path / "two.png")).shape == (48, 64, 3)


def test_a_tensor_degree_that_splits_the_heads_but_not_the_mlp_is_refused_before_any_worker_starts():
    start = time.monotonic()
    with pytest.raises(InvalidRequest, match="tensor degree 3 does not divide Z-Image's MLP hidden width 256"):
        Engine("z-image-tiny", device="cpu", parallel=ParallelConfig(tensor=3))
    assert time.monotonic() - start < 5
