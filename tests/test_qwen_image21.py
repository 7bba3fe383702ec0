"""Qwen-Image 2.1 against diffusers on tiny random weights (fp32, CPU): the transformer module, its prefix (text and
condition images) run once and its keys and values reused at every step, equal to diffusers' full block-causal
forward and to its cached mode; ``paradit generate``'s images equal to ``QwenImage21Pipeline``'s on a tiny
``save_pretrained`` folder, text-to-image and editing from 1 and 3 condition images.

The condition images are read at ``output_resolution`` 64 on both sides (diffusers' default is 1024), so that the
tests run in seconds: it is the only thing changed."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from diffusers import QwenImage21Pipeline

from paradit import Engine, GenerationRequest
from paradit.families import spec_from_folder
from paradit.families.qwen_image21.latents import TOKEN_PIXELS, area_size
from paradit.families.qwen_image21.model import QwenImage21Config, QwenImage21Transformer
from paradit.families.qwen_image21.pipeline import published_image_processor
from paradit.families.qwen_image21.presets import QwenImage21Inputs
from tests.checkpoint_cache import cached
from tests.checkpoints import relative_l2
from tests.qwen_image21_checkpoints import (
    TEXT_HIDDEN,
    build_qwen_image21_checkpoint,
    processor,
    tiny_transformer,
)
from tests.test_editing import picture

# [3 text | image 1 (4x6 tokens: 6 slots) | image 2 (4x4: 4 slots), adjacent | 4 text]: adjacent images stay apart.
SLOTS = [False] * 3 + [True] * 6 + [True] * 4 + [False] * 4
GRIDS = ((4, 6), (4, 4))
ROWS, COLS = 4, 6


@pytest.fixture(scope="module")
def modules():
    reference = tiny_transformer()
    ours = QwenImage21Transformer(QwenImage21Config.from_dict(dict(reference.config)))
    ours.load_state_dict(reference.state_dict(), strict=True)
    return reference, ours.eval()


def inputs(images: bool, padded: bool, seed: int = 0) -> dict:
    gen = torch.Generator().manual_seed(seed)
    slots = torch.tensor(SLOTS if images else [False] * 9)
    mask = torch.ones(2, slots.shape[0], dtype=torch.bool)
    if padded:
        mask[1, -2:] = False  # the second prompt is two tokens shorter
    grids = GRIDS if images else ()
    condition_tokens = sum(rows * cols for rows, cols in grids)
    return {
        "embeds": torch.randn(2, slots.shape[0], TEXT_HIDDEN, generator=gen),
        "slots": slots,
        "mask": mask if padded else None,
        "condition": torch.randn(1, condition_tokens, 64, generator=gen) if images else None,
        "grids": grids,
        "target": torch.randn(2, ROWS * COLS, 64, generator=gen),
        "timesteps": [torch.tensor([0.7, 0.7]), torch.tensor([0.35, 0.35])],
    }


def reference_forward(reference, given: dict, timestep, kv_cache=None, mode=None) -> torch.Tensor:
    batch = given["target"].shape[0]
    hidden = given["target"]
    if given["condition"] is not None:
        hidden = torch.cat([given["condition"].expand(batch, -1, -1), hidden], dim=1)
    target_slots = torch.ones(ROWS * COLS // 4, dtype=torch.bool)
    img_mask = torch.cat([given["slots"], target_slots])[None].expand(batch, -1)
    shapes = [[*((1, rows, cols) for rows, cols in given["grids"]), (1, ROWS, COLS)]] * batch
    out = reference(
        hidden_states=hidden,
        encoder_hidden_states=given["embeds"],
        timestep=timestep,
        img_shapes=shapes,
        img_mask=img_mask,
        encoder_hidden_states_mask=given["mask"],
        kv_cache=kv_cache,
        kv_cache_mode=mode,
        return_dict=False,
    )[0]
    return out[:, -ROWS * COLS :]


@pytest.mark.parametrize(("images", "padded"), [(False, False), (False, True), (True, False), (True, True)])
@torch.no_grad()
def test_transformer_equals_diffusers(modules, images, padded):
    """One prefix for the request, two steps from it: each equals diffusers' whole block-causal forward."""
    reference, ours = modules
    given = inputs(images, padded)
    prefix = ours.encode_prefix(given["embeds"], given["slots"], given["mask"], given["condition"], given["grids"])
    for timestep in given["timesteps"]:
        expected = reference_forward(reference, given, timestep)
        assert relative_l2(ours(given["target"], timestep, ROWS, COLS, prefix), expected) < 1e-5


@torch.no_grad()
def test_prefix_cache_equals_diffusers_cached_mode(modules):
    """diffusers' own cache (extract at the first step, cached after) gives the same steps as ours."""
    from diffusers.models.transformers.transformer_qwenimage21 import QwenImage21KVCache

    reference, ours = modules
    given = inputs(images=True, padded=True)
    prefix = ours.encode_prefix(given["embeds"], given["slots"], given["mask"], given["condition"], given["grids"])
    cache = QwenImage21KVCache(len(reference.transformer_blocks))
    for step, timestep in enumerate(given["timesteps"]):
        expected = reference_forward(reference, given, timestep, cache, "extract" if step == 0 else "cached")
        assert relative_l2(ours(given["target"], timestep, ROWS, COLS, prefix), expected) < 1e-5


OUTPUT_RESOLUTION, STEPS, SEED = 64, 2, 11
# (width, height) of each condition image: the last one's aspect makes the output's size when none is asked.
CONDITIONS = [(60, 40), (40, 52), (48, 48)]


@pytest.fixture(scope="module")
def checkpoint():
    return cached(build_qwen_image21_checkpoint)


@pytest.fixture(scope="module")
def reference(checkpoint):
    return QwenImage21Pipeline.from_pretrained(checkpoint, processor=processor(checkpoint), dtype=torch.float32)


@pytest.fixture(scope="module")
def engine(checkpoint):
    spec = spec_from_folder(checkpoint)
    small = dataclasses.replace(spec, details=dataclasses.replace(spec.details, output_resolution=OUTPUT_RESOLUTION))
    return Engine(small, device="cpu", dtype="fp32")


def diffusers_images(reference, prompt: str, images: list, **sizes) -> np.ndarray:
    return reference(
        prompt=prompt,
        image=images or None,
        num_inference_steps=STEPS,
        output_resolution=OUTPUT_RESOLUTION,
        output_type="np",
        generator=torch.Generator("cpu").manual_seed(SEED),
        **sizes,
    ).images


def ours(engine, prompt: str, images: list, **sizes) -> np.ndarray:
    request = GenerationRequest(prompt=prompt, image=images or None, steps=STEPS, seed=SEED, **sizes)
    return engine.generate(request).pixels.permute(0, 2, 3, 1).numpy()


@pytest.mark.parametrize("conditions", [0, 1, 3])
def test_images_equal_diffusers(reference, engine, conditions):
    """Text-to-image at a size asked; editing at the size the last condition image makes (RGBA, as the VAE's)."""
    images = [picture(w, h, seed) for seed, (w, h) in enumerate(CONDITIONS[:conditions], start=3)]
    sizes = {} if conditions else {"height": 64, "width": 96}
    prompt = "a red fox in the snow, picture 1's light" if conditions else "a red fox in the snow"
    expected = diffusers_images(reference, prompt, images, **sizes) * 255
    got = ours(engine, prompt, images, **sizes) * 255
    assert got.shape == expected.shape and got.shape[-1] == 4
    assert np.abs(got.round() - expected.round()).max() <= 1


def test_guided_edit_equals_diffusers(reference, engine):
    """A negative prompt of another length and a scale above 1: each branch's prefix padded on its own, as diffusers
    encodes them apart."""
    images = [picture(60, 40, 3)]
    expected = diffusers_images(
        reference, "a red fox in the snow", images, negative_prompt="blurry", true_cfg_scale=3.0
    )
    request = GenerationRequest(
        prompt="a red fox in the snow", negative_prompt="blurry", guidance=3.0, image=images, steps=STEPS, seed=SEED
    )
    got = engine.generate(request).pixels.permute(0, 2, 3, 1).numpy()
    assert got.shape == expected.shape
    assert np.abs((got * 255).round() - (expected * 255).round()).max() <= 1


TURBO_SIGMAS = (1.0, 0.9, 0.5)


def test_turbo_schedule_equals_diffusers():
    """A checkpoint's ``sample_sigmas`` (Turbo's model_index.json) set its default steps and its schedule."""
    folder = cached(build_qwen_image21_checkpoint, TURBO_SIGMAS)
    spec = spec_from_folder(folder)
    assert spec.steps == len(TURBO_SIGMAS) and spec.details.sample_sigmas == TURBO_SIGMAS
    reference = QwenImage21Pipeline.from_pretrained(folder, processor=processor(folder), dtype=torch.float32)
    expected = reference(
        prompt="a fox",
        height=64,
        width=64,
        output_type="np",
        generator=torch.Generator("cpu").manual_seed(SEED),
    ).images
    got = Engine(spec, device="cpu", dtype="fp32").generate(
        GenerationRequest(prompt="a fox", height=64, width=64, seed=SEED)
    )
    assert len(got.timings.step_ms) == len(TURBO_SIGMAS)
    pixels = got.pixels.permute(0, 2, 3, 1).numpy()
    assert np.abs((pixels * 255).round() - (expected * 255).round()).max() <= 1


@pytest.mark.parametrize("size", [(1024, 1024), (1600, 900), (512, 2048)])
def test_a_dummy_run_s_image_processor_gives_a_condition_image_a_slot_per_2x2_of_its_latent_tokens(size):
    """A dummy run's processor has the published Qwen3-VL pixel bounds: with transformers' defaults a 1024² condition
    image was shrunk for the encoder, and the prefix's layout refused it on an H100 ("does not fill its 1024 slots")."""
    configs = json.loads((Path(__file__).parents[1] / "paradit/families/qwen_image21/configs.json").read_text())
    processor = published_image_processor(configs["qwen3_vl_8b"]["vision_config"])
    image = picture(*size, 0)
    height, width = area_size(QwenImage21Inputs().output_resolution, image)
    grid = processor(images=[image.resize((width, height))], return_tensors="pt")["image_grid_thw"]
    assert grid.prod().item() // processor.merge_size**2 == (height // TOKEN_PIXELS) * (width // TOKEN_PIXELS) // 4
