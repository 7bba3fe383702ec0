"""What every family's pipeline shares: request checks, the pipeline skeleton (``DiffusionPipeline``, whose hooks
each family implements), and the clocks that time the denoise loop without stalling the device.

Names no family and no parallel strategy: the parallel runtime hands a pipeline what it needs (``Parallelized``).
"""

from __future__ import annotations

import dataclasses
import math
import random
import resource
import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from torch import nn

from paradit.errors import InvalidRequest
from paradit.expert_swap import ExpertSwap
from paradit.parallel.cfg import BatchedBranches, SplitBranches
from paradit.parallel.mesh import ParallelContext
from paradit.parallel.parallelize import NoisePredictor, Parallelized
from paradit.request import GenerationRequest, GenerationResult, Timings
from paradit.spec import ModelSpec
from paradit.weights import component_dir

if TYPE_CHECKING:
    from PIL import Image


class StepClock:
    """Per-step durations. On accelerators it records events and reads them once at the end, so timing the loop
    adds no host synchronisation inside it; on the CPU the wall clock is the truth."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.use_events = device.type == "cuda"
        self.marks: list = []

    def mark(self) -> None:
        if self.use_events:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self.marks.append(event)
        else:
            self.marks.append(time.perf_counter())

    def durations_ms(self) -> list[float]:
        if self.use_events:
            self.marks[-1].synchronize()
            return [a.elapsed_time(b) for a, b in zip(self.marks, self.marks[1:])]
        return [(b - a) * 1000 for a, b in zip(self.marks, self.marks[1:])]


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def reset_peak_memory(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def peak_memory(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    # ru_maxrss is KiB on Linux: the process's peak resident memory, the CPU's closest equivalent.
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def record_peak_memory(timings: Timings, device: torch.device) -> None:
    timings.peak_memory_bytes = peak_memory(device)
    timings.peak_memory_kind = "device" if device.type == "cuda" else "process RSS"
    if timings.peak_memory_per_rank:  # rank 0 decodes after the others reported: its own peak is final only now
        timings.peak_memory_per_rank[0] = timings.peak_memory_bytes


@dataclasses.dataclass
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
    image: Image.Image | None = None  # image-to-video families: the first frame, RGB
    fps: int | None = None  # video families: frames per second of the written file

    @property
    def batch(self) -> int:
        return len(self.prompts) * self.images_per_prompt


# Bounds of what a request may ask for, where the model sets none tighter: a side far past any published model's
# training size, more steps than any schedule uses, a batch that still fits a server's queue, torch's 64-bit seeds.
MAX_SIDE = 8192
MAX_STEPS = 10_000
MAX_BATCH = 64
SEED_LIMIT = 2**64


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
) -> ResolvedRequest:
    """The checks every family makes (prompts, size in steps of ``granularity`` up to ``largest`` (height, width),
    steps, guidance, negative prompts, images per prompt, seed), raising InvalidRequest with the allowed values."""
    prompts = request.prompts
    if not prompts or any(not isinstance(p, str) or not p.strip() for p in prompts):
        raise InvalidRequest("prompt is empty; give at least one non-empty prompt")
    check_text("prompt", prompts)
    height = spec.height if request.height is None else request.height
    width = spec.width if request.width is None else request.width
    for index, (name, value) in enumerate((("height", height), ("width", width))):
        limit = largest[index] if largest else MAX_SIDE
        if value < granularity or value % granularity or value > limit:
            raise InvalidRequest(
                f"{name} {value} is not allowed; this model takes multiples of {granularity} from {granularity} to "
                f"{limit}"
            )
    steps = spec.steps if request.steps is None else request.steps
    if not 1 <= steps <= MAX_STEPS:
        raise InvalidRequest(f"steps {steps} is not allowed; give 1 or more (at most {MAX_STEPS})")
    guidance = spec.guidance if request.guidance is None else float(request.guidance)
    if guidance is not None and not 0 <= guidance < math.inf:  # NaN fails both comparisons
        raise InvalidRequest(f"guidance {guidance} is not allowed; give a finite value >= 0")
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
        raise InvalidRequest(
            f"num_images_per_prompt {request.num_images_per_prompt} is not allowed; give 1 or more (at most "
            f"{MAX_BATCH})"
        )
    seed = random.randrange(2**31) if request.seed is None else int(request.seed)
    if not 0 <= seed < SEED_LIMIT:
        raise InvalidRequest(f"seed {seed} is not allowed; give 0 to {SEED_LIMIT - 1} (a 64-bit generator seed)")
    return ResolvedRequest(prompts, negatives, height, width, steps, guidance, seed, request.num_images_per_prompt)


def seeded_noise(shape: tuple[int, ...], seed: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Noise as diffusers draws it: one CPU generator seeded with ``seed`` for the whole batch, then moved."""
    generator = torch.Generator("cpu").manual_seed(seed)
    return torch.randn(shape, generator=generator, dtype=dtype).to(device)


def random_vae(build, config: dict, device: torch.device, dtype: torch.dtype) -> nn.Module:
    """A diffusers VAE (``build(config)``: its class or ``from_config``) with seeded random weights (dummy load),
    leaving the caller's random state alone."""
    with torch.random.fork_rng(devices=[]), torch.device(device):
        torch.manual_seed(0)
        vae = build(config)
    # nn.Module.to, not ModelMixin.to: the latter only adds a warning about fp32-pinned modules these VAEs lack.
    return nn.Module.to(vae, dtype)


class DiffusionPipeline(ABC):
    """The skeleton every family shares: text conditioning encoded once per group (on rank 0, which alone holds the
    prompt encoders and the VAE) and shared, the denoise loop the parallel runtime chose, decoding on rank 0,
    timings. A family implements the abstract hooks and names in ``CONDITIONING`` the tensors its encoding makes.
    """

    CONDITIONING: ClassVar[tuple[str, ...]] = ()
    DIFFUSERS_PIPELINES: ClassVar[tuple[str, ...]] = ()  # the diffusers pipeline classes whose checkpoints it serves
    VAE: ClassVar[type]  # the diffusers autoencoder class of the family's ``vae/`` component
    VIDEO: ClassVar[bool] = False  # whether ``decode`` gives videos (batch, frames, 3, H, W) rather than images

    def __init__(self, spec: ModelSpec, transformer: Parallelized, prompt_encoder, vae, device: torch.device,
                 dtype: torch.dtype, parallel: ParallelContext | None = None,
                 experts: dict[str, Parallelized] | None = None,
                 expert_swap: ExpertSwap | None = None) -> None:  # fmt: skip
        """In a group, only rank 0 holds the prompt encoder (None elsewhere); every rank holds the VAE, so that the
        group decodes together. ``experts``: the further transformers ``expert_configs`` asked for, by component;
        ``expert_swap``, when they take turns on the device (``transformer`` first), what swaps them."""
        self.spec = spec
        self.parallelized = transformer
        self.transformer = transformer.forward
        self.experts = experts or {}
        self.expert_swap = expert_swap
        self.prompt_encoder = prompt_encoder
        self.vae = vae
        self.device = device
        self.dtype = dtype
        self.parallel = parallel

    @staticmethod
    @abstractmethod
    def spec_from_folder(folder: Path, index: dict[str, Any]) -> ModelSpec:
        """The ModelSpec of a checkpoint folder whose ``model_index.json`` (``index``) names one of
        ``DIFFUSERS_PIPELINES``: architecture from its configs, defaults from the diffusers pipeline."""

    @staticmethod
    @abstractmethod
    def resolve_request(spec: ModelSpec, request: GenerationRequest) -> ResolvedRequest:
        """The request with defaults filled in, or an InvalidRequest naming what is wrong and what is allowed
        (before anything loads)."""

    @staticmethod
    @abstractmethod
    def uses_cfg(spec: ModelSpec, request: ResolvedRequest) -> bool:
        """Whether the resolved request runs classifier-free guidance (two branches a step), by diffusers' rule."""

    @classmethod
    @abstractmethod
    def build_transformer(cls, spec: ModelSpec) -> nn.Module:
        """The plain transformer (built on the meta device by the loader)."""

    @classmethod
    def sequence_tokens(cls, spec: ModelSpec) -> int:
        """Tokens one sample's blocks work on at ``spec``'s size (the memory estimate's measure): an image family's
        latent patches (1/16 of the pixels per side) and a text of 512 tokens."""
        return spec.height * spec.width // 256 + 512

    @classmethod
    def expert_configs(cls, spec: ModelSpec) -> dict[str, dict]:
        """Further transformers the pipeline runs besides ``transformer`` (a low-noise expert, say): checkpoint
        component name -> its config, built by ``build_transformer`` and parallelized like the first. None by
        default."""
        return {}

    @classmethod
    @abstractmethod
    def load_prompt_encoder(cls, spec: ModelSpec, device: torch.device, dtype: torch.dtype, dummy: bool,
                            placement: str = "gpu") -> Any:  # fmt: skip
        """The prompt encoder(s), placed as ``placement`` says (``text_encoder.PLACEMENTS``): read from
        ``spec.folder``, or random (``dummy``; on the meta device for memory estimates)."""

    @classmethod
    def load_vae(cls, spec: ModelSpec, device: torch.device, dtype: torch.dtype, dummy: bool) -> nn.Module:
        """The family's ``VAE``, read from ``spec.folder`` or random (``dummy``)."""
        if dummy:
            return random_vae(cls.VAE.from_config, spec.vae, device, dtype)
        return cls.VAE.from_pretrained(component_dir(spec.folder, "vae"), dtype=dtype)

    @abstractmethod
    def encode(self, request: ResolvedRequest) -> dict[str, torch.Tensor]:
        """The ``CONDITIONING`` tensors of the request's prompts (rank 0 only)."""

    @abstractmethod
    def initial_latents(self, request: ResolvedRequest) -> tuple[torch.Tensor, Any]:
        """Seeded noise as diffusers draws it, and whatever layout ``predictor`` and ``decode`` need."""

    @abstractmethod
    def make_scheduler(self, request: ResolvedRequest, latents: torch.Tensor) -> tuple[Any, torch.Tensor]:
        """The diffusers scheduler, its timesteps set."""

    @abstractmethod
    def predictor(self, request: ResolvedRequest, conditioning: dict[str, torch.Tensor], layout) -> NoisePredictor:
        """``predict(latents, t, transformer)``: the guided noise prediction, calling ``transformer`` like the
        model. Its work after the transformer must treat output rows independently (PipeFusion's patch loop)."""

    @abstractmethod
    def decode(self, latents: torch.Tensor, layout) -> torch.Tensor:
        """Pixels in [0, 1], (batch, 3, H, W); for a ``VIDEO`` family (batch, frames, 3, H, W)."""

    @classmethod  # noqa: B027 - a hook most families leave as it is
    def after_dummy_init(cls, transformer: nn.Module) -> None:
        """Random weights are complete for most models; a model with fixed buffers fills them here."""

    def band_mask(self, latents: torch.Tensor, start: int, stop: int) -> torch.Tensor:
        """Which latent elements rows ``start:stop`` of the transformer's output stream become (PipeFusion updates
        the latents band by band): packed latents, one token per row, unless a family says otherwise."""
        return token_band_mask(latents, start, stop)

    def branches(self, cfg: bool) -> BatchedBranches | SplitBranches:
        """The guidance branches this rank computes of the [conditional; unconditional] rows (every row without
        CFG)."""
        return self.parallelized.branches if cfg else BatchedBranches()

    def vae_decode(self, latents: torch.Tensor) -> torch.Tensor:
        """``self.vae.decode(latents)``'s sample, computed by the whole group when there is one."""
        return self.parallelized.vae_decode(self.vae, latents)

    def vae_encode(self, images: torch.Tensor):
        """``self.vae.encode(images).latent_dist``, computed by the whole group when there is one."""
        return self.parallelized.vae_encode(self.vae, images)

    def resolve(self, request: GenerationRequest) -> ResolvedRequest:
        return self.resolve_request(self.spec, request)

    def conditioning(self, request: ResolvedRequest) -> dict[str, torch.Tensor]:
        """The family's prompt encoding on rank 0, shared with the group tensor by tensor."""
        encoded = self.encode(request) if self.prompt_encoder is not None else {}
        if self.parallel is None:
            return encoded
        return {name: self.parallel.share_from_leader(encoded.get(name)) for name in self.CONDITIONING}

    def generate(
        self,
        request: GenerationRequest | list[GenerationRequest],
        progress: bool = False,
        on_step: Callable[[int], None] | None = None,
    ) -> GenerationResult | list[GenerationResult] | None:
        """The images on the rank that decodes (rank 0 of the group); None on the other ranks.

        A list of requests that differ only in prompts, seeds and image counts runs as one batch and gives one result
        per request, its noise drawn from its own seed as if it ran alone. ``on_step(k)`` is called when k steps are
        done (k = 0 before the first); it may raise to stop the request between steps, which in a group every rank
        must do at the same k."""
        parts = [self.resolve(r) for r in (request if isinstance(request, list) else [request])]
        resolved = parts[0]
        if len(parts) > 1:
            shared = {(p.height, p.width, p.steps, p.guidance, p.guidance_2, p.frames, p.negative_prompts is None)
                      for p in parts}  # fmt: skip
            if len(shared) > 1 or any(p.image is not None for p in parts):
                raise InvalidRequest(
                    "requests batched together must share size, steps, guidance, frames and the use of a negative "
                    "prompt, and give no image"
                )
            # One prompt per image, so that each request keeps its own image count.
            resolved = dataclasses.replace(
                resolved,
                prompts=[text for p in parts for text in p.prompts for _ in range(p.images_per_prompt)],
                negative_prompts=None if resolved.negative_prompts is None else [
                    text for p in parts for text in p.negative_prompts for _ in range(p.images_per_prompt)
                ],
                images_per_prompt=1,
            )  # fmt: skip
        timings = Timings()
        stats = self.parallel.stats if self.parallel else None
        if stats:
            stats.reset()
        loop = self.parallelized.loop
        loop.begin_request()
        for expert in self.experts.values():
            expert.loop.begin_request()
        reset_peak_memory(self.device)
        start = time.perf_counter()
        conditioning = self.conditioning(resolved)
        synchronize(self.device)
        timings.text_encode_s = time.perf_counter() - start

        noise = [self.initial_latents(part) for part in parts]
        latents, layout = torch.cat([latents for latents, _ in noise]), noise[0][1]
        scheduler, timesteps = self.make_scheduler(resolved, latents)
        clock = StepClock(self.device)

        def mark_step() -> None:
            clock.mark()
            if on_step is not None:
                on_step(len(clock.marks) - 1)

        predict = self.predictor(resolved, conditioning, layout)
        if stats:
            stats.phase = "denoise"
        latents = loop.run(predict, self.transformer, scheduler, latents, timesteps, self.band_mask, mark_step,
                           progress)  # fmt: skip
        timings.step_ms = clock.durations_ms()
        if stats:
            stats.phase = "decode"
            timings.comm_bytes_per_step = stats.bytes_sent["denoise"] // len(timesteps)
        decode_start = time.perf_counter()
        pixels = self.decode(latents, layout).float().cpu()
        timings.vae_decode_s = time.perf_counter() - decode_start
        if self.parallel is not None:
            timings.peak_memory_per_rank = self.parallel.gather_int(peak_memory(self.device))
            if not self.parallel.is_leader:
                return None
        timings.total_s = time.perf_counter() - start
        record_peak_memory(timings, self.device)
        results = [
            GenerationResult(pixels=images, seed=part.seed, timings=timings)
            for part, images in zip(parts, pixels.split([part.batch for part in parts]))
        ]
        return results if isinstance(request, list) else results[0]


def token_band_mask(latents: torch.Tensor, start: int, stop: int) -> torch.Tensor:
    """Packed latents (batch, tokens, channels), one token per output-stream row."""
    mask = torch.zeros(latents.shape[1], dtype=torch.bool, device=latents.device)
    mask[start:stop] = True
    return mask.view(1, -1, 1)


def patch_grid_band_mask(latents: torch.Tensor, patch: int, start: int, stop: int) -> torch.Tensor:
    """Image latents (batch, channels, height, width) whose output-stream rows are ``patch`` x ``patch`` squares in
    row-major order; rows past the grid (a stream's pad tokens) cover no latent."""
    rows, cols = latents.shape[-2] // patch, latents.shape[-1] // patch
    tokens = torch.arange(rows * cols, device=latents.device)
    grid = ((tokens >= start) & (tokens < stop)).view(rows, cols)
    grid = grid.repeat_interleave(patch, 0).repeat_interleave(patch, 1)
    return grid.view(1, 1, *grid.shape)


def cfg_step_inputs(branches, cfg: bool, latents: torch.Tensor, timestep: torch.Tensor):
    """This rank's rows of the [conditional; unconditional] model input and timesteps (everything when no CFG)."""
    if not cfg:
        return latents, timestep
    return branches.local(torch.cat([latents, latents])), branches.local(torch.cat([timestep, timestep]))
