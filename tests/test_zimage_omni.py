"""Z-Image-Omni against diffusers' ``ZImageOmniPipeline`` on a tiny ``save_pretrained`` folder (fp32, CPU): the
transformer's prediction with condition images, and the image from the same prompt, seed and images to one 8-bit
level (no image, one, two of different sizes); parallel plans give the one-process image; what the pipeline cannot
take is refused in one line.

diffusers casts the condition images to bfloat16 for its VAE whatever the VAE's dtype, which a float32 VAE refuses:
its side here casts them back (so it sees bfloat16-rounded pixels, paradit float32 ones; both within the level)."""

from __future__ import annotations

import functools

import numpy as np
import pytest
import torch
from diffusers import ZImageOmniPipeline, ZImageTransformer2DModel

from paradit.errors import InvalidRequest
from paradit.families import FAMILIES, spec_from_folder
from paradit.families.zimage.model import OmniInputs, unpatchify
from paradit.loader import load_pipeline
from paradit.parallel import ParallelConfig
from paradit.parallel.mesh import ParallelContext
from paradit.request import GenerationRequest
from tests.checkpoint_cache import cached
from tests.checkpoints import relative_l2
from tests.distributed import run_on_processes
from tests.test_editing import mask_picture, picture
from tests.test_zimage import load_ours
from tests.zimage_checkpoints import SIGLIP_HIDDEN, build_zimage_omni_checkpoint

PROMPT, STEPS, SEED, GUIDANCE = "the cat of the first picture on the sofa of the second", 2, 7, 4.0
IMAGES = {0: [], 1: [(80, 64)], 2: [(80, 64), (64, 96)]}
TEXT_TO_IMAGE_SIZE = {"height": 48, "width": 64}


def images(count: int) -> list:
    return [picture(w, h, seed) for seed, (w, h) in enumerate(IMAGES[count], start=4)]


def request(count: int, **fields) -> GenerationRequest:
    inputs = {"image": images(count)} if count else TEXT_TO_IMAGE_SIZE
    return GenerationRequest(prompt=PROMPT, guidance=GUIDANCE, steps=STEPS, seed=SEED, **{**inputs, **fields})


def omni_spec():
    return spec_from_folder(cached(build_zimage_omni_checkpoint))


def test_transformer_matches_diffusers_with_condition_images():
    """Two condition images, captions of different lengths cut in segments that end in pad tokens: the target's
    prediction, each token modulated as noisy or clean."""
    folder = cached(build_zimage_omni_checkpoint) / "transformer"
    reference, ours = ZImageTransformer2DModel.from_pretrained(folder).eval(), load_ours(folder.parent)
    gen = torch.Generator().manual_seed(0)
    target, timestep = torch.randn(2, 16, 8, 10, generator=gen), torch.rand(2, generator=gen)
    conditions = [torch.randn(1, 16, 2 * h, 2 * w, generator=gen) for h, w in ((3, 4), (5, 2))]
    siglip = [torch.randn(1, h, w, SIGLIP_HIDDEN, generator=gen) for h, w in ((2, 3), (4, 1))]
    segments = [[7, 2, 40, 2], [7, 2, 33, 2]]
    captions = [[torch.randn(n, 16, generator=gen) for n in row] for row in segments]
    with torch.no_grad():
        expected = reference(
            x=[[c[0][:, None] for c in conditions] + [x[:, None]] for x in target],
            t=timestep,
            cap_feats=captions,
            siglip_feats=[[s[0] for s in siglip] + [None]] * 2,
            image_noise_mask=[[0, 0, 1]] * 2,
            return_dict=False,
        )[0]
        omni = OmniInputs.build(
            segments, tuple(conditions), tuple(s.expand(2, -1, -1, -1) for s in siglip), torch.device("cpu")
        )
        padded = torch.nn.utils.rnn.pad_sequence([torch.cat(row) for row in captions], batch_first=True)
        got = unpatchify(ours(target, timestep, padded, None, omni), 4, 5, patch=2)
    assert relative_l2(got, torch.stack(expected)[:, :, 0]) <= 1e-5


def _pixels(count: int, plan: ParallelConfig | None) -> torch.Tensor | None:
    device, spec = torch.device("cpu"), omni_spec()
    context = None if plan is None else ParallelContext.build(plan, device)
    results = load_pipeline(spec, device, torch.float32, context).generate(
        [FAMILIES["zimage"].resolve_request(spec, request(count))]
    )
    return None if results is None else results[0].pixels


@functools.cache
def one_process(count: int) -> torch.Tensor:
    return _pixels(count, None)


@pytest.mark.parametrize("count", [0, 1, 2], ids=["no image", "one image", "two images"])
def test_omni_gives_diffusers_image(count):
    """Without a size the output takes the last image's, floored to whole tokens; without images, the Omni
    template and positions make a text-to-image of their own."""
    pipeline = ZImageOmniPipeline.from_pretrained(cached(build_zimage_omni_checkpoint), dtype=torch.float32)
    encode = pipeline.vae.encode
    pipeline.vae.encode = lambda pixels, *args, **kwargs: encode(pixels.to(pipeline.vae.dtype), *args, **kwargs)
    size = {} if count else TEXT_TO_IMAGE_SIZE
    expected = (
        pipeline(
            image=images(count) or None,
            prompt=PROMPT,
            guidance_scale=GUIDANCE,
            num_inference_steps=STEPS,
            output_type="np",
            generator=torch.Generator("cpu").manual_seed(SEED),
            **size,
        ).images[0]
        * 255
    )
    ours = one_process(count)[0].permute(1, 2, 0).numpy() * 255
    assert ours.shape == expected.shape == [(48, 64, 3), (64, 80, 3), (96, 64, 3)][count]
    assert np.abs(ours.round() - expected.round()).max() <= 1


PLANS = [ParallelConfig(cfg=2, ulysses=2), ParallelConfig(pipefusion=2, warmup_steps=STEPS)]


@pytest.mark.parametrize("plan", PLANS, ids=lambda plan: plan.describe())
def test_plans_with_condition_images_equal_one_process(plan):
    """Each branch's caption segments on its half of the group; the noisy/clean marks travel with their tokens, the
    SigLIP stream is split like the others, its refiner a stage's blocks like the other refiners."""
    ours = run_on_processes(plan.world_size, _pixels, 2, plan)
    assert (ours - one_process(2)).abs().max() <= 1e-3


def test_what_omni_cannot_take_is_refused_naming_it():
    spec, resolve = omni_spec(), FAMILIES["zimage"].resolve_request
    with pytest.raises(InvalidRequest, match="takes at most 10 input images; 11 given"):
        resolve(spec, request(1, image=images(1) * 11))
    with pytest.raises(InvalidRequest, match="does no inpainting"):
        resolve(spec, request(1, mask=mask_picture(80, 64)))
    with pytest.raises(InvalidRequest, match="takes no strength"):
        resolve(spec, request(1, strength=0.5))
    with pytest.raises(InvalidRequest, match="image 2: Image too small: 60×40"):
        resolve(spec, request(1, image=[*images(1), picture(60, 40, 0)]))
    with pytest.raises(InvalidRequest, match="image 1: Aspect ratio too extreme"):
        resolve(spec, request(1, image=[picture(640, 64, 0)]))
    resolved = resolve(spec, request(2, height=32))
    assert (resolved.height, resolved.width) == (32, 64) and resolved.reference_tokens == 5 * 4 + 4 * 6
