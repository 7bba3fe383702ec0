"""Wan 2.2 image-to-video: paradit's frames equal diffusers' ``WanImageToVideoPipeline`` on tiny checkpoints written
by diffusers' own ``save_pretrained`` (the I2V-A14B layout: two experts taking the image's latents as extra channels;
the TI2V-5B layout given an image: its latent frame first, at timestep 0), also with the group encoding and decoding
across processes; and what an image request may not ask for is refused with the allowed values."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from diffusers import WanTransformer3DModel
from PIL import Image

from paradit.errors import InvalidRequest
from paradit.parallel import ParallelConfig
from paradit.request import GenerationRequest
from tests.checkpoint_cache import cached, copy_of
from tests.checkpoints import randomize
from tests.test_wan import TEXT_WIDTH, tiny_umt5, tiny_wan_vae, wan_checkpoint
from tests.test_wan_model import tiny_config


def first_frame(width: int = 50, height: int = 38) -> Image.Image:
    """A smooth random picture of another size and aspect than the video's, so that the resize matters."""
    gen = torch.Generator().manual_seed(5)
    coarse = torch.rand(3, 5, 6, generator=gen)
    pixels = torch.nn.functional.interpolate(coarse[None], size=(height, width), mode="bilinear")[0]
    return Image.fromarray((pixels.permute(1, 2, 0).numpy() * 255).astype(np.uint8))


def tiny_i2v_expert(seed: int) -> WanTransformer3DModel:
    torch.manual_seed(seed)
    transformer = WanTransformer3DModel(**{**tiny_config(36, 16, heads=2, head_dim=12), "text_dim": TEXT_WIDTH})
    randomize(transformer, std=0.1)
    return transformer.eval()


def write_i2v_checkpoint(folder: Path) -> None:
    """The I2V-A14B layout: two experts with 36 input channels, boundary 0.9, no CLIP image encoder."""
    from diffusers import UniPCMultistepScheduler, WanImageToVideoPipeline

    from paradit.families.wan.presets import UNIPC_FLOW
    from paradit.offline_tokenizer import offline_t5_tokenizer

    pipe = WanImageToVideoPipeline(
        tokenizer=offline_t5_tokenizer(),
        text_encoder=tiny_umt5(),
        vae=tiny_wan_vae("wan21"),
        scheduler=UniPCMultistepScheduler.from_config({**UNIPC_FLOW, "flow_shift": 5.0}),
        transformer=tiny_i2v_expert(1),
        transformer_2=tiny_i2v_expert(2),
        boundary_ratio=0.9,
    )
    pipe.save_pretrained(folder)


def checkpoint(layout: str) -> Path:
    """A checkpoint diffusers wrote: I2V-A14B, or TI2V-5B (saved as a WanPipeline, as published, and loaded for
    images as diffusers' documentation does); built once (checkpoint_cache)."""
    return cached(write_i2v_checkpoint) if layout == "i2v" else wan_checkpoint("ti2v")


CASES = {  # layout -> (height, width), frames, guidance
    "i2v": ((32, 48), 9, {"guidance_scale": 4.0, "guidance_scale_2": 2.5}),
    "ti2v": ((64, 32), 5, {"guidance_scale": 5.0}),
}


def request_for(layout: str, **overrides) -> GenerationRequest:
    (height, width), frames, guidance = CASES[layout]
    fields = dict(
        prompt=["a red fox &amp; a  crow", "snow"],
        height=height,
        width=width,
        frames=frames,
        steps=5,
        seed=3,
        guidance=guidance["guidance_scale"],
        guidance_2=guidance.get("guidance_scale_2"),
        image=first_frame(),
    )
    return GenerationRequest(**{**fields, **overrides})


@pytest.mark.parametrize("layout", ["i2v", "ti2v"])
def test_frames_equal_diffusers(layout):
    from diffusers import WanImageToVideoPipeline

    from paradit.families import spec_from_folder
    from paradit.families.wan.family import resolve_request
    from paradit.loader import load_pipeline

    folder = checkpoint(layout)
    reference = WanImageToVideoPipeline.from_pretrained(folder)
    request = request_for(layout)
    (height, width), frames, guidance = CASES[layout]
    expected = reference(
        image=request.image,
        prompt=request.prompt,
        height=height,
        width=width,
        num_frames=frames,
        num_inference_steps=request.steps,
        generator=torch.Generator().manual_seed(request.seed),
        output_type="np",
        max_sequence_length=512,
        **guidance,
    ).frames
    spec = spec_from_folder(folder)
    pipeline = load_pipeline(spec, torch.device("cpu"), torch.float32)
    (result,) = pipeline.generate([resolve_request(spec, request)])
    ours = (result.pixels.permute(0, 1, 3, 4, 2).numpy() * 255).round()
    assert ours.shape == expected.shape == (2, frames, height, width, 3)
    assert (expected < 0.99).mean() > 0.25  # most of the random VAE's output saturates; a quarter or more does not
    levels = abs(ours - (expected * 255).round())
    assert levels.max() <= 1, levels.max()
    # The image steers the video: without it (TI2V's text-to-video) the first frame is another picture.
    if layout == "ti2v":
        text_only = pipeline.generate([resolve_request(spec, request_for(layout, image=None))])[0].pixels
        assert (text_only[:, 0] - result.pixels[:, 0]).abs().max() > 0.1


def _generate_in_group(folder: str, layout: str, plans: list[ParallelConfig]) -> list[torch.Tensor]:
    from paradit.engine import Engine

    videos = []
    for plan in plans:
        with Engine(folder, device="cpu", dtype="fp32", parallel=plan) as engine:
            videos.append(engine.generate(request_for(layout)).pixels)
    return videos


@pytest.mark.parametrize(
    "layout,plans",
    [
        ("i2v", [ParallelConfig(), ParallelConfig(ulysses=2), ParallelConfig(tensor=2)]),
        (
            "ti2v",
            [
                ParallelConfig(),
                ParallelConfig(ring=3),
                ParallelConfig(pipefusion=2),
                ParallelConfig(pipefusion=2, patches=2, warmup_steps=1),
            ],
        ),
    ],
)
def test_parallel_plans_equal_one_process(layout, plans):
    """The group encodes the image together (a band of rows each) and runs the sequence split (or the tensor shards,
    or the pipeline stages) over the conditioned latents: the frames equal one process's (relative L2 <= 1e-5).
    TI2V-5B (one transformer) under PipeFusion 2 with 2 patches after 1 warm-up step attends to the previous step's
    K/V for the other patch, so its video moves off one process's by a measured amount: relative L2 1.7e-5 on this
    tiny random checkpoint (5 steps, 4 of them patched; the exact plans stay near 1e-7); bound 1e-3."""
    serial, *parallel = _generate_in_group(str(checkpoint(layout)), layout, plans)
    for plan, video in zip(plans[1:], parallel):
        error = ((video - serial).norm() / serial.norm()).item()
        if plan.exact:
            assert error <= 1e-5, (plan.describe(), error)
        else:
            assert 1e-6 < error <= 1e-3, (plan.describe(), error)


def test_image_requests_are_checked(tmp_path):
    from paradit.families import PRESETS, spec_from_folder
    from paradit.families.wan.family import resolve_request

    i2v, t2v, ti2v = PRESETS["wan2.2-i2v-a14b"], PRESETS["wan2.2-t2v-a14b"], PRESETS["wan2.2-ti2v-5b"]
    resolved = resolve_request(i2v, GenerationRequest(prompt="x", image=first_frame().convert("RGBA")))
    assert (resolved.guidance, resolved.guidance_2, resolved.frames, resolved.fps) == (3.5, 3.5, 81, 16)
    assert [image.mode for image in resolved.images] == ["RGB"]
    assert resolve_request(ti2v, GenerationRequest(prompt="x")).images == ()  # TI2V: the image is optional
    assert resolve_request(ti2v, GenerationRequest(prompt="x", fps=30)).fps == 30
    with pytest.raises(InvalidRequest, match=r"animates an image; give the first frame \(--image PATH\)"):
        resolve_request(i2v, GenerationRequest(prompt="x"))
    with pytest.raises(InvalidRequest, match="text-to-video and takes no image; the image-to-video models are"):
        resolve_request(t2v, GenerationRequest(prompt="x", image=first_frame()))
    with pytest.raises(InvalidRequest, match="image 1 must be a PIL image, not str"):
        resolve_request(i2v, GenerationRequest(prompt="x", image="cat.png"))
    for fps in (0, 241, 2.5):
        with pytest.raises(InvalidRequest, match="a whole number from 1 to 240"):
            resolve_request(ti2v, GenerationRequest(prompt="x", fps=fps))
    # A Wan 2.1 image-to-video checkpoint (a CLIP image encoder) is named as such, not loaded half-way.
    folder = copy_of(checkpoint("i2v"), tmp_path / "wan21")
    index = folder / "model_index.json"
    index.write_text(
        index.read_text().replace(
            '"image_encoder": [\n    null,\n    null\n  ]', '"image_encoder": ["transformers", "CLIPVisionModel"]'
        )
    )
    (folder / "image_encoder").mkdir()
    from paradit.errors import CheckpointError

    with pytest.raises(CheckpointError, match="Wan 2.1 image-to-video checkpoint"):
        spec_from_folder(folder)


def test_cli_writes_an_mp4_from_an_image(tmp_path, capsys):
    """``--image`` and ``--out x.mp4``: an H.264 MP4 at ``--fps`` whose frames are the Engine's (within the codec's
    loss); an unreadable image, and an MP4 asked of an image model, are one-line refusals."""
    import av

    from paradit.cli import main
    from paradit.engine import Engine
    from tests.test_cli import assert_one_line_error, run_cli

    folder = wan_checkpoint("ti2v")
    first_frame().save(tmp_path / "first.png")
    args = [
        "generate",
        "--model",
        str(folder),
        "--device",
        "cpu",
        "--prompt",
        "a boat",
        "--steps",
        "2",
        "--height",
        "64",
        "--width",
        "32",
        "--frames",
        "5",
        "--no-progress",
        "--image",
        str(tmp_path / "first.png"),
    ]
    assert main([*args, "--fps", "12", "--out", str(tmp_path / "v.mp4")]) == 0
    with av.open(str(tmp_path / "v.mp4")) as container:
        stream = container.streams.video[0]
        assert (stream.codec_context.name, stream.average_rate) == ("h264", 12)
        written = np.stack([f.to_ndarray(format="rgb24") for f in container.decode(video=0)]).astype(np.float32)
    request = GenerationRequest(
        prompt="a boat", steps=2, height=64, width=32, frames=5, seed=0, image=Image.open(tmp_path / "first.png")
    )
    with Engine(str(folder), device="cpu") as engine:
        video = (engine.generate(request).pixels[0].permute(0, 2, 3, 1).numpy() * 255).round()
    assert written.shape == video.shape
    luma = np.array([0.299, 0.587, 0.114], dtype=np.float32)  # 4:2:0 keeps brightness at full resolution
    error = abs(written @ luma - video @ luma).mean()
    assert error < 4, error  # x264 at CRF 18 on noisy random frames: 2.6 levels; the frames reversed: 8.0
    capsys.readouterr()
    code, _, err = run_cli([*args[:-1], str(tmp_path / "missing.png"), "--out", str(tmp_path / "w.mp4")], capsys)
    assert_one_line_error(code, err, "missing.png cannot be read as an image")
    code, _, err = run_cli(
        ["generate", "--model", "flux2-tiny", "--prompt", "x", "--out", str(tmp_path / "i.mp4")], capsys
    )
    assert_one_line_error(code, err, "names a video; this model makes images")
