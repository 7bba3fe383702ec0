"""PipeFusion's patch-by-patch denoise loop gives the plain loop's latents (the same numbers, no pipeline drain per
step), for every family's latent layout, with stages of any count, Ulysses inside the stages and CFG beside them."""

from __future__ import annotations

import pytest
import torch

import paradit.parallel.parallelize as parallelize
from paradit.families.sd3.model import unpatchify as sd3_unpatchify
from paradit.families.zimage.model import unpatchify as zimage_unpatchify
from paradit.loader import load_pipeline
from paradit.parallel import ParallelConfig
from paradit.parallel.mesh import ParallelContext
from paradit.pipelines.base import patch_grid_band_mask, token_band_mask
from paradit.request import GenerationRequest
from paradit.settings import resolve_model
from tests.distributed import run_on_processes

REQUEST = GenerationRequest(prompt=["a red fox", "a blue bird"], height=48, width=80, steps=4, seed=3)


def _plain_loop(predict, scheduler, latents, timesteps, pipefusion, band_mask, mark_step, progress):
    """The plain loop, each call of the PipeFusion model one whole step (its drain included)."""
    mark_step()
    for t in timesteps:
        latents = scheduler.step(predict(latents, t, pipefusion), t, latents, return_dict=False)[0]
        mark_step()
    return latents


def _both_loops(model: str, plan: ParallelConfig) -> tuple[torch.Tensor, torch.Tensor] | None:
    device = torch.device("cpu")
    context = ParallelContext.build(plan, device)
    spec = resolve_model(model, "dummy")
    pipeline = load_pipeline(spec, device, torch.float32, context)
    request = [pipeline.family.resolve_request(spec, REQUEST)]
    by_patches = pipeline.generate(request)
    patched_loop, parallelize.denoise_by_patches = parallelize.denoise_by_patches, _plain_loop
    try:
        plain = pipeline.generate(request)
    finally:
        parallelize.denoise_by_patches = patched_loop
    if by_patches is None:
        return None
    return by_patches[0].pixels, plain[0].pixels


@pytest.mark.parametrize(
    "model,world,plan",
    [
        ("flux2-tiny", 2, ParallelConfig(pipefusion=2, patches=3, warmup_steps=1)),
        ("flux2-tiny", 4, ParallelConfig(pipefusion=4, patches=4, warmup_steps=2)),
        # fewer patches than stages: the loop still holds patches - 1 in flight, and still gives the same numbers
        ("flux2-tiny", 4, ParallelConfig(pipefusion=4, patches=2, warmup_steps=1)),
        ("qwen-image-tiny", 4, ParallelConfig(pipefusion=2, ulysses=2, patches=2, warmup_steps=1)),
        ("sd3.5-tiny", 4, ParallelConfig(cfg=2, pipefusion=2, patches=3, warmup_steps=1)),
        ("z-image-tiny", 2, ParallelConfig(pipefusion=2, patches=4, warmup_steps=1)),
    ],
    ids=lambda value: value.describe() if isinstance(value, ParallelConfig) else str(value),
)
def test_patch_by_patch_loop_gives_the_plain_loops_image(model, world, plan):
    by_patches, plain = run_on_processes(world, _both_loops, model, plan)
    assert (by_patches - plain).abs().max().item() <= 1e-6
    assert by_patches.std().item() > 0.01  # a real image, not a constant both loops agree on


@pytest.mark.parametrize("unpatchify,patch", [(sd3_unpatchify, 2), (zimage_unpatchify, 2)], ids=["sd3", "zimage"])
def test_patch_grid_band_mask_marks_the_latents_a_band_of_tokens_becomes(unpatchify, patch):
    """The mask must agree with the family's own unpatchify: tokens of the band set to 1 land exactly where the
    mask is true."""
    channels, rows, cols = 4, 3, 5
    latents = torch.zeros(1, channels, rows * patch, cols * patch)
    length = 32  # Z-Image pads its stream to 32 rows; rows past the grid cover no latent
    start, stop = 4, 11
    tokens = torch.zeros(1, length, patch * patch * channels)
    tokens[:, start:stop] = 1
    if unpatchify is sd3_unpatchify:
        expected = sd3_unpatchify(tokens[:, : rows * cols], patch, rows * patch, cols * patch)
    else:
        expected = zimage_unpatchify(tokens, rows, cols, patch)
    mask = patch_grid_band_mask(latents, patch, start, stop)
    assert torch.equal(mask.expand_as(latents), expected.bool())


def test_token_band_mask_marks_its_rows():
    latents = torch.zeros(2, 10, 3)
    mask = token_band_mask(latents, 2, 5).expand_as(latents)
    assert mask[:, 2:5].all() and mask.sum().item() == 2 * 3 * 3
