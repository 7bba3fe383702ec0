"""What a caller asks for and what it gets back.
Must not import torch (the command line reads its limits before anything heavy loads)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from PIL import Image

if TYPE_CHECKING:
    import torch

    from paradit.pipelines.requests import ResolvedRequest

SEED_LIMIT = 2**64  # seeds are torch generators' 64-bit seeds: 0 to 2**64 - 1
CACHE_METHODS = ("first-block", "mag", "taylorseer")
CACHE_THRESHOLDS = {"first-block": 0.05, "mag": 0.06}  # diffusers' defaults


@dataclass(frozen=True)
class StepCacheConfig:
    """Step caching (``--cache``): a method of ``CACHE_METHODS`` with the parameters of diffusers' config of it, by
    their names and with their defaults (``threshold``: the method's in ``CACHE_THRESHOLDS`` when unset).
    first-block reads ``threshold``; mag ``threshold``, ``max_skip_steps``, ``retention_ratio`` and ``mag_ratios`` (a
    calibrated curve, any length) or ``calibrate``; taylorseer ``cache_interval``, ``disable_cache_before_step``,
    ``disable_cache_after_step`` and ``max_order``."""

    method: str
    threshold: float | None = None
    cache_interval: int = 5
    disable_cache_before_step: int = 3
    disable_cache_after_step: int | None = None
    max_order: int = 1
    max_skip_steps: int = 3
    retention_ratio: float = 0.2
    mag_ratios: tuple[float, ...] | None = None
    calibrate: bool = False


@dataclass
class GenerationRequest:
    """One call: ``prompt`` may be a list (one batch); unset fields take the model's defaults."""

    prompt: str | list[str]
    negative_prompt: str | list[str] | None = None
    height: int | None = None
    width: int | None = None
    steps: int | None = None
    guidance: float | None = None
    seed: int | None = None
    num_images_per_prompt: int = 1
    frames: int | None = None  # video models: frames per video (the model's default when unset)
    guidance_2: float | None = None  # models with a low-noise expert: its guidance (diffusers' guidance_scale_2)
    # image-conditioned models: Wan's first frame to animate, FLUX.2's reference images (a list: several)
    image: Image.Image | list[Image.Image] | None = None
    strength: float | None = None  # image-to-image: the share of the schedule run from the noised image (0-1]
    mask: Image.Image | None = None  # inpainting: white where the image is repainted, the image's size
    fps: int | None = None  # video models: frames per second of the written file (the model's default when unset)
    # a server's named LoRA adapters for this request, with their scales (None: the engine's own; () none of them)
    lora: tuple[tuple[str, float], ...] | None = None
    cache: StepCacheConfig | None = None  # step caching (None: every step runs every block)

    @property
    def prompts(self) -> list[str]:
        return [self.prompt] if isinstance(self.prompt, str) else list(self.prompt)


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
    text_encoders: str = "gpu"  # their placement on rank 0 (text_encoder.PLACEMENTS)
    # what the request's features reported, by name: "step_cache", what step caching skipped (a CacheRecord)
    features: dict[str, Any] = field(default_factory=dict)

    @property
    def median_step_ms(self) -> float:
        """Of the steps after the first, which pays for compilation and an expert's first copy (all of one)."""
        ordered = sorted(self.step_ms[1:] or self.step_ms)
        return ordered[len(ordered) // 2] if ordered else 0.0


@dataclass
class GenerationResult:
    """``pixels``: (batch, 3, H, W) float in [0, 1] on the CPU before 8-bit quantisation, (batch, frames, 3, H, W) for
    video; ``images``: PIL, one per image or all videos' frames in order; ``frames``: each video's PIL frames."""

    pixels: torch.Tensor
    seed: int
    timings: Timings
    request: ResolvedRequest | None = None  # what ran: the request with the model's defaults filled in

    @property
    def is_video(self) -> bool:
        return self.pixels.ndim == 5

    @property
    def images(self) -> list[Image.Image]:
        pixels = self.pixels.flatten(0, 1) if self.is_video else self.pixels
        array = (pixels.permute(0, 2, 3, 1) * 255).round().byte().numpy()
        return [Image.fromarray(frame) for frame in array]

    @property
    def frames(self) -> list[list[Image.Image]]:
        """Each video's frames (an image result: each image as a one-frame video)."""
        images, count = self.images, self.pixels.shape[1] if self.is_video else 1
        return [images[i : i + count] for i in range(0, len(images), count)]
