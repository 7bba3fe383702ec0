"""FLUX.2 klein KV checkpoints (diffusers' ``Flux2KleinKVPipeline``) against diffusers, on a tiny ``save_pretrained``
folder (fp32, CPU): with one reference and with two of different sizes (a batch of two), and without any, the image
is diffusers' to one 8-bit level; tensor parallel equals one process; the plans that cannot take the cached
references refuse a request with references in one line, and serve one without."""

from __future__ import annotations

import dataclasses
import functools
from pathlib import Path

import numpy as np
import pytest
import torch
from diffusers import FlowMatchEulerDiscreteScheduler, Flux2KleinKVPipeline, Flux2Transformer2DModel
from PIL import Image

from paradit.engine import Engine
from paradit.errors import InvalidRequest
from paradit.families import FAMILIES, spec_from_folder
from paradit.families.flux2.presets import FLUX2_SCHEDULER
from paradit.loader import load_pipeline
from paradit.offline_tokenizer import build_offline_tokenizer
from paradit.parallel import ParallelConfig
from paradit.parallel.mesh import ParallelContext
from paradit.request import GenerationRequest
from paradit.settings import Asked, settle
from tests.checkpoint_cache import cached
from tests.checkpoints import qwen3_encoder, randomize, relative_l2, tiny_transformer_config, tiny_vae
from tests.distributed import run_on_processes

PROMPT, SEED = "the cat from the first picture, in the second's room", 5


def build_kv_checkpoint(folder: Path, seed: int = 0) -> Path:
    """Four heads, which a tensor degree of 2 divides."""
    torch.manual_seed(seed)
    transformer = Flux2Transformer2DModel(**tiny_transformer_config(guidance_embeds=False, heads=4))
    randomize(transformer)
    pipe = Flux2KleinKVPipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(**FLUX2_SCHEDULER),
        vae=tiny_vae(),
        text_encoder=qwen3_encoder(),
        tokenizer=build_offline_tokenizer(),
        transformer=transformer,
    )
    pipe.save_pretrained(folder, max_shard_size="100KB")
    return folder


def folder() -> Path:
    return cached(build_kv_checkpoint)


def picture(width: int, height: int, seed: int) -> Image.Image:
    """Smooth random structure (a VAE of random weights sees gradients, not only noise)."""
    coarse = np.random.default_rng(seed).integers(0, 256, (max(2, height // 16), max(2, width // 16), 3), np.uint8)
    return Image.fromarray(coarse).resize((width, height), Image.Resampling.BICUBIC)


# One reference of 64x80 (the output takes its size); two, 72x64 (cropped to 64x64) and 64x100 (to 64x96), for two
# images of 32x48. Three steps: the first, which diffusers runs with the references, and two from its cache.
CASES = {
    "one": dict(image=[picture(64, 80, 0)], steps=3),
    "two": dict(image=[picture(72, 64, 1), picture(64, 100, 2)], steps=3, height=32, width=48, num_images_per_prompt=2),
    "none": dict(steps=2, height=32, width=32),
}


def diffusers_images(case: str) -> np.ndarray:
    asked = dict(CASES[case])
    pipeline = Flux2KleinKVPipeline.from_pretrained(folder(), dtype=torch.float32)
    output = pipeline(
        prompt=PROMPT,
        num_inference_steps=asked.pop("steps"),
        output_type="np",
        generator=torch.Generator("cpu").manual_seed(SEED),
        **asked,
    )
    return output.images * 255


def request(case: str, **changes) -> GenerationRequest:
    return GenerationRequest(prompt=PROMPT, seed=SEED, **{**CASES[case], **changes})


@functools.cache
def engine() -> Engine:
    return Engine(str(folder()), device="cpu", dtype="fp32")


@pytest.mark.parametrize("case", CASES)
def test_images_are_diffusers_kv_pipelines(case):
    expected = diffusers_images(case)
    ours = engine().generate(request(case)).pixels.permute(0, 2, 3, 1).numpy() * 255
    assert ours.shape == expected.shape == {"one": (1, 80, 64, 3), "two": (2, 32, 48, 3), "none": (1, 32, 32, 3)}[case]
    assert np.abs(ours - expected).max() <= 255e-4  # 1e-4 of the range: well within one 8-bit level
    if case != "none":  # the references matter: without them the same request is another image
        size = dict(height=expected.shape[1], width=expected.shape[2])
        alone = engine().generate(request(case, image=None, **size)).pixels.permute(0, 2, 3, 1).numpy() * 255
        assert np.abs(alone - expected).max() > 3


def test_a_kv_checkpoint_runs_unguided_four_steps_and_does_not_inpaint():
    spec = engine().spec
    assert (spec.guidance_mode, spec.steps, spec.guidance) == ("none", 4, None)
    with pytest.raises(InvalidRequest, match="does no inpainting; drop the mask"):
        engine().check(request("one", mask=Image.new("L", (64, 80), 255)))


def _pixels(plan: ParallelConfig | None) -> torch.Tensor | None:
    device = torch.device("cpu")
    spec = spec_from_folder(folder())
    pipeline = load_pipeline(spec, device, torch.float32, None if plan is None else ParallelContext.build(plan, device))
    results = pipeline.generate([FAMILIES["flux2"].resolve_request(spec, request("two"))])
    return None if results is None else results[0].pixels


def test_tensor_parallel_equals_one_process():
    """Each rank caches its heads' keys and values of the references, through the sharded blocks."""
    folder()  # built here, not by each process
    assert relative_l2(run_on_processes(2, _pixels, ParallelConfig(tensor=2)), _pixels(None)) <= 1e-5


@pytest.mark.parametrize(
    "plan,flag",
    [
        (ParallelConfig(ulysses=2), "--ulysses"),
        (ParallelConfig(ring=2), "--ring"),
        (ParallelConfig(pipefusion=2), "--pipefusion"),
        (ParallelConfig(ulysses=2, shard_weights=2), "--ulysses and --shard-weights"),
    ],
)
def test_plans_that_split_the_references_refuse_them_in_one_line(plan, flag):
    settings = settle(Asked(str(folder()), device="cpu", dtype="fp32", parallel=plan))
    with pytest.raises(InvalidRequest) as refused:
        settings.resolve(request("one"))
    message = str(refused.value)
    assert "\n" not in message and refused.value.param == "image"
    assert f"which {flag} cannot take yet; drop {flag} (one GPU and --tensor take references)" in message
    assert settings.resolve(request("none")).images == ()  # text alone runs under any plan


def test_cuda_graphs_refuse_references():
    settings = engine().settings
    graphed = dataclasses.replace(settings, options=dataclasses.replace(settings.options, cuda_graphs=True))
    with pytest.raises(InvalidRequest, match="which --cuda-graphs cannot take yet"):
        graphed.resolve(request("one"))
