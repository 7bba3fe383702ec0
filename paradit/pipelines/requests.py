"""Resolving a request: the checks every family shares, and what requests must share to run as one batch."""

from __future__ import annotations

import dataclasses
import math
import random
from typing import TYPE_CHECKING

from paradit.errors import InvalidRequest
from paradit.request import (
    CACHE_METHODS,
    CACHE_THRESHOLDS,
    SCHEDULERS,
    SEED_LIMIT,
    SPARSE_ATTENTIONS,
    SPARSE_PARAMETERS,
    GenerationRequest,
    ResolvedRequest,
    SparseAttentionConfig,
    StepCacheConfig,
)

if TYPE_CHECKING:
    from PIL import Image

    from paradit.spec import ModelSpec


# Bounds of what a request may ask for, where the model sets none tighter: a side far past any published model's
# training size, more steps than any schedule uses, a batch that still fits a server's queue, torch's 64-bit seeds.
MAX_SIDE = 8192
MAX_STEPS = 10_000
MAX_BATCH = 64
# float32's largest value: a guidance scale past it makes the guided step infinite in every dtype a run computes in.
MAX_GUIDANCE = 3.4028234663852886e38


def not_allowed(name: str, value, allowed: str, param: str | None = None) -> InvalidRequest:
    return InvalidRequest(f"{name} {value} is not allowed; {allowed}", param=param)


def check_text(name: str, texts: list[str]) -> None:
    """Refuse text that is not valid Unicode (a command line's undecodable bytes arrive as lone surrogates)."""
    for text in texts:
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise InvalidRequest(f"{name} is not valid UTF-8 text (at character {exc.start}); re-encode it") from None


def resolve_common(
    spec: ModelSpec,
    request: GenerationRequest,
    granularity: int,
    largest: tuple[int, int] | None = None,
    default_negative: str | None = None,
    image_limit: int = 0,
    image_to_image: bool = False,
    inpainting_strength: float | None = None,
    schedulers: tuple[str, ...] = SCHEDULERS,
) -> ResolvedRequest:
    """The checks every family makes; ``inpainting_strength``: the default strength where a mask is given."""
    prompts = request.prompts
    if not prompts or any(not isinstance(p, str) or not p.strip() for p in prompts):
        raise InvalidRequest("prompt is empty; give at least one non-empty prompt")
    check_text("prompt", prompts)
    height = spec.height if request.height is None else request.height
    width = spec.width if request.width is None else request.width
    for name, value, limit in zip(("height", "width"), (height, width), largest or (MAX_SIDE, MAX_SIDE)):
        if value < granularity or value % granularity or value > limit:
            raise not_allowed(
                name, value, f"this model takes multiples of {granularity} from {granularity} to {limit}", "size"
            )
    steps = spec.steps if request.steps is None else request.steps
    if not 1 <= steps <= MAX_STEPS:
        raise not_allowed("steps", steps, f"give 1 or more (at most {MAX_STEPS})", "steps")
    guidance = spec.guidance if request.guidance is None else float(request.guidance)
    check_guidance("guidance", guidance)
    negative = request.negative_prompt if request.negative_prompt is not None else default_negative
    negatives = None
    if negative is not None:
        negatives = [negative] if isinstance(negative, str) else list(negative)
        if any(not isinstance(n, str) for n in negatives):
            raise InvalidRequest("negative_prompt must be a string or a list of strings")
        check_text("negative_prompt", negatives)
        if len(negatives) == 1:
            negatives = negatives * len(prompts)
        if len(negatives) != len(prompts):
            raise InvalidRequest(
                f"{len(negatives)} negative prompts for {len(prompts)} prompts; give 1 or {len(prompts)}"
            )
    if not 1 <= request.num_images_per_prompt <= MAX_BATCH:
        raise not_allowed(
            "num_images_per_prompt", request.num_images_per_prompt, f"give 1 or more (at most {MAX_BATCH})"
        )
    seed = random.randrange(2**31) if request.seed is None else int(request.seed)
    if not 0 <= seed < SEED_LIMIT:
        raise not_allowed("seed", seed, f"give 0 to {SEED_LIMIT - 1} (a 64-bit generator seed)")
    images = resolve_images(spec, request.image, image_limit)
    mask = resolve_mask(spec, request.mask, images, inpainting_strength is not None)
    default_strength = DEFAULT_STRENGTH if mask is None else inpainting_strength
    strength = resolve_strength(spec, request.strength, images, image_to_image, default_strength)
    scheduler, shift = resolve_scheduler(spec, request.scheduler, request.shift, schedulers, strength is not None)
    return ResolvedRequest(
        prompts,
        negatives,
        height,
        width,
        steps,
        guidance,
        seed,
        request.num_images_per_prompt,
        images=images,
        lora=request.lora,
        strength=strength,
        mask=mask,
        cache=resolve_cache(request.cache),
        sparse_attention=resolve_sparse(request.sparse_attention),
        scheduler=scheduler,
        shift=shift,
    )


def resolve_scheduler(
    spec: ModelSpec, scheduler: str | None, shift, allowed: tuple[str, ...], from_image: bool
) -> tuple[str | None, float | None]:
    """Starting ``from_image`` takes flow-euler, whose ``scale_noise`` noises the image (the multistep solvers lack it);
    dpmpp-2m takes a dynamically shifting checkpoint's ``mu`` only as its dynamic shift."""
    if scheduler is not None:
        if scheduler not in allowed:
            raise not_allowed("scheduler", repr(scheduler), f"{spec.name} takes {', '.join(allowed)}", "scheduler")
        if from_image and scheduler != "flow-euler":
            raise InvalidRequest(
                f"scheduler {scheduler!r} does no image-to-image or inpainting; give flow-euler", param="scheduler"
            )
    if shift is None:
        return scheduler, None
    if isinstance(shift, bool) or not isinstance(shift, int | float) or not 0 < shift < math.inf:
        raise not_allowed("shift", shift, "give a finite number above 0", "shift")
    if scheduler == "dpmpp-2m" and spec.scheduler.get("use_dynamic_shifting"):
        raise InvalidRequest(
            f"scheduler 'dpmpp-2m' takes no static shift on {spec.name}, which shifts dynamically; drop the shift or "
            "give flow-euler or unipc",
            param="shift",
        )
    return scheduler, float(shift)


def resolve_cache(config: StepCacheConfig | None) -> StepCacheConfig | None:
    if config is None:
        return None
    if not isinstance(config, StepCacheConfig) or config.method not in CACHE_METHODS:
        method = getattr(config, "method", config)
        raise InvalidRequest(
            f"unknown cache method {method!r}; choose one of {', '.join(CACHE_METHODS)}", param="cache"
        )
    threshold = CACHE_THRESHOLDS.get(config.method) if config.threshold is None else config.threshold
    bounds = {
        "threshold": (threshold, 0, None),
        "cache_interval": (config.cache_interval, 1, None),
        "disable_cache_before_step": (config.disable_cache_before_step, 0, None),
        "disable_cache_after_step": (config.disable_cache_after_step, 0, None),
        "max_order": (config.max_order, 0, None),
        "max_skip_steps": (config.max_skip_steps, 0, None),
        "retention_ratio": (config.retention_ratio, 0, 1),
    }
    for name, (value, low, high) in bounds.items():
        if value is not None and not (low <= value and (high is None or value <= high) and math.isfinite(value)):
            allowed = f"{low} to {high}" if high is not None else f"{low} or more"
            raise not_allowed(f"cache: {name}", value, f"give {allowed}", "cache")
    if config.method == "mag" and not config.calibrate:
        ratios = config.mag_ratios
        if not ratios or not all(isinstance(r, int | float) and math.isfinite(r) and r > 0 for r in ratios):
            raise InvalidRequest(
                "cache mag needs its model's magnitude ratios (mag_ratios: positive numbers, one a "
                "step); measure them with --cache mag --cache-calibrate",
                param="cache",
            )
    return dataclasses.replace(config, threshold=threshold)


def _count(least: int):
    return lambda value: isinstance(value, int) and not isinstance(value, bool) and value >= least


def _above_zero(value) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and 0 < value < math.inf


# What each sparse parameter takes, as its --sparse-* flag does.
SPARSE_BOUNDS = {
    "dense_steps": (_count(0), "a whole number, 0 or more"),
    "dense_blocks": (_count(0), "a whole number, 0 or more"),
    "decay_factor": (_above_zero, "a number above 0"),
    "query_clusters": (_count(1), "a whole number, 1 or more"),
    "key_clusters": (_count(1), "a whole number, 1 or more"),
    "top_p": (lambda value: _above_zero(value) and value <= 1, "a share above 0 and at most 1"),
}


def resolve_sparse(config: SparseAttentionConfig | None) -> SparseAttentionConfig | None:
    """A request's own sparse attention, checked as the run's ``--sparse-*`` options are."""
    if config is None:
        return None
    if not isinstance(config, SparseAttentionConfig) or config.method not in SPARSE_ATTENTIONS:
        method = getattr(config, "method", config)
        raise InvalidRequest(
            f"sparse_attention: unknown method {method!r}; choose one of {', '.join(SPARSE_ATTENTIONS)}",
            param="sparse_attention",
        )
    read = SPARSE_PARAMETERS[config.method]
    for name, value in config.parameters().items():
        if name not in read:
            raise InvalidRequest(
                f"sparse_attention: {name} is not a parameter of {config.method}, which reads {', '.join(read)}",
                param="sparse_attention",
            )
        takes, allowed = SPARSE_BOUNDS[name]
        if not takes(value):
            raise not_allowed(f"sparse_attention: {name}", value, f"give {allowed}", "sparse_attention")
    return config


def resolve_mask(spec: ModelSpec, mask, images: tuple, inpaints: bool):
    """Grayscale as diffusers' mask processor reads it, covering the image it masks pixel for pixel."""
    from PIL import Image

    from paradit.outputs import rgb_image

    if mask is None:
        return None
    if not inpaints:
        raise InvalidRequest(f"{spec.name} does no inpainting; drop the mask", param="mask")
    if not images:
        raise InvalidRequest("a mask needs the image it masks (--image)", param="mask")
    if not isinstance(mask, Image.Image):
        raise InvalidRequest(f"the mask must be a PIL image, not {type(mask).__name__}", param="mask")
    mask = rgb_image(mask, "the mask").convert("L")
    if mask.size != images[0].size:
        raise InvalidRequest(
            f"the mask is {mask.width}x{mask.height} and the image {images[0].width}x"
            f"{images[0].height}; give a mask of the image's size",
            param="mask",
        )
    return mask


def resolve_strength(spec: ModelSpec, strength, images: tuple, image_to_image: bool, default: float) -> float | None:
    if not image_to_image or not images:
        if strength is not None:
            takes = "an image (--image) to start from" if image_to_image else "no strength: it does no image-to-image"
            raise InvalidRequest(f"strength applies to image-to-image; {spec.name} takes {takes}", param="strength")
        return None
    strength = default if strength is None else strength
    if isinstance(strength, bool) or not isinstance(strength, int | float) or not 0 < strength <= 1:
        allowed = "give a number above 0 and at most 1 (the share of the steps run from the noised image)"
        raise not_allowed("strength", strength, allowed, "strength")
    return float(strength)


def first_step(request: ResolvedRequest) -> int:
    """The step image-to-image starts at, as diffusers' ``get_timesteps`` counts it."""
    return int(max(request.steps - min(request.steps * request.strength, request.steps), 0))


DEFAULT_STRENGTH = 0.6  # diffusers' image-to-image pipelines' default (their inpainting pipelines' differ by model)


def resolve_images(spec: ModelSpec, image, limit: int) -> tuple[Image.Image, ...]:
    """A request's input image or list of them, RGB as diffusers' ``load_image`` gives them."""
    from PIL import Image

    from paradit.outputs import rgb_image

    images = [] if image is None else list(image) if isinstance(image, list | tuple) else [image]
    if len(images) > limit:
        takes = "no input image" if not limit else f"at most {limit} input image{'s' * (limit > 1)}"
        raise InvalidRequest(f"{spec.name} takes {takes}; {len(images)} given", param="image")
    for index, item in enumerate(images):
        if not isinstance(item, Image.Image):
            raise InvalidRequest(f"image {index + 1} must be a PIL image, not {type(item).__name__}", param="image")
    return tuple(rgb_image(item, f"image {index + 1}") for index, item in enumerate(images))


def check_guidance(name: str, value: float | None) -> None:
    if value is not None and not 0 <= value <= MAX_GUIDANCE:  # NaN fails both comparisons
        raise not_allowed(name, value, f"give a finite value >= 0 (at most {MAX_GUIDANCE:.3g})", name)


BATCH_FIELDS = (
    "height",
    "width",
    "steps",
    "guidance",
    "guidance_2",
    "frames",
    "lora",
    "cache",
    "sparse_attention",
    "scheduler",
    "shift",
)


def batch_key(request: ResolvedRequest) -> tuple | None:
    """What one batch's requests share: all but prompts, seeds and image counts (None: one with images, run alone)."""
    if request.images:
        return None
    return (request.negative_prompts is None, *(getattr(request, name) for name in BATCH_FIELDS))


def one_batch(parts: list[ResolvedRequest]) -> ResolvedRequest:
    """Requests of one ``batch_key`` as one request of one prompt per image (each request keeps its image count)."""
    if len(parts) == 1:
        return parts[0]
    if len({batch_key(part) for part in parts}) > 1 or batch_key(parts[0]) is None:
        raise InvalidRequest(
            "requests batched together must share size, steps, guidance, frames, adapters, caching, sparse attention, "
            "scheduler, shift and the use of a negative prompt, and give no image"
        )

    def per_image(field: str) -> list[str]:
        return [text for part in parts for text in getattr(part, field) for _ in range(part.images_per_prompt)]

    negatives = per_image("negative_prompts") if parts[0].negative_prompts is not None else None
    return dataclasses.replace(parts[0], prompts=per_image("prompts"), negative_prompts=negatives, images_per_prompt=1)
