"""No silent garbage: a denoise step that predicts NaN or inf (a guidance scale past the numbers, NaN weights) fails
the request naming the step, before anything is decoded, in the CLI, in a group of processes (PipeFusion's patch
loop naming the step the bad rows belong to) and in the server; image inputs in every PIL mode read as diffusers'
``load_image`` hands them to a pipeline, deep pixels scaled rather than clipped; a decompression bomb refused with
its size and the limit, without PIL's raw warning."""

from __future__ import annotations

import shutil
import struct
import warnings
import zlib
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch
from PIL import Image
from safetensors.torch import load_file, save_file

from paradit.errors import InvalidRequest, NonFinitePrediction
from paradit.families import PRESETS
from paradit.families.wan.family import resolve_request
from paradit.loader import load_pipeline
from paradit.outputs import read_image, rgb_image
from paradit.parallel import ParallelConfig
from paradit.parallel.mesh import ParallelContext
from paradit.request import GenerationRequest
from paradit.settings import resolve_model
from tests.checkpoint_cache import cached
from tests.checkpoints import build_klein_checkpoint
from tests.distributed import run_on_processes
from tests.test_cli import assert_one_line_error, run_cli, tiny_args
from tests.test_serving import live_server


def test_a_guidance_scale_past_the_numbers_fails_naming_the_step_and_writes_nothing(tmp_path, capsys):
    """It wrote an all-black image and exited 0; under CFG parallelism in two worker processes both ranks stop. (Past
    float32's range, guidance is refused before anything loads.)"""
    code, _, err = run_cli(tiny_args(tmp_path / "x.png", "--guidance", "1e300"), capsys)
    assert_one_line_error(code, err, "guidance 1e+300 is not allowed; give a finite value >= 0 (at most 3.4e+38)")
    for plan in ([], ["--gpus", "2"]):
        out = tmp_path / f"x{len(plan)}.png"
        code, _, err = run_cli(tiny_args(out, "--steps", "2", "--guidance", "3e38", *plan), capsys)
        assert_one_line_error(code, err, "predicted NaN or inf", "guidance scale too large (3e+38")
        assert not out.exists()


def test_a_checkpoint_with_nan_weights_fails_naming_the_weights(tmp_path, capsys):
    folder = tmp_path / "nan"
    shutil.copytree(cached(build_klein_checkpoint), folder)
    shards = (folder / "transformer").glob("*.safetensors")
    shard = next(path for path in shards if "proj_out.weight" in load_file(path))
    tensors = load_file(shard)
    tensors["proj_out.weight"][0, 0] = float("nan")
    save_file(tensors, shard, metadata={"format": "pt"})
    out = tmp_path / "x.png"
    argv = [
        "generate",
        "--model",
        str(folder),
        "--device",
        "cpu",
        "--prompt",
        "a cat",
        "--steps",
        "2",
        "--height",
        "32",
        "--width",
        "32",
        "--no-progress",
        "--out",
        str(out),
    ]
    code, _, err = run_cli(argv, capsys)
    assert_one_line_error(code, err, "denoise step 1 of 2 predicted NaN or inf", "NaN or inf in the weights")
    assert not out.exists()


POISONED_STEP = 2
POISON_REQUEST = GenerationRequest(prompt="a red fox", height=48, width=80, steps=4, seed=3)


def _failure_with_a_nan_in_the_last_token_at(plan: ParallelConfig, step: int) -> str:
    """The error of a run whose model input has NaN in its last token at ``step`` alone. Under PipeFusion with
    patches only the last band's prediction of that step is NaN, and it lands in a call made for the next step."""
    device = torch.device("cpu")
    spec = resolve_model("flux2-tiny", "dummy")
    context = ParallelContext.build(plan, device) if plan.world_size > 1 else None
    pipeline = load_pipeline(spec, device, torch.float32, context)
    model_inputs, make_scheduler, timesteps = pipeline.model_inputs, pipeline.make_scheduler, []

    def scheduled(request, latents):
        scheduler, steps = make_scheduler(request, latents)
        timesteps.extend(steps.tolist())
        return scheduler, steps

    def poisoned(request, latents, t, layout):
        model_input, timestep = model_inputs(request, latents, t, layout)
        if t.item() == timesteps[step]:
            model_input = model_input.clone()
            model_input[:, -1] = float("nan")
        return model_input, timestep

    pipeline.make_scheduler, pipeline.model_inputs = scheduled, poisoned
    with pytest.raises(NonFinitePrediction) as raised:
        pipeline.generate([pipeline.family.resolve_request(spec, POISON_REQUEST)])
    return str(raised.value)


@pytest.mark.parametrize(
    "plan",
    [
        ParallelConfig(),
        ParallelConfig(pipefusion=2, patches=2, warmup_steps=1),
        ParallelConfig(cfg=2),
        ParallelConfig(tensor=2),
    ],
    ids=lambda plan: plan.describe(),
)
def test_every_rank_of_a_group_fails_at_the_step_that_went_bad(plan):
    """Every rank raises (one raising alone would leave the others in the decode's collectives: a hang), naming the
    step the bad prediction belongs to, as one process does."""
    if plan.world_size == 1:
        error = _failure_with_a_nan_in_the_last_token_at(plan, POISONED_STEP)
    else:
        error = run_on_processes(plan.world_size, _failure_with_a_nan_in_the_last_token_at, plan, POISONED_STEP)
    assert f"denoise step {POISONED_STEP + 1} of 4 predicted NaN or inf" in error, error


def test_the_server_answers_a_non_finite_run_with_an_error_and_serves_on():
    """It answered 200 with a black image; now the group of two (CFG parallel) fails the request and serves on."""
    with live_server(model="flux2-tiny", gpus=2, group_size=2) as (url, _):
        body = {"prompt": "a fox", "size": "32x32", "steps": 2}
        with httpx.Client(base_url=url, timeout=300) as client:
            failed = client.post("/v1/images/generations", json={**body, "guidance": 3e38})
            assert failed.status_code == 500, failed.text
            assert "predicted NaN or inf" in failed.json()["error"]["message"]
            assert client.post("/v1/images/generations", json=body).status_code == 200


GRADIENT = np.linspace(0, 65535, 48 * 64).round().astype(np.uint16).reshape(48, 64)
EIGHT_BIT = np.round(GRADIENT / 257).astype(np.uint8)  # the gradient at 8 bits, rounded


@pytest.mark.parametrize(
    "make",
    [
        lambda: Image.fromarray(GRADIENT),  # I;16, as PIL opens a 16-bit grayscale PNG
        lambda: Image.frombytes("I;16B", (64, 48), GRADIENT.astype(">u2").tobytes()),  # big-endian TIFF
        lambda: Image.fromarray(GRADIENT.astype(np.int32)),  # I, over 0-65535
        lambda: Image.fromarray(EIGHT_BIT.astype(np.int32)),  # I, over 0-255: PIL's own scale
        lambda: Image.fromarray((GRADIENT / 65535).astype(np.float32)),  # F, over 0-1
        lambda: Image.fromarray(EIGHT_BIT.astype(np.float32)),  # F, over 0-255: PIL's own scale
    ],
    ids=["I;16", "I;16B", "I 16-bit", "I 8-bit", "F 0-1", "F 0-255"],
)
def test_deep_pixels_are_scaled_to_eight_bits_not_clipped(make, tmp_path):
    """A 16-bit grayscale image became an almost white frame (PIL's conversion clips at 255)."""
    image = make()
    got = np.asarray(rgb_image(image))
    assert got.shape == (48, 64, 3) and (got == EIGHT_BIT[..., None]).all()
    path = tmp_path / ("deep.png" if image.mode == "I;16" else "deep.tif")  # a format that stores the mode
    image.save(path)
    assert (np.asarray(read_image(str(path))) == got).all()


def test_every_pil_mode_reads_as_diffusers_load_image_gives_it_or_is_refused(tmp_path):
    from diffusers.utils import load_image

    colours = Image.fromarray(np.random.default_rng(0).integers(0, 256, (24, 32, 4), dtype=np.uint8), "RGBA")
    palette = colours.convert("RGB").quantize(16)
    palette.info["transparency"] = bytes(range(0, 256, 16))  # PIL warned about this one, converting it to RGB
    cases = {mode: colours.convert(mode) for mode in ("RGBA", "LA", "CMYK", "L", "1", "P", "YCbCr")}
    for mode, image in {**cases, "P+transparency": palette}.items():
        path = tmp_path / f"{mode}.{'jpg' if mode in ('CMYK', 'YCbCr') else 'png'}"
        image.save(path)
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # no raw PIL warning on the way
            ours = read_image(str(path))
            warnings.simplefilter("ignore")  # diffusers' reference meets PIL's
            reference = load_image(str(path))
        assert ours.mode == "RGB" and (np.asarray(ours) == np.asarray(reference)).all(), mode
    # A photo taken with the camera turned: its EXIF orientation turns it upright, once, whichever path reads it.
    photo = Image.new("RGB", (40, 20), (250, 0, 0))
    photo.paste((0, 0, 250), (0, 0, 10, 20))
    exif = Image.Exif()
    exif[0x0112] = 6  # rotate 90 degrees clockwise to view
    photo.save(tmp_path / "turned.jpg", exif=exif.tobytes())
    turned = str(tmp_path / "turned.jpg")
    upright = read_image(turned)
    assert upright.size == (20, 40) and (np.asarray(upright) == np.asarray(load_image(turned))).all()
    assert upright.getpixel((10, 2))[2] > 200  # the blue band, first on the left, is now on top
    i2v = PRESETS["wan2.2-i2v-a14b"]

    def resolve_image(spec, image):
        return resolve_request(spec, GenerationRequest(prompt="x", image=image)).images[0]

    assert (np.asarray(resolve_image(i2v, upright)) == np.asarray(upright)).all()
    assert (np.asarray(resolve_image(i2v, Image.open(turned))) == np.asarray(upright)).all()
    # Premultiplied alpha, which PIL cannot turn into RGB directly (diffusers' load_image raises): its colours.
    premultiplied = colours.convert("RGBa").convert("La")
    assert (np.asarray(rgb_image(premultiplied)) == np.asarray(premultiplied.convert("LA").convert("RGB"))).all()
    for pixels, mode, allowed in ((-1, np.int32, 65535), (70000, np.int32, 65535), (np.nan, np.float32, 255)):
        with pytest.raises(InvalidRequest, match=f"image 1 has [IF] pixels outside 0 to {allowed}, the most paradit"):
            resolve_image(i2v, Image.fromarray(np.full((4, 4), pixels, mode)))


def bare_png(path: Path, width: int, height: int, rows: int) -> Path:
    """A black 1-bit PNG of ``width`` x ``height`` holding ``rows`` of its rows: a few kB on disk, whatever its size."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    header = struct.pack(">IIBBBBB", width, height, 1, 0, 0, 0, 0)
    data = zlib.compress(bytes(((width + 7) // 8 + 1) * rows))
    path.write_bytes(b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", data) + chunk(b"IEND", b""))
    return path


def test_a_decompression_bomb_is_refused_with_its_size_and_a_large_image_reads_without_pils_warning(tmp_path, capsys):
    """20000 x 20000 raised PIL's DecompressionBombError (an internal error); 12000 x 12000 printed its warning."""
    bomb = bare_png(tmp_path / "bomb.png", 20000, 20000, rows=1)
    code, _, err = run_cli(tiny_args(tmp_path / "x.png", "--image", str(bomb)), capsys)
    assert_one_line_error(code, err, "bomb.png is 20000x20000 (400,000,000 pixels), past the 178,956,970 paradit")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        large = read_image(str(bare_png(tmp_path / "large.png", 12000, 12000, rows=12000)))
    assert large.size == (12000, 12000) and large.mode == "RGB"
