"""paradit's Z-Image against diffusers' reference on tiny random checkpoint folders (fp32, CPU), and every parallel
plan against the one-process result (gloo, 2-4 processes)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from diffusers import ZImagePipeline, ZImageTransformer2DModel

from paradit import Engine, GenerationRequest, InvalidRequest
from paradit.checkpoint import safetensors_files
from paradit.families import PRESETS
from paradit.families.zimage.family import resolve_request
from paradit.families.zimage.model import ZImageConfig, ZImageTransformer, unpatchify
from paradit.parallel import ParallelConfig
from tests.checkpoint_cache import cached
from tests.checkpoints import load_module_weights, relative_l2
from tests.zimage_checkpoints import build_zimage_checkpoint


@pytest.fixture(scope="module")
def base_checkpoint(tmp_path_factory):
    return cached(build_zimage_checkpoint)


@pytest.fixture(scope="module")
def turbo_checkpoint(tmp_path_factory):
    return cached(build_zimage_checkpoint, 1, True)


@pytest.fixture(scope="module")
def transformers(base_checkpoint) -> tuple[ZImageTransformer2DModel, ZImageTransformer]:
    """The reference transformer and ours, loaded from the same folder."""
    reference = ZImageTransformer2DModel.from_pretrained(base_checkpoint / "transformer").eval()
    return reference, load_ours(base_checkpoint)


def load_ours(folder) -> ZImageTransformer:
    config = ZImageConfig.from_dict(ZImageTransformer2DModel.load_config(folder / "transformer"))
    with torch.device("meta"):
        model = ZImageTransformer(config)
    load_module_weights(model, safetensors_files(folder / "transformer"), torch.device("cpu"), torch.float32)
    return model.eval()


def caption_batch(captions: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Right-padded captions and their mask (None when all have one length), as the pipeline passes them."""
    lengths = [len(c) for c in captions]
    padded = torch.nn.utils.rnn.pad_sequence(captions, batch_first=True)
    mask = torch.arange(padded.shape[1]) < torch.tensor(lengths)[:, None]
    return padded, None if len(set(lengths)) == 1 else mask


def transformer_inputs(config: dict, rows: int, cols: int, caption_lengths: list[int], seed: int):
    gen = torch.Generator().manual_seed(seed)
    batch = len(caption_lengths)
    latents = torch.randn(batch, config["in_channels"], 2 * rows, 2 * cols, generator=gen)
    captions = [torch.randn(n, config["cap_feat_dim"], generator=gen) for n in caption_lengths]
    return latents, torch.rand(batch, generator=gen), captions


@pytest.mark.parametrize(
    "rows,cols,caption_lengths",
    [
        (4, 4, [7]),  # image and caption both end in pad tokens
        (3, 5, [13, 45]),  # captions rounded to 32 and 64 tokens: the shorter one's last 32 keys are masked
        (6, 2, [5, 20, 32]),  # different lengths, one rounded length: pad tokens differ, nothing is masked
        (8, 4, [64]),  # no pad token anywhere
    ],
)
def test_transformer_matches_diffusers(transformers, rows, cols, caption_lengths):
    reference, ours = transformers
    latents, timestep, captions = transformer_inputs(reference.config, rows, cols, caption_lengths, seed=rows)
    with torch.no_grad():
        expected = reference(list(latents[:, :, None]), timestep, captions, return_dict=False)[0]
        expected = torch.stack(expected)[:, :, 0]
        got = unpatchify(ours(latents, timestep, *caption_batch(captions)), rows, cols, patch=2)
    assert got.shape == expected.shape
    assert relative_l2(got, expected) <= 1e-5


def test_images_match_diffusers_with_cfg(base_checkpoint):
    """True CFG with negative prompts, captions of different lengths, two prompts x two images, a non-square size."""
    prompts = ["a red fox in snow", "a lighthouse at dusk, long exposure, gulls circling over the breaking waves"]
    negatives = ["blurry", "low quality, oversaturated"]
    kwargs = dict(height=48, width=80, num_inference_steps=3, guidance_scale=4.0, num_images_per_prompt=2)
    reference = ZImagePipeline.from_pretrained(base_checkpoint, dtype=torch.float32)
    # The reference rewrites the prompt lists it is given, hence the copies.
    expected = reference(
        prompt=list(prompts),
        negative_prompt=list(negatives),
        generator=torch.Generator("cpu").manual_seed(7),
        output_type="np",
        **kwargs,
    ).images
    engine = Engine(str(base_checkpoint), device="cpu", dtype="fp32")
    assert (engine.spec.guidance_mode, engine.spec.steps, engine.spec.guidance) == ("cfg", 50, 5.0)
    result = engine.generate(
        GenerationRequest(
            prompt=prompts,
            negative_prompt=negatives,
            height=48,
            width=80,
            steps=3,
            guidance=4.0,
            seed=7,
            num_images_per_prompt=2,
        )
    )
    got = result.pixels.permute(0, 2, 3, 1).numpy()
    assert got.shape == expected.shape == (4, 48, 80, 3)
    assert np.abs(got - expected).max() <= 1e-4
    # The four images differ from each other: seeds and prompts reached the right samples.
    assert np.abs(got[0] - got[1]).max() > 1e-3 and np.abs(got[0] - got[2]).max() > 1e-3


def test_turbo_images_match_diffusers_without_cfg(turbo_checkpoint):
    reference = ZImagePipeline.from_pretrained(turbo_checkpoint, dtype=torch.float32)
    expected = reference(
        prompt="a bowl of ramen",
        height=64,
        width=32,
        num_inference_steps=2,
        guidance_scale=0.0,
        generator=torch.Generator("cpu").manual_seed(3),
        output_type="np",
    ).images
    engine = Engine(str(turbo_checkpoint), device="cpu", dtype="fp32")
    assert (engine.spec.guidance_mode, engine.spec.steps, engine.spec.guidance) == ("cfg", 8, 0.0)
    got = engine.generate(GenerationRequest(prompt="a bowl of ramen", height=64, width=32, steps=2, seed=3)).pixels
    assert np.abs(got.permute(0, 2, 3, 1).numpy() - expected).max() <= 1e-4
    # diffusers' pipeline guides a Turbo checkpoint too when asked (its default of 0 is only a default): so does ours.
    guided = reference(
        prompt="a bowl of ramen",
        negative_prompt="soup",
        height=64,
        width=32,
        num_inference_steps=2,
        guidance_scale=3.0,
        generator=torch.Generator("cpu").manual_seed(3),
        output_type="np",
    ).images
    request = GenerationRequest(
        prompt="a bowl of ramen", negative_prompt="soup", height=64, width=32, steps=2, seed=3, guidance=3.0
    )
    got = engine.generate(request).pixels.permute(0, 2, 3, 1).numpy()
    assert np.abs(got - guided).max() <= 1e-4 and np.abs(guided - expected).max() > 1e-2


def test_requests_are_checked_against_the_model():
    turbo, base = PRESETS["z-image-turbo"], PRESETS["z-image"]
    with pytest.raises(InvalidRequest, match="height 1000 is not allowed; this model takes multiples of 16 from 16"):
        resolve_request(base, GenerationRequest(prompt="a cat", height=1000))
    with pytest.raises(InvalidRequest, match="width 8208 is not allowed; .* from 16 to 8192"):
        resolve_request(base, GenerationRequest(prompt="a cat", width=8208))
    assert resolve_request(turbo, GenerationRequest(prompt="a cat")).guidance == 0.0  # guidance off by default
    assert resolve_request(base, GenerationRequest(prompt="a cat", guidance=0.0)).guidance == 0.0


# Two prompts of different lengths and a negative prompt: the text stream is padded and masked in both CFG halves.
REQUEST = GenerationRequest(
    prompt=["a red fox", "a blue bird over a lake at dawn, mist rising from the reeds and a boat far away"],
    negative_prompt="blurry",
    height=48,
    width=80,
    steps=2,
    seed=11,
    guidance=3.0,
)


@pytest.fixture(scope="module")
def serial_pixels() -> torch.Tensor:
    return Engine("z-image-tiny", device="cpu", dtype="fp32").generate(REQUEST).pixels


@pytest.mark.parametrize("plan", [ParallelConfig(cfg=2), ParallelConfig(ulysses=2)], ids=lambda p: p.describe())
def test_plan_gives_the_serial_image(plan, serial_pixels):
    with Engine("z-image-tiny", device="cpu", dtype="fp32", parallel=plan) as engine:
        result = engine.generate(REQUEST)
    assert result.timings.comm_bytes_per_step > 0
    assert result.pixels.shape == serial_pixels.shape == (2, 3, 48, 80)
    assert (result.pixels - serial_pixels).abs().max().item() <= 1e-4
