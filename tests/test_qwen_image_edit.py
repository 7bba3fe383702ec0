"""Qwen-Image-Edit and Edit-Plus against diffusers, on tiny ``save_pretrained`` folders (fp32, CPU): the image each
pipeline makes from the same input images, prompt and seed, to one 8-bit level (Edit with one image, and inpainting
with it; Edit-Plus with two, its transformer modulating the input images' tokens as at timestep 0, as
Qwen-Image-Edit-2511's does); every
parallel plan at worlds 2-4 gives Edit-Plus's one-process image; what an edit checkpoint cannot take is refused.

The input images are sized at smaller areas than diffusers' 1024x1024 (and Edit-Plus's 384x384 for its encoder),
on both sides, so that the tests run in seconds: the areas are the only thing changed."""

from __future__ import annotations

import dataclasses
import functools

import numpy as np
import pytest
import torch
from diffusers import QwenImageEditInpaintPipeline, QwenImageEditPipeline, QwenImageEditPlusPipeline
from diffusers.pipelines.qwenimage import (
    pipeline_qwenimage_edit,
    pipeline_qwenimage_edit_inpaint,
    pipeline_qwenimage_edit_plus,
)

from paradit.errors import InvalidRequest
from paradit.families import FAMILIES, spec_from_folder
from paradit.loader import load_pipeline
from paradit.parallel import ParallelConfig
from paradit.parallel.mesh import ParallelContext
from paradit.request import GenerationRequest
from tests.checkpoint_cache import cached
from tests.checkpoints import relative_l2
from tests.distributed import run_on_processes
from tests.qwen_image_checkpoints import build_qwen_image_edit_checkpoint, edit_processor
from tests.test_editing import mask_picture, picture

PROMPT, STEPS, SEED, GUIDANCE = "the cat of picture 1 on the sofa of picture 2", 2, 7, 4.0
INPUT_AREA, CONDITION_AREA = 96 * 96, 48 * 48
IMAGES = {"edit": [(60, 40)], "plus": [(60, 40), (40, 52)]}
SIZE = {"height": 32, "width": 48}


def images(variant: str) -> list:
    return [picture(w, h, seed) for seed, (w, h) in enumerate(IMAGES[variant], start=4)]


def small_spec(variant: str):
    """The checkpoint's spec with the input images' areas shrunk as the diffusers side is patched to."""
    spec = spec_from_folder(cached(build_qwen_image_edit_checkpoint, variant == "plus"))
    condition = CONDITION_AREA if variant == "plus" else None
    return dataclasses.replace(
        spec, details=dataclasses.replace(spec.details, input_area=INPUT_AREA, condition_area=condition)
    )


def request(variant: str, **fields) -> GenerationRequest:
    return GenerationRequest(
        prompt=PROMPT,
        negative_prompt=" ",
        guidance=GUIDANCE,
        steps=STEPS,
        seed=SEED,
        image=images(variant),
        **{**SIZE, **fields},
    )


def _pixels(variant: str, plan: ParallelConfig | None) -> torch.Tensor | None:
    device = torch.device("cpu")
    spec = small_spec(variant)
    context = None if plan is None else ParallelContext.build(plan, device)
    pipeline = load_pipeline(spec, device, torch.float32, context)
    results = pipeline.generate([FAMILIES["qwen_image"].resolve_request(spec, request(variant))])
    return None if results is None else results[0].pixels


@functools.cache
def one_process(variant: str) -> torch.Tensor:
    return _pixels(variant, None)


@pytest.mark.parametrize("variant", ["edit", "plus"])
def test_edits_give_diffusers_image(variant, monkeypatch):
    if variant == "plus":
        monkeypatch.setattr(pipeline_qwenimage_edit_plus, "VAE_IMAGE_SIZE", INPUT_AREA)
        monkeypatch.setattr(pipeline_qwenimage_edit_plus, "CONDITION_IMAGE_SIZE", CONDITION_AREA)
    else:
        sized = pipeline_qwenimage_edit.calculate_dimensions
        monkeypatch.setattr(pipeline_qwenimage_edit, "calculate_dimensions", lambda _, ratio: sized(INPUT_AREA, ratio))
    folder = cached(build_qwen_image_edit_checkpoint, variant == "plus")
    pipeline_class = QwenImageEditPlusPipeline if variant == "plus" else QwenImageEditPipeline
    pipeline = pipeline_class.from_pretrained(folder, processor=edit_processor(folder), dtype=torch.float32)
    inputs = images(variant)
    expected = (
        pipeline(
            image=inputs if variant == "plus" else inputs[0],
            prompt=PROMPT,
            negative_prompt=" ",
            true_cfg_scale=GUIDANCE,
            num_inference_steps=STEPS,
            output_type="np",
            generator=torch.Generator("cpu").manual_seed(SEED),
            **SIZE,
        ).images[0]
        * 255
    )
    ours = one_process(variant)[0].permute(1, 2, 0).numpy() * 255
    assert ours.shape == expected.shape == (32, 48, 3)
    assert np.abs(ours.round() - expected.round()).max() <= 1


def test_edit_inpainting_gives_diffusers_image(monkeypatch):
    """Qwen-Image-Edit with a mask: its image, sampled from the VAE, is both where the denoise starts (strength 0.6)
    and the transformer's input; outside the mask the image is kept. The output takes the image's edit size."""
    sized = pipeline_qwenimage_edit_inpaint.calculate_dimensions
    monkeypatch.setattr(
        pipeline_qwenimage_edit_inpaint, "calculate_dimensions", lambda _, ratio: sized(INPUT_AREA, ratio)
    )
    folder = cached(build_qwen_image_edit_checkpoint, False)
    pipeline = QwenImageEditInpaintPipeline.from_pretrained(
        folder, processor=edit_processor(folder), dtype=torch.float32
    )
    [image], mask = images("edit"), mask_picture(*IMAGES["edit"][0])
    expected = (
        pipeline(
            image=image,
            mask_image=mask,
            prompt=PROMPT,
            negative_prompt=" ",
            true_cfg_scale=GUIDANCE,
            num_inference_steps=STEPS,
            strength=0.6,
            output_type="np",
            generator=torch.Generator("cpu").manual_seed(SEED),
        ).images[0]
        * 255
    )
    spec = small_spec("edit")
    resolved = FAMILIES["qwen_image"].resolve_request(spec, request("edit", mask=mask, height=None, width=None))
    assert resolved.strength == 0.6  # the pipeline's default
    ours = load_pipeline(spec, torch.device("cpu"), torch.float32).generate([resolved])[0].pixels
    ours = ours[0].permute(1, 2, 0).numpy() * 255
    assert ours.shape == expected.shape == (64, 128, 3)
    assert np.abs(ours.round() - expected.round()).max() <= 1


PLANS = [
    ParallelConfig(ulysses=2),
    ParallelConfig(ring=3),
    ParallelConfig(cfg=2, ulysses=2),
    ParallelConfig(tensor=2),
    ParallelConfig(ring=2, tensor=2),
    ParallelConfig(pipefusion=2, warmup_steps=STEPS),
]


@pytest.mark.parametrize("plan", PLANS, ids=lambda plan: plan.describe())
def test_every_plan_with_input_images_equals_one_process(plan):
    """The input images' tokens join the split image stream, with their timestep-0 modulation rows."""
    ours = run_on_processes(plan.world_size, _pixels, "plus", plan)
    assert relative_l2(ours, one_process("plus")) <= 1e-5


def test_what_an_edit_checkpoint_cannot_take_is_refused_naming_it():
    edit, plus = small_spec("edit"), small_spec("plus")
    resolve = FAMILIES["qwen_image"].resolve_request
    with pytest.raises(InvalidRequest, match="edits: give the image to edit"):
        resolve(edit, GenerationRequest(prompt="a"))
    with pytest.raises(InvalidRequest, match="takes at most 1 input image; 2 given"):
        resolve(edit, request("plus"))
    with pytest.raises(InvalidRequest, match="does no inpainting"):
        resolve(plus, request("plus", mask=mask_picture(60, 40)))
    with pytest.raises(InvalidRequest, match="takes no strength"):
        resolve(plus, request("plus", strength=0.5))
    # Without a size, Edit-Plus makes its last image's input size (40x52 at 96x96 pixels: 96x96); the 60x40 image's
    # tokens (128x64 pixels) and the other's join the sequence.
    resolved = resolve(plus, request("plus", height=None, width=None))
    assert (resolved.width, resolved.height) == (96, 96) and resolved.reference_tokens == 8 * 4 + 6 * 6
