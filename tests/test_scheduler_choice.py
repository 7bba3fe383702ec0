"""``--scheduler`` and ``--shift``: every family's images equal its diffusers pipeline's with that scheduler swapped in
as a diffusers user swaps it (on tiny checkpoints that diffusers wrote); what its pipeline cannot take is refused
before any worker or pipeline starts; the command line's flags and the HTTP body's fields reach the run, and the
choice is recorded in the PNG metadata and ``--json``."""

from __future__ import annotations

import json

import numpy as np
import pydantic
import pytest
import torch
from diffusers import (
    DPMSolverMultistepScheduler,
    FlowMatchEulerDiscreteScheduler,
    Flux2KleinPipeline,
    QwenImagePipeline,
    StableDiffusion3Pipeline,
    UniPCMultistepScheduler,
    WanPipeline,
    ZImagePipeline,
)
from PIL import Image

from paradit import Engine, GenerationRequest, InvalidRequest
from paradit.families import FAMILIES, PRESETS
from paradit.pipelines.requests import one_batch
from paradit.serving.client import request_body
from paradit.serving.schemas import ImageGenerationBody
from tests.checkpoint_cache import cached
from tests.checkpoints import build_klein_checkpoint
from tests.qwen_image_checkpoints import build_qwen_image_checkpoint
from tests.sd3_checkpoints import build_sd3_checkpoint
from tests.test_cli import assert_one_line_error, run_cli, tiny_args
from tests.test_wan import wan_checkpoint
from tests.zimage_checkpoints import build_zimage_checkpoint

PROMPT, SEED, STEPS = "a red fox in snow", 5, 3


def swapped_in(config, scheduler: str | None, shift: float | None):
    """The scheduler a diffusers user swaps into the pipeline whose scheduler has ``config`` for ``--scheduler
    scheduler --shift shift``: the multistep solvers predicting flow on flow sigmas, shifted by ``shift`` (else by
    the checkpoint's); a shift is static (none: the checkpoint's own scheduler, shifted)."""
    static = {"use_dynamic_shifting": False} if shift is not None else {}
    shift = config.get("shift", config.get("flow_shift")) if shift is None else shift
    solver = {"prediction_type": "flow_prediction", "use_flow_sigmas": True, "flow_shift": shift, **static}
    if scheduler == "unipc" or (scheduler is None and config["_class_name"] == "UniPCMultistepScheduler"):
        return UniPCMultistepScheduler.from_config(config, **solver)
    if scheduler == "dpmpp-2m":
        return DPMSolverMultistepScheduler.from_config(config, algorithm_type="dpmsolver++", solver_order=2, **solver)
    return FlowMatchEulerDiscreteScheduler.from_config(config, shift=shift, **static)


def image_call(pipeline, reference, height: int, width: int) -> np.ndarray:
    """diffusers' images, (batch, height, width, 3), without guidance (its rule for each family's scale)."""
    guidance = {QwenImagePipeline: {}, ZImagePipeline: {"guidance_scale": 0.0}}.get(pipeline, {"guidance_scale": 1.0})
    return reference(
        prompt=PROMPT,
        height=height,
        width=width,
        num_inference_steps=STEPS,
        generator=torch.Generator("cpu").manual_seed(SEED),
        output_type="np",
        **guidance,
    ).images


def video_call(pipeline, reference, height: int, width: int) -> np.ndarray:
    """diffusers' frames in 8-bit levels, (batch, frames, height, width, 3)."""
    frames = reference(
        prompt=PROMPT,
        height=height,
        width=width,
        num_frames=5,
        num_inference_steps=STEPS,
        guidance_scale=1.0,
        generator=torch.Generator("cpu").manual_seed(SEED),
        output_type="np",
        max_sequence_length=512,
    ).frames
    return (frames * 255).round()


# family: (the checkpoint, diffusers' pipeline class, (height, width), (--scheduler, --shift) cases, how it is called)
FAMILY_CASES = {
    "flux2": (
        lambda: cached(build_klein_checkpoint),
        Flux2KleinPipeline,
        (32, 48),
        [("unipc", None), ("dpmpp-2m", None), (None, 2.0), ("unipc", 2.0)],
        image_call,
    ),
    "qwen_image": (
        lambda: cached(build_qwen_image_checkpoint),
        QwenImagePipeline,
        (32, 48),
        [("unipc", None), (None, 2.0)],
        image_call,
    ),
    "sd3": (lambda: cached(build_sd3_checkpoint), StableDiffusion3Pipeline, (32, 48), [("unipc", None)], image_call),
    "wan": (
        lambda: wan_checkpoint("t2v"),
        WanPipeline,
        (32, 48),
        [("flow-euler", None), ("dpmpp-2m", 2.0)],
        video_call,
    ),
    "zimage": (
        lambda: cached(build_zimage_checkpoint, 1, True),
        ZImagePipeline,
        (32, 48),
        [("flow-euler", 2.0)],
        image_call,
    ),
}
CASES = [(family, *case) for family, spec in FAMILY_CASES.items() for case in spec[3]]


# What each family's request sets beside the case: no guidance (each family's rule for its scale), Wan's frames.
UNGUIDED = {"qwen_image": {}, "zimage": {"guidance": 0.0}, "wan": {"guidance": 1.0, "guidance_2": 1.0, "frames": 5}}


class Runs:
    """Per family, loaded on first use: diffusers' pipeline, its scheduler's config and paradit's engine; and
    paradit's images of each case, (batch, height, width, 3), or frames in 8-bit levels (batch, frames, ...)."""

    def __init__(self) -> None:
        self.loaded: dict[str, tuple] = {}
        self.images: dict[tuple, np.ndarray] = {}

    def both(self, family: str) -> tuple:
        if family not in self.loaded:
            folder, pipeline, *_ = FAMILY_CASES[family]
            reference = pipeline.from_pretrained(folder(), dtype=torch.float32)
            engine = Engine(str(folder()), device="cpu", dtype="fp32")
            self.loaded[family] = reference, dict(reference.scheduler.config), engine
        return self.loaded[family]

    def ours(self, family: str, scheduler: str | None, shift: float | None) -> np.ndarray:
        if (family, scheduler, shift) not in self.images:
            height, width = FAMILY_CASES[family][2]
            request = GenerationRequest(
                prompt=PROMPT,
                height=height,
                width=width,
                steps=STEPS,
                seed=SEED,
                scheduler=scheduler,
                shift=shift,
                **UNGUIDED.get(family, {"guidance": 1.0}),
            )
            result = self.both(family)[2].generate(request)
            pixels = result.pixels.permute(0, 1, 3, 4, 2) if result.is_video else result.pixels.permute(0, 2, 3, 1)
            self.images[family, scheduler, shift] = (
                (pixels * 255).round().numpy() if result.is_video else pixels.numpy()
            )
        return self.images[family, scheduler, shift]


@pytest.fixture(scope="module")
def runs() -> Runs:
    return Runs()


@pytest.mark.parametrize("family,scheduler,shift", CASES, ids=lambda value: str(value))
def test_images_equal_diffusers_with_the_scheduler_swapped_in(runs, family, scheduler, shift):
    _, pipeline, (height, width), _, call = FAMILY_CASES[family]
    reference, config, _ = runs.both(family)
    reference.scheduler = swapped_in(config, scheduler, shift)
    expected = call(pipeline, reference, height, width)
    got = runs.ours(family, scheduler, shift)
    assert got.shape == expected.shape
    assert np.abs(got - expected).max() <= (1 if got.ndim == 5 else 1e-4)
    # The choice changed the images (the tiny Wan's frames are mostly saturated: levels, beyond the tolerance).
    assert np.abs(got - runs.ours(family, None, None)).max() > (2 if got.ndim == 5 else 1e-3)


def resolve(model: str, **fields):
    spec = PRESETS[model]
    return FAMILIES[spec.family].resolve_request(spec, GenerationRequest(prompt=PROMPT, **fields))


# What diffusers' pipelines cannot take, refused as each request is resolved, naming what is allowed.
REFUSED = [
    ("z-image-tiny", dict(scheduler="unipc"), "scheduler 'unipc' is not allowed; z-image-tiny takes flow-euler"),
    ("z-image-tiny", dict(scheduler="dpmpp-2m"), "z-image-tiny takes flow-euler"),
    ("qwen-image-tiny", dict(scheduler="dpmpp-2m"), "qwen-image-tiny takes flow-euler, unipc"),
    ("flux2-tiny", dict(scheduler="euler"), "flux2-tiny takes flow-euler, unipc, dpmpp-2m"),
    ("flux2-tiny", dict(scheduler="dpmpp-2m", shift=2.0), "'dpmpp-2m' takes no static shift on flux2-tiny"),
    ("sd3.5-tiny", dict(scheduler="unipc", image=Image.new("RGB", (64, 64))), "does no image-to-image"),
    *[("flux2-tiny", dict(shift=bad), "give a finite number above 0") for bad in (0, -1.5, float("inf"), True)],
]


@pytest.mark.parametrize("model,fields,message", REFUSED, ids=lambda value: str(value)[:40])
def test_what_a_pipeline_cannot_take_is_refused_as_the_request_resolves(model, fields, message):
    with pytest.raises(InvalidRequest, match=message.replace("(", r"\(")):
        resolve(model, **fields)


def test_what_diffusers_takes_resolves_and_batches_only_with_the_same_choice():
    assert (resolve("sd3.5-tiny", scheduler="dpmpp-2m", shift=2).shift) == 2.0
    assert resolve("wan-tiny", scheduler="dpmpp-2m").scheduler == "dpmpp-2m"
    assert resolve("flux2-tiny", scheduler="dpmpp-2m").shift is None  # its dynamic shift, as DPM-Solver++'s
    with pytest.raises(InvalidRequest, match="scheduler, shift"):
        one_batch([resolve("flux2-tiny"), resolve("flux2-tiny", scheduler="unipc")])


@pytest.fixture
def no_pipeline(monkeypatch):
    """Starting a worker or a pipeline fails the test."""

    def started(*args, **kwargs):
        raise AssertionError("a worker or pipeline started before the refusal")

    for name in ("paradit.engine.WorkerGroup", "paradit.loader.build_pipeline"):
        monkeypatch.setattr(name, started)
    monkeypatch.setattr("paradit.cli.start_worker_server", lambda device: None)


@pytest.mark.parametrize("plan", [[], ["--gpus", "2"]], ids=["1 process", "2 workers"])
def test_the_command_line_refuses_before_a_worker_starts(plan, no_pipeline, capsys, tmp_path):
    argv = tiny_args(tmp_path / "x.png", "--model", "z-image-tiny", "--scheduler", "unipc", *plan)
    assert_one_line_error(*run_cli(argv, capsys)[::2], "scheduler 'unipc' is not allowed", "flow-euler")
    argv = tiny_args(tmp_path / "x.png", "--shift", "0")
    assert_one_line_error(*run_cli(argv, capsys)[::2], "shift 0.0 is not allowed", "above 0")
    assert_one_line_error(*run_cli(tiny_args(tmp_path / "x.png", "--shift", "nan"), capsys)[::2], "finite")
    argv = tiny_args(tmp_path / "x.png", "--scheduler", "euler")
    assert_one_line_error(*run_cli(argv, capsys)[::2], "flow-euler", "unipc", "dpmpp-2m")
    assert not list(tmp_path.iterdir())


def test_the_flags_reach_the_run_and_are_recorded(capsys, tmp_path):
    out, record = tmp_path / "x.png", tmp_path / "run.json"
    code, _, err = run_cli(
        tiny_args(out, "--scheduler", "unipc", "--shift", "2", "--seed", "1", "--json", str(record)), capsys
    )
    assert code == 0, err
    assert {"scheduler": "unipc", "shift": 2.0}.items() <= json.loads(record.read_text()).items()
    assert (Image.open(out).text["scheduler"], Image.open(out).text["shift"]) == ("unipc", "2.0")
    with Engine("flux2-tiny", device="cpu") as engine:
        asked = dict(prompt="a lighthouse on a cliff", steps=1, height=32, width=32, seed=1)
        swapped = engine.generate(GenerationRequest(**asked, scheduler="unipc", shift=2.0)).images[0]
        plain = engine.generate(GenerationRequest(**asked)).images[0]
    written = np.asarray(Image.open(out))
    assert np.array_equal(written, np.asarray(swapped)) and not np.array_equal(written, np.asarray(plain))


def test_the_http_body_and_the_server_client_carry_the_choice():
    body = ImageGenerationBody(prompt="a fox", scheduler="dpmpp-2m", shift=2)
    assert (body.request("flux2-tiny").scheduler, body.request("flux2-tiny").shift) == ("dpmpp-2m", 2)
    for bad in (dict(scheduler="euler"), dict(shift=0), dict(shift=float("inf"))):
        with pytest.raises(pydantic.ValidationError):
            ImageGenerationBody(prompt="a fox", **bad)
    from paradit.cli import build_parser

    args = build_parser().parse_args(["generate", "--prompt", "a fox", "--scheduler", "unipc", "--shift", "3"])
    assert {"scheduler": "unipc", "shift": 3.0}.items() <= request_body(args).items()
