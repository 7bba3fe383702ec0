"""What a caller asks for, what a request becomes once resolved, and what it gets back."""

from __future__ import annotations

import argparse
import functools
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from PIL import Image

from paradit.errors import InvalidRequest
from paradit.flags import GENERATE, PLAN, REQUIRED, finite, generate_option, option, positive, whole_number
from paradit.outputs import read_image

if TYPE_CHECKING:
    import torch

SEED_LIMIT = 2**64  # seeds are torch generators' 64-bit seeds: 0 to 2**64 - 1
# A server's bounds on one request, so that none holds a shared group for long (past any encoder's or schedule's).
MAX_PROMPT_CHARS = 10_000
SERVED_MAX_STEPS = 500
CACHE_METHODS = ("first-block", "mag", "taylorseer")
CACHE_THRESHOLDS = {"first-block": 0.05, "mag": 0.06}  # diffusers' defaults
# The parameters each method reads (its diffusers config's); another method's is refused, never silently ignored.
CACHE_PARAMETERS = {
    "first-block": ("threshold",),
    "mag": ("threshold", "max_skip_steps", "retention_ratio", "mag_ratios", "calibrate"),
    "taylorseer": ("cache_interval", "disable_cache_before_step", "disable_cache_after_step", "max_order"),
}
# diffusers' FlowMatchEulerDiscrete, UniPC and DPM-Solver++ 2M schedulers; the multistep two predict flow (shifted)
SCHEDULERS = ("flow-euler", "unipc", "dpmpp-2m")
SPARSE_ATTENTIONS = ("radial", "svg2")  # paradit.layers.sparse_attention.SPARSE_METHODS, without importing torch
# The parameters each sparse method reads; another's is refused, never silently ignored.
SPARSE_PARAMETERS = {
    "radial": ("dense_steps", "dense_blocks", "decay_factor"),
    "svg2": ("dense_steps", "dense_blocks", "query_clusters", "key_clusters", "top_p"),
}
SPARSE_PARAMETER_NAMES = tuple(dict.fromkeys(SPARSE_PARAMETERS["radial"] + SPARSE_PARAMETERS["svg2"]))


cache_option = functools.partial(generate_option, group="step caching (skip the blocks of steps that barely change)")


def read_ratios(text: str) -> tuple[float, ...]:
    try:
        return tuple(float(part) for part in text.split(","))
    except ValueError:
        raise InvalidRequest(f"--cache-mag-ratios {text!r} is not a comma-separated list of numbers") from None


def seed(text: str) -> int | str:
    """A 64-bit seed, or ``random`` (drawn once the request is resolved, then printed)."""
    if text == "random":
        return text
    if not 0 <= (value := whole_number(text, "is neither a whole number nor 'random'")) < SEED_LIMIT:
        raise argparse.ArgumentTypeError(f"{value} is not allowed; give 0 to {SEED_LIMIT - 1} or 'random'")
    return value


@dataclass(frozen=True)
class StepCacheConfig:
    """Step caching: a method and the parameters of its diffusers config (``CACHE_PARAMETERS``), by their names."""

    method: str = cache_option(
        name="--cache",
        choices=CACHE_METHODS,
        help="as diffusers' FirstBlockCache, MagCache and TaylorSeer (lite) hooks do",
    )
    threshold: float | None = cache_option(
        name="--cache-threshold", type=float, help="first-block, mag: the threshold (default 0.05; mag 0.06)"
    )
    cache_interval: int = cache_option(5, type=int, help="taylorseer: steps between computed ones (default 5)")
    disable_cache_before_step: int = cache_option(
        3, name="--cache-disable-before-step", type=int, help="taylorseer: steps computed first (default 3)"
    )
    disable_cache_after_step: int | None = cache_option(
        name="--cache-disable-after-step", type=int, help="taylorseer: computed from this step on"
    )
    max_order: int = cache_option(
        1, name="--cache-max-order", type=int, help="taylorseer: the expansion's highest order (default 1)"
    )
    max_skip_steps: int = cache_option(
        3, name="--cache-max-skip-steps", type=int, help="mag: most steps skipped in a row (default 3)"
    )
    retention_ratio: float = cache_option(
        0.2,
        name="--cache-retention-ratio",
        type=float,
        help="mag: the share of first steps never skipped (default 0.2)",
    )
    mag_ratios: tuple[float, ...] | None = cache_option(
        name="--cache-mag-ratios",
        convert=read_ratios,
        help="mag: the model's magnitude ratios, comma-separated (default: the curve --cache-calibrate measured for "
        "this model)",
    )
    calibrate: bool = cache_option(
        False,
        name="--cache-calibrate",
        action="store_true",
        help="with --cache mag: skip nothing, print the model's magnitude ratios and keep them for the next --cache "
        "mag run",
    )

    def record(self) -> dict[str, Any]:
        """The method and the parameters it reads, for ``--json`` and the PNG metadata."""
        return {"method": self.method, **{name: getattr(self, name) for name in CACHE_PARAMETERS[self.method]}}


@dataclass(frozen=True)
class SparseAttentionConfig:
    """One request's sparse attention (a server's ``sparse_attention`` field): a method and the parameters it reads
    (``SPARSE_PARAMETERS``), as the run's ``--sparse-*`` options name them; None: the method's default."""

    method: str
    dense_steps: int | None = None
    dense_blocks: int | None = None
    decay_factor: float | None = None
    query_clusters: int | None = None
    key_clusters: int | None = None
    top_p: float | None = None

    def parameters(self) -> dict[str, Any]:
        """The parameters given, by name, as ``ExecutionOptions.sparse_parameters`` gives the run's."""
        return {name: value for name in SPARSE_PARAMETER_NAMES if (value := getattr(self, name)) is not None}


@dataclass
class GenerationRequest:
    """One call: ``prompt`` may be a list (one batch); unset fields take the model's defaults."""

    prompt: str | list[str] = generate_option(
        REQUIRED,
        action="append",
        required=True,
        convert=lambda prompts: prompts[0] if len(prompts) == 1 else prompts,
        help="repeat for several prompts in one batch",
    )
    negative_prompt: str | list[str] | None = generate_option(
        http=(str | None, dict(max_length=MAX_PROMPT_CHARS)),
        help="for models with true classifier-free guidance",
    )
    # Sizes and steps are checked against the model, which knows its bounds.
    height: int | None = option(type=int, commands=(GENERATE, PLAN), help="pixels (default: the model's)")
    width: int | None = option(type=int, commands=(GENERATE, PLAN), help="pixels (default: the model's)")
    steps: int | None = option(
        type=int,
        commands=(GENERATE, PLAN),
        http=(int | None, dict(ge=1, le=SERVED_MAX_STEPS)),
        help="denoise steps (default: the model's)",
    )
    guidance: float | None = generate_option(
        type=finite,
        http=(float | None, dict(ge=0, allow_inf_nan=False)),
        help="guidance scale (default: the model's)",
    )
    seed: int | None = generate_option(
        type=seed,
        absent=0,
        convert=lambda value: None if value == "random" else value,
        http=(int | None, dict(ge=0, lt=SEED_LIMIT, description="drawn at random when absent; answered back")),
        help="a 64-bit seed, or 'random'",
    )
    num_images_per_prompt: int = generate_option(
        1,
        name="--images-per-prompt",
        type=positive,
        absent=1,
        help="images of each prompt",
    )
    frames: int | None = option(
        type=int,
        commands=(GENERATE, PLAN),
        http=(int | None, dict(ge=1)),
        routes=("videos",),
        help="video models: frames per video, 4k+1 (default: the model's)",
    )
    guidance_2: float | None = generate_option(
        type=finite,
        http=(float | None, dict(ge=0, allow_inf_nan=False)),
        routes=("videos",),
        help="models with a low-noise expert: its guidance scale (diffusers' guidance_scale_2)",
    )
    image: Image.Image | list[Image.Image] | None = generate_option(
        action="append",
        convert=lambda paths: [read_image(path) for path in paths],
        help="an input image, repeatable where the model takes several: image-to-video's first frame, a reference to "
        "edit from, image-to-image's start",
    )
    strength: float | None = generate_option(
        type=finite,
        http=(float | None, dict(gt=0, le=1, description="image-to-image: the share of the steps run")),
        routes=("edits",),
        help="image-to-image (with --image): the share of the steps run from the noised image, above 0 to 1 (default "
        "0.6; inpainting: the model pipeline's)",
    )
    mask: Image.Image | None = generate_option(
        convert=lambda path: read_image(path, "--mask"),
        help="inpainting (with --image): a picture of the image's size, white where it is repainted, black where it "
        "is kept",
    )
    fps: int | None = generate_option(
        type=positive,
        http=(int | None, dict(ge=1)),
        routes=("videos",),
        help="video models: frames per second of the MP4 (default: the model's)",
    )
    lora: tuple[tuple[str, float], ...] | None = None  # a server's adapters and scales (None: the engine's; (): none)
    cache: StepCacheConfig | None = None  # step caching (None: every step runs every block)
    # a video's sparse self-attention for this request alone (None: the run's --sparse-attention, or dense)
    sparse_attention: SparseAttentionConfig | None = None
    scheduler: str | None = generate_option(
        choices=SCHEDULERS,
        http=(Literal[*SCHEDULERS] | None, dict(description="the sampler (default: the model's)")),
        help="the sampler, as diffusers' pipeline with that scheduler swapped in (default: the model's own)",
    )
    shift: float | None = generate_option(
        type=finite,
        http=(float | None, dict(gt=0, allow_inf_nan=False, description="the static timestep shift")),
        help="the static timestep shift, above 0; replaces a dynamic one (default: the model's)",
    )

    @property
    def prompts(self) -> list[str]:
        return [self.prompt] if isinstance(self.prompt, str) else list(self.prompt)


@dataclass
class ResolvedRequest:
    """A request with every default filled in and every value checked."""

    prompts: list[str]
    negative_prompts: list[str] | None
    height: int
    width: int
    steps: int
    guidance: float | None
    seed: int
    images_per_prompt: int
    frames: int | None = None  # video families: frames per video
    guidance_2: float | None = None  # families with a low-noise expert: its guidance scale
    images: tuple[Image.Image, ...] = ()  # the input images, RGB: Wan's first frame, FLUX.2's references
    reference_tokens: int = 0  # tokens the input images add to the transformer's sequence (FLUX.2's references)
    strength: float | None = None  # image-to-image: the share of the schedule run, from the image noised to its start
    mask: Image.Image | None = None  # inpainting: grayscale, the image's size; white is repainted, black kept
    fps: int | None = None  # video families: frames per second of the written file
    lora: tuple[tuple[str, float], ...] | None = None  # a server's adapters chosen for it, with their scales
    cache: StepCacheConfig | None = None  # step caching, its threshold set
    sparse_attention: SparseAttentionConfig | None = None  # this request's own sparse attention, checked
    scheduler: str | None = None  # one of SCHEDULERS (None: the checkpoint's own scheduler)
    shift: float | None = None  # the static timestep shift (None: the checkpoint's shift, static or dynamic)
    # (left, top, right, bottom) of the decoded image kept: FLUX.3's single reference, padded to the grid, cut back
    output_crop: tuple[int, ...] | None = None

    @property
    def batch(self) -> int:
        return len(self.prompts) * self.images_per_prompt


@dataclass
class Timings:
    text_encode_s: float = 0.0
    step_ms: list[float] = field(default_factory=list)
    vae_decode_s: float = 0.0
    total_s: float = 0.0
    peak_memory_bytes: int = 0
    peak_memory_kind: str = "device"
    peak_reserved_bytes: int = 0  # on GPUs: the most the caching allocator held, which a cap bounds
    memory_estimate_bytes: int = 0  # what the memory plan estimated rank 0 would hold (0: no plan was made)
    peak_memory_per_rank: list[int] = field(default_factory=list)  # in a group: every rank's peak, rank order
    comm_bytes_per_step: int = 0  # sent by the rank that reports, per denoise step
    plan: str = "1 GPU"
    text_encoders: str = "gpu"  # their placement on rank 0
    features: dict[str, Any] = field(default_factory=dict)  # what the request's features reported, by name

    @property
    def median_step_ms(self) -> float:
        """Of the steps after the first, which pays for compilation and an expert's first copy (all of one)."""
        ordered = sorted(self.step_ms[1:] or self.step_ms)
        return ordered[len(ordered) // 2] if ordered else 0.0


def rgb8_of(pixels: torch.Tensor) -> torch.Tensor:
    """(batch, 3, H, W) in [0, 1] -> (batch, H, W, 3) uint8, rounded to nearest. Channels last while float, in torch's
    threads (3 ms for 1024x1024 on the CPU against 10 for PIL's one-thread copy of a strided uint8 array), into a
    tensor of its own: the arithmetic in place never reaches ``pixels``, and makes no other temporary."""
    layout = pixels.permute(0, 2, 3, 1)
    return pixels.new_empty(layout.shape).copy_(layout).mul_(255).round_().byte()


@dataclass
class GenerationResult:
    """``pixels``: (batch, 3, H, W) in [0, 1] on the CPU before 8-bit quantising; (batch, frames, 3, H, W): video."""

    pixels: torch.Tensor
    seed: int
    timings: Timings
    request: ResolvedRequest | None = None  # what ran: the request with the model's defaults filled in
    # The images' 8-bit pixels (batch, H, W, 3), rounded where they were decoded: on a GPU that takes microseconds.
    # Made from the float pixels in the process that answers, a 1024² image cost an H100 host 30 ms, against 1.8 for
    # the same arithmetic on a tensor made there (the result's pixels arrive in shared memory, first read then): a
    # quarter of the bytes to read. None: made from ``pixels``.
    rgb8: torch.Tensor | None = None

    @property
    def is_video(self) -> bool:
        return self.pixels.ndim == 5

    @property
    def images(self) -> list[Image.Image]:
        if self.rgb8 is None:
            array = rgb8_of(self.pixels.flatten(0, 1) if self.is_video else self.pixels).numpy()
        else:
            array = self.rgb8.numpy()
        return [Image.fromarray(frame) for frame in array]

    @property
    def frames(self) -> list[list[Image.Image]]:
        """Each video's frames (each image as a one-frame video)."""
        images, count = self.images, self.pixels.shape[1] if self.is_video else 1
        return [images[i : i + count] for i in range(0, len(images), count)]
