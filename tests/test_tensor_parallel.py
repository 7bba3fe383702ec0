"""Tensor parallelism equals one process: whole requests through the Engine (CFG x T) and the CLI (T = 2), and the
refusals of what cannot be sharded. Every family's transformer sharded at T = 2 and 4 (and T x Ulysses, T x Ring;
Wan's Q/K norms over all heads included) is test_parallel_matrix.py's."""

from __future__ import annotations

import re
import time

import numpy as np
import pytest
from PIL import Image
from torch import nn

from paradit import Engine, GenerationRequest, InvalidRequest
from paradit.cli import main
from paradit.families import FAMILIES as REGISTRY
from paradit.families.flux2.model import Flux2Config, Flux2Transformer
from paradit.families.zimage.model import ZImageConfig, ZImageTransformer
from paradit.parallel import ParallelConfig
from paradit.parallel.tensor_plan import check_tensor_plan
from tests import zimage_checkpoints
from tests.checkpoints import tiny_transformer_config


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
