"""Editing with reference images against diffusers: on tiny ``save_pretrained`` folders (fp32, CPU), FLUX.2 klein
and dev with one reference (the output at its size) and with three of different sizes (cropped to whole tokens)
give diffusers' ``Flux2KleinPipeline`` / ``Flux2Pipeline`` image to one 8-bit level; every parallel
plan with references equals one process; references diffusers refuses, or more than FLUX.2 takes, are one line;
SD3.5, Z-Image and Qwen-Image image-to-image (strength 0.6, 1, and a few steps' share) give diffusers' image, on one
process and split, and so does their inpainting and klein's (with a reference besides); ``POST /v1/images/edits``
through OpenAI's client, two images and a mask, gives the command line's image and refuses bad forms."""

from __future__ import annotations

import base64
import dataclasses
import functools
import io

import httpx
import numpy as np
import openai
import pytest
import torch
from diffusers import (
    Flux2KleinInpaintPipeline,
    Flux2KleinPipeline,
    Flux2Pipeline,
    QwenImageImg2ImgPipeline,
    QwenImageInpaintPipeline,
    StableDiffusion3Img2ImgPipeline,
    StableDiffusion3InpaintPipeline,
    ZImageImg2ImgPipeline,
    ZImageInpaintPipeline,
)
from PIL import Image

from paradit.engine import Engine
from paradit.errors import InvalidRequest
from paradit.families import FAMILIES, spec_from_folder
from paradit.loader import load_pipeline
from paradit.memory import estimates
from paradit.parallel import ParallelConfig
from paradit.parallel.mesh import ParallelContext
from paradit.request import GenerationRequest
from paradit.serving.launch import ServeSettings, build_scheduler
from paradit.serving.metrics import Metrics
from paradit.serving.server import create_app
from paradit.settings import Asked
from tests.checkpoint_cache import cached
from tests.checkpoints import build_dev_checkpoint, relative_l2
from tests.distributed import run_on_processes
from tests.test_checkpoint_options import assert_one_line_error, build_checkpoint, run_cli
from tests.test_serving_scheduler import app_in_thread

PROMPT, STEPS, SEED, GUIDANCE = "the cat from the first picture, in the second's room", 3, 7, 4.0
# klein's folder has heads a tensor degree of 2 divides (the one the other options' tests share).
FOLDERS = {"klein": lambda: cached(build_checkpoint, "flux2"), "dev": lambda: cached(build_dev_checkpoint)}
PIPELINES = {"klein": Flux2KleinPipeline, "dev": Flux2Pipeline}


def picture(width: int, height: int, seed: int) -> Image.Image:
    """A random RGB picture with smooth structure (a VAE of random weights sees gradients, not only noise)."""
    generator = np.random.default_rng(seed)
    coarse = generator.integers(0, 256, (max(2, height // 16), max(2, width // 16), 3), dtype=np.uint8)
    return Image.fromarray(coarse).resize((width, height), Image.Resampling.BICUBIC)


# One reference of 80x112 (the output takes its size), and three: 96x64, 72x100 (cropped to 64x96) and 120x70
# (cropped to 112x64).
REFERENCES = {
    "one": ([(80, 112)], {}),
    "three": ([(96, 64), (72, 100), (120, 70)], {"height": 48, "width": 64}),
}


def references(case: str) -> list[Image.Image]:
    return [picture(w, h, seed) for seed, (w, h) in enumerate(REFERENCES[case][0])]


def diffusers_pixels(variant: str, case: str) -> np.ndarray:
    pipeline = PIPELINES[variant].from_pretrained(FOLDERS[variant](), dtype=torch.float32)
    output = pipeline(
        image=references(case),
        prompt=PROMPT,
        num_inference_steps=STEPS,
        guidance_scale=GUIDANCE,
        generator=torch.Generator("cpu").manual_seed(SEED),
        output_type="np",
        **REFERENCES[case][1],
    )
    return output.images[0] * 255


def request(case: str) -> GenerationRequest:
    return GenerationRequest(
        prompt=PROMPT, steps=STEPS, seed=SEED, guidance=GUIDANCE, image=references(case), **REFERENCES[case][1]
    )


@pytest.mark.parametrize("variant,case", [("klein", "one"), ("klein", "three"), ("dev", "three")])
def test_reference_images_give_diffusers_image(variant, case):
    expected = diffusers_pixels(variant, case)
    with Engine(str(FOLDERS[variant]()), device="cpu", dtype="fp32") as engine:
        result = engine.generate(request(case))
        without = engine.generate(
            GenerationRequest(
                prompt=PROMPT,
                steps=STEPS,
                seed=SEED,
                guidance=GUIDANCE,
                height=expected.shape[0],
                width=expected.shape[1],
            )
        )
    ours = result.pixels[0].permute(1, 2, 0).numpy() * 255
    assert ours.shape == expected.shape == ((112, 80, 3) if case == "one" else (48, 64, 3))
    assert np.abs(ours.round() - expected.round()).max() <= 1
    # The references matter: the same request without them is another image.
    assert np.abs(without.pixels[0].permute(1, 2, 0).numpy() * 255 - expected).max() > 3


PLANS = [
    ParallelConfig(ulysses=2),
    ParallelConfig(ring=3),
    ParallelConfig(cfg=2, ulysses=2),
    ParallelConfig(tensor=2),
    ParallelConfig(ring=2, tensor=2),
    ParallelConfig(pipefusion=2, warmup_steps=STEPS),
]


def _pixels(plan: ParallelConfig | None) -> torch.Tensor:
    device = torch.device("cpu")
    spec = spec_from_folder(FOLDERS["klein"]())
    context = None if plan is None else ParallelContext.build(plan, device)
    pipeline = load_pipeline(spec, device, torch.float32, context)
    results = pipeline.generate([FAMILIES["flux2"].resolve_request(spec, request("three"))])
    return None if results is None else results[0].pixels


@functools.cache
def one_process() -> torch.Tensor:
    return _pixels(None)


@pytest.mark.parametrize("plan", PLANS, ids=lambda plan: plan.describe())
def test_every_plan_with_references_equals_one_process(plan):
    """The references' tokens join the split sequence (any lengths), each CFG half, each tensor shard and each
    pipeline stage: the image is one process's."""
    ours = run_on_processes(plan.world_size, _pixels, plan)
    assert relative_l2(ours, one_process()) <= 1e-5


IMAGE_TO_IMAGE = {
    "sd3": StableDiffusion3Img2ImgPipeline,
    "zimage": ZImageImg2ImgPipeline,
    "qwen_image": QwenImageImg2ImgPipeline,
}
# SD3.5 and Qwen-Image resize the image to the size asked for (48x32 here); Z-Image makes the image's size floored
# to whole tokens.
IMAGE_SIZE = {
    "sd3": ((60, 40), {"height": 32, "width": 48}),
    "zimage": ((50, 37), {}),
    "qwen_image": ((60, 40), {"height": 32, "width": 48}),
}


def image_request(family: str, strength: float) -> GenerationRequest:
    size, asked = IMAGE_SIZE[family]
    negative = {"negative_prompt": " "} if family == "qwen_image" else {}  # Qwen-Image guides only with one
    return GenerationRequest(
        prompt=PROMPT,
        steps=STEPS,
        seed=SEED,
        guidance=GUIDANCE,
        image=picture(*size, 4),
        strength=strength,
        **asked,
        **negative,
    )


def _image_to_image_pixels(
    family: str, strength: float, plan: ParallelConfig | None, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    device = torch.device("cpu")
    spec = spec_from_folder(cached(build_checkpoint, family))
    context = None if plan is None else ParallelContext.build(plan, device)
    pipeline = load_pipeline(spec, device, dtype, context)
    results = pipeline.generate([FAMILIES[family].resolve_request(spec, image_request(family, strength))])
    return None if results is None else results[0].pixels


def assert_split_equals_one_process(pixels, *args) -> None:
    """``pixels(*args, plan, dtype)`` split as ``plan`` (the last of ``args``) and on one process, both in float64.
    A split reorders sums (Ring's merge of key blocks, a gathered sequence's layout): in float32 that alone moved
    Ring's inpainting by 1.3e-3 of 255 after three steps and the VAE, as much as a thread count does. In float64
    what is left is what stays float32 (the pixels, Z-Image's latents, which its scheduler steps in float32): 3e-5
    to 1.1e-4 of 255 measured, so 1e-3 keeps a margin and is still far below what a wrong block, rank or blend
    makes."""
    *common, plan = args
    split = run_on_processes(plan.world_size, pixels, *common, plan, torch.float64)
    ours = pixels(*common, None, torch.float64)
    assert np.abs(split - ours).max() * 255 <= 1e-3


@functools.cache
def image_to_image_on_one_process(family: str, strength: float) -> torch.Tensor:
    return _image_to_image_pixels(family, strength, None)


@pytest.mark.parametrize("strength", [0.6, 1.0, 0.3])
@pytest.mark.parametrize("family", IMAGE_TO_IMAGE)
def test_image_to_image_gives_diffusers_image(family, strength):
    """strength 0.3 of 3 steps runs one step, 0.6 two, 1 all three from pure noise (the image still sets the
    size for Z-Image); each as diffusers' image-to-image pipeline makes it, and the Ulysses split equals it."""
    size, asked = IMAGE_SIZE[family]
    pipeline = IMAGE_TO_IMAGE[family].from_pretrained(cached(build_checkpoint, family), dtype=torch.float32)
    guidance = (
        {"true_cfg_scale": GUIDANCE, "negative_prompt": " "} if family == "qwen_image" else {"guidance_scale": GUIDANCE}
    )
    expected = (
        pipeline(
            image=picture(*size, 4),
            prompt=PROMPT,
            num_inference_steps=STEPS,
            strength=strength,
            generator=torch.Generator("cpu").manual_seed(SEED),
            output_type="np",
            **asked,
            **guidance,
        ).images[0]
        * 255
    )
    ours = image_to_image_on_one_process(family, strength)[0].permute(1, 2, 0).numpy() * 255
    assert ours.shape == expected.shape == (32, 48, 3)
    assert np.abs(ours.round() - expected.round()).max() <= 1
    if strength == 0.6:
        assert_split_equals_one_process(_image_to_image_pixels, family, strength, ParallelConfig(ulysses=2))


INPAINTING = {
    "sd3": StableDiffusion3InpaintPipeline,
    "zimage": ZImageInpaintPipeline,
    "qwen_image": QwenImageInpaintPipeline,
    "flux2": Flux2KleinInpaintPipeline,
}
# klein inpaints the image's own size (floored to whole tokens), here with a reference besides it.
INPAINTING_SIZE = {**IMAGE_SIZE, "flux2": ((50, 37), {})}
INPAINTING_REFERENCE = {"flux2": picture(72, 100, 1)}


def mask_picture(width: int, height: int) -> Image.Image:
    """White (repainted) over a box off the centre, black (kept) around it; grey edges, which the binarising cuts."""
    mask = Image.new("L", (width, height), 0)
    mask.paste(255, (width // 5, height // 4, width * 3 // 4, height * 4 // 5))
    mask.paste(128, (width // 5, height // 4, width * 3 // 4, height // 4 + 2))
    return mask


def _inpainting_pixels(family: str, plan: ParallelConfig | None, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    device = torch.device("cpu")
    spec = spec_from_folder(cached(build_checkpoint, family))
    context = None if plan is None else ParallelContext.build(plan, device)
    pipeline = load_pipeline(spec, device, dtype, context)
    size, asked = INPAINTING_SIZE[family]
    image = [picture(*size, 4), *([INPAINTING_REFERENCE[family]] if family in INPAINTING_REFERENCE else [])]
    negative = {"negative_prompt": " "} if family == "qwen_image" else {}  # Qwen-Image guides only with one
    asked = GenerationRequest(
        prompt=PROMPT,
        steps=STEPS,
        seed=SEED,
        guidance=GUIDANCE,
        image=image,
        strength=0.6,
        mask=mask_picture(*size),
        **asked,
        **negative,
    )
    results = pipeline.generate([FAMILIES[family].resolve_request(spec, asked)])
    return None if results is None else results[0].pixels


# Each split with its own blend: a sequence split (each rank steps the whole latents), and PipeFusion's band-by-band
# update, where each band's copy of the scheduler counts its own steps.
INPAINTING_PLANS = {
    "sd3": ParallelConfig(ulysses=2),
    "zimage": ParallelConfig(pipefusion=2, warmup_steps=STEPS),
    "qwen_image": ParallelConfig(cfg=2),
    "flux2": ParallelConfig(ring=2),
}


@pytest.mark.parametrize("family", INPAINTING)
def test_inpainting_gives_diffusers_image_and_keeps_the_image_outside_the_mask(family):
    """Strength 0.6 with a mask as each family's diffusers inpainting pipeline makes it, on one process and split."""
    size, asked = INPAINTING_SIZE[family]
    pipeline = INPAINTING[family].from_pretrained(cached(build_checkpoint, family), dtype=torch.float32)
    guidance = (
        {"true_cfg_scale": GUIDANCE, "negative_prompt": " "} if family == "qwen_image" else {"guidance_scale": GUIDANCE}
    )
    if family in INPAINTING_REFERENCE:
        guidance["image_reference"] = INPAINTING_REFERENCE[family]
    # diffusers' SD3 inpainting decodes latents / scaling_factor, leaving out the VAE's shift_factor that its other
    # SD3 pipelines (and the VAE's encode) apply: its latents are compared, decoded as its text-to-image decodes them.
    latent = family == "sd3"
    expected = pipeline(
        image=picture(*size, 4),
        mask_image=mask_picture(*size),
        prompt=PROMPT,
        strength=0.6,
        num_inference_steps=STEPS,
        generator=torch.Generator("cpu").manual_seed(SEED),
        output_type="latent" if latent else "np",
        **asked,
        **guidance,
    ).images
    if latent:
        with torch.no_grad():
            vae = pipeline.vae
            pixels = vae.decode(expected / vae.config.scaling_factor + vae.config.shift_factor).sample
        expected = pipeline.image_processor.postprocess(pixels, output_type="np")
    expected = expected[0] * 255
    ours = _inpainting_pixels(family, None)[0].permute(1, 2, 0).numpy() * 255
    assert ours.shape == expected.shape == (32, 48, 3)
    assert np.abs(ours.round() - expected.round()).max() <= 1
    if family in IMAGE_TO_IMAGE:
        image_to_image = image_to_image_on_one_process(family, 0.6)[0].permute(1, 2, 0).numpy() * 255
        assert np.abs(ours - image_to_image).max() > 3  # the mask mattered
    assert_split_equals_one_process(_inpainting_pixels, family, INPAINTING_PLANS[family])


def test_masks_are_refused_where_nothing_is_repainted_and_default_to_each_pipelines_strength():
    sd3, zimage = (spec_from_folder(cached(build_checkpoint, family)) for family in ("sd3", "zimage"))
    image, mask = picture(64, 48, 0), mask_picture(64, 48)
    resolve = functools.partial(FAMILIES["sd3"].resolve_request, sd3)
    with pytest.raises(InvalidRequest, match="a mask needs the image it masks"):
        resolve(GenerationRequest(prompt="a", mask=mask))
    with pytest.raises(InvalidRequest, match="the mask is 48x64 and the image 64x48; give a mask of the image's size"):
        resolve(GenerationRequest(prompt="a", image=image, mask=mask.transpose(Image.Transpose.TRANSPOSE)))
    dev = spec_from_folder(FOLDERS["dev"]())
    with pytest.raises(InvalidRequest, match="does no inpainting; drop the mask"):
        FAMILIES["flux2"].resolve_request(dev, GenerationRequest(prompt="a", image=image, mask=mask))
    # diffusers' defaults: 0.6 for SD3.5's (and Qwen-Image's) inpainting, 1 for Z-Image's; the mask read as grayscale.
    resolved = resolve(GenerationRequest(prompt="a", image=image, mask=mask.convert("RGBA")))
    assert resolved.strength == 0.6 and resolved.mask.mode == "L"
    zimage_request = GenerationRequest(prompt="a", image=image, mask=mask)
    assert FAMILIES["zimage"].resolve_request(zimage, zimage_request).strength == 1.0


def test_strength_is_refused_where_no_image_is_repainted():
    sd3 = spec_from_folder(cached(build_checkpoint, "sd3"))
    resolve = functools.partial(FAMILIES["sd3"].resolve_request, sd3)
    for strength in (0, 1.5, float("nan")):
        with pytest.raises(InvalidRequest, match=f"strength {strength} is not allowed; give a number above 0"):
            resolve(GenerationRequest(prompt="a", image=picture(64, 64, 0), strength=strength))
    with pytest.raises(InvalidRequest, match="takes an image"):
        resolve(GenerationRequest(prompt="a", strength=0.5))
    klein = spec_from_folder(FOLDERS["klein"]())
    with pytest.raises(InvalidRequest, match="takes no strength"):
        FAMILIES["flux2"].resolve_request(klein, GenerationRequest(prompt="a", image=picture(64, 64, 0), strength=0.5))
    with pytest.raises(InvalidRequest, match="takes at most 1 input image; 2 given"):
        resolve(GenerationRequest(prompt="a", image=[picture(64, 64, 0)] * 2))
    assert resolve(GenerationRequest(prompt="a", image=picture(64, 64, 0))).strength == 0.6  # diffusers' default


def test_references_count_in_the_memory_estimate():
    """Each reference adds its tokens to every sample's sequence: the estimate's working memory grows with them. One
    past 1024² pixels is shrunk as diffusers shrinks it (1300x820 to 1289x813), then cropped to 1280x800."""
    spec = dataclasses.replace(spec_from_folder(FOLDERS["klein"]()), height=64, width=64)
    images = [*references("three"), picture(1300, 820, 9)]
    resolved = FAMILIES["flux2"].resolve_request(spec, GenerationRequest(prompt="a", image=images))
    assert resolved.images[-1].size == (1289, 813)
    assert resolved.reference_tokens == 4 * 6 + 6 * 4 + 4 * 7 + 50 * 80
    plain, joined = (
        estimates(spec, ParallelConfig(), torch.float32, False, extra_tokens=extra)["gpu"]
        for extra in (0, resolved.reference_tokens)
    )
    assert joined.activations > plain.activations * 2


def test_references_diffusers_refuses_or_flux2_does_not_take_are_one_line(tmp_path, capfd):
    spec = spec_from_folder(FOLDERS["klein"]())
    resolve = functools.partial(FAMILIES["flux2"].resolve_request, spec)
    with pytest.raises(InvalidRequest, match=r"image 2: Image too small: 40×80"):
        resolve(GenerationRequest(prompt="a", image=[picture(64, 64, 0), picture(40, 80, 1)]))
    with pytest.raises(InvalidRequest, match=r"image 1: Aspect ratio too extreme: 900×100"):
        resolve(GenerationRequest(prompt="a", image=picture(900, 100, 0)))
    with pytest.raises(InvalidRequest, match="takes at most 10 input images; 11 given"):
        resolve(GenerationRequest(prompt="a", image=[picture(64, 64, seed) for seed in range(11)]))
    # The command line: every reference is read before anything runs, and an unreadable one is named.
    good, bad, out = tmp_path / "good.png", tmp_path / "bad.png", tmp_path / "out.png"
    picture(64, 64, 0).save(good)
    bad.write_bytes(b"not an image")
    argv = [
        "generate",
        "--model",
        str(FOLDERS["klein"]()),
        "--device",
        "cpu",
        "--prompt",
        "a",
        "--steps",
        "1",
        "--no-progress",
        "--out",
        str(out),
        "--image",
        str(good),
        "--image",
        str(bad),
    ]
    assert_one_line_error(*run_cli(argv, capfd)[::2], f"--image {bad} cannot be read as an image")
    assert not out.exists()


def test_the_official_client_edits_as_the_command_line_and_bad_forms_get_a_4xx(tmp_path, capfd):
    """``images.edit`` with two images and a mask (klein inpainting the first, the second a reference) gives the
    command line's image for the same seed, as does ``generate --server --image --mask``; a form without an image,
    with a file that is no image, with a mask of another size, with 11 images or of 30 MB is refused naming the field,
    and the server serves on."""
    folder = FOLDERS["klein"]()
    paths = [tmp_path / f"reference_{index}.png" for index in range(2)]
    for path, image in zip(paths, references("three")[:2]):
        image.save(path)
    mask = tmp_path / "mask.png"
    mask_picture(*references("three")[0].size).save(mask)
    fields = [
        "--steps",
        str(STEPS),
        "--seed",
        str(SEED),
        "--guidance",
        str(GUIDANCE),
        "--height",
        "48",
        "--width",
        "64",
        "--no-progress",
    ]
    inputs = ["--image", str(paths[0]), "--image", str(paths[1]), "--mask", str(mask)]
    local = tmp_path / "local.png"
    argv = [
        "generate",
        "--model",
        str(folder),
        "--device",
        "cpu",
        "--dtype",
        "fp32",
        "--prompt",
        PROMPT,
        "--out",
        str(local),
        *fields,
        *inputs,
    ]
    code, _, err = run_cli(argv, capfd)
    assert code == 0, err
    expected = np.asarray(Image.open(local), dtype=np.float64)

    scheduler, config = build_scheduler(ServeSettings(Asked(model=str(folder), device="cpu", dtype="fp32")), Metrics())
    scheduler.start()
    try:
        with app_in_thread(create_app(scheduler, config, Metrics())) as url:
            client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
            answer = client.images.edit(
                image=[path.open("rb") for path in paths],
                mask=mask.open("rb"),
                prompt=PROMPT,
                size="64x48",
                extra_body={"steps": STEPS, "seed": SEED, "guidance": GUIDANCE},
            )
            with Image.open(io.BytesIO(base64.b64decode(answer.data[0].b64_json))) as image:
                assert np.abs(np.asarray(image, dtype=np.float64) - expected).max() <= 1
            remote = tmp_path / "remote.png"
            argv = ["generate", "--server", url, "--prompt", PROMPT, "--out", str(remote), *fields, *inputs]
            code, _, err = run_cli(argv, capfd)
            assert code == 0, err
            assert np.abs(np.asarray(Image.open(remote), dtype=np.float64) - expected).max() <= 1

            png = paths[0].read_bytes()
            form = {"prompt": "a fox", "steps": "1", "size": "64x48"}
            refused = {
                "no image": ({}, "image", "give the image(s) to edit"),
                "not an image": ({"image": ("x.png", b"GIF89a but no more")}, "image", "image 1 cannot be read"),
                "mask of another size": (
                    {"image": ("a.png", png), "mask": ("m.png", paths[1].read_bytes())},
                    "mask",
                    "give a mask of the image's size",
                ),
                "mask as text": ({"image": ("a.png", png)}, "mask", "send the mask as a file part"),
                "11 images": ([("image[]", ("a.png", png))] * 11, "image", "11 images sent; this server takes at most"),
                "30 MB": ({"image": ("big.png", png + bytes(30 << 20))}, "body", "larger than this server's limit"),
                "steps": ({"image": ("a.png", png)}, "steps", "steps: Input should be a valid integer"),
            }
            for case, (files, param, message) in refused.items():
                data = {**form, "steps": "many"} if case == "steps" else form
                data = {**data, "mask": "white"} if case == "mask as text" else data
                response = httpx.post(url + "/v1/images/edits", data=data, files=files or None, timeout=60)
                assert 400 <= response.status_code < 500, (case, response.status_code)
                error = response.json()["error"]
                assert error["param"] == param and message in error["message"], (case, error)
            again = client.images.edit(
                image=[path.open("rb") for path in paths],
                mask=mask.open("rb"),
                prompt=PROMPT,
                size="64x48",
                extra_body={"steps": STEPS, "seed": SEED, "guidance": GUIDANCE},
            )
            with Image.open(io.BytesIO(base64.b64decode(again.data[0].b64_json))) as image:
                assert np.abs(np.asarray(image, dtype=np.float64) - expected).max() <= 1
    finally:
        scheduler.close()
