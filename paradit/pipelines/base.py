"""What every family's pipeline shares: request checks, the pipeline skeleton (``DiffusionPipeline``), the denoise
loop, and the clocks that time it without stalling the device.
"""

from __future__ import annotations

import dataclasses
import random
import resource
import sys
import time
from collections.abc import Callable

import torch
from torch import nn
from tqdm import tqdm

from paradit.errors import InvalidRequest
from paradit.layers.fp8 import fp8_dtype
from paradit.parallel.mesh import ParallelContext
from paradit.parallel.pipefusion import PipeFusion, parallelize_pipefusion
from paradit.parallel.sequence import parallelize_sequence
from paradit.parallel.tensor import parallelize_tensor, tensor_slices
from paradit.pipelines.patch_loop import denoise_by_patches, token_band_mask
from paradit.quantize import fp8_load
from paradit.request import GenerationRequest, GenerationResult, Timings
from paradit.spec import ModelSpec
from paradit.weights import (
    CheckpointTensors,
    DummyTensors,
    ModelNames,
    component_dir,
    materialize,
    safetensors_files,
)

NoisePredictor = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


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


def denoise(
    predict: NoisePredictor,
    scheduler,
    latents: torch.Tensor,
    timesteps: torch.Tensor,
    clock: StepClock,
    progress: bool,
) -> torch.Tensor:
    """Run the scheduler over ``timesteps``; ``predict(latents, t)`` returns the (guided) noise prediction."""
    clock.mark()
    for t in tqdm(timesteps, desc="denoise", unit="step", disable=not progress, file=sys.stderr, leave=False):
        latents = scheduler.step(predict(latents, t), t, latents, return_dict=False)[0]
        clock.mark()
    return latents


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

    @property
    def batch(self) -> int:
        return len(self.prompts) * self.images_per_prompt


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
    height = spec.height if request.height is None else request.height
    width = spec.width if request.width is None else request.width
    for index, (name, value) in enumerate((("height", height), ("width", width))):
        limit = largest[index] if largest else None
        if value < granularity or value % granularity or (limit and value > limit):
            allowed = f"from {granularity} to {limit}" if limit else f"(>= {granularity})"
            raise InvalidRequest(
                f"{name} {value} is not allowed; this model takes multiples of {granularity} {allowed}"
            )
    steps = spec.steps if request.steps is None else request.steps
    if steps < 1:
        raise InvalidRequest(f"steps {steps} is not allowed; give 1 or more")
    guidance = spec.guidance if request.guidance is None else float(request.guidance)
    if guidance is not None and guidance < 0:
        raise InvalidRequest(f"guidance {guidance} is not allowed; give a value >= 0")
    negative = request.negative_prompt if request.negative_prompt is not None else default_negative
    negatives = None
    if negative is not None:
        negatives = [negative] if isinstance(negative, str) else list(negative)
        if any(not isinstance(n, str) for n in negatives):
            raise InvalidRequest("negative_prompt must be a string or a list of strings")
        if len(negatives) == 1:
            negatives = negatives * len(prompts)
        if len(negatives) != len(prompts):
            raise InvalidRequest(
                f"{len(negatives)} negative prompts for {len(prompts)} prompts; give 1 or {len(prompts)}"
            )
    if request.num_images_per_prompt < 1:
        raise InvalidRequest(f"num_images_per_prompt {request.num_images_per_prompt} is not allowed; give 1 or more")
    seed = random.randrange(2**31) if request.seed is None else int(request.seed)
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


class DiffusionPipeline:
    """The skeleton every family shares: loading (every rank the transformer, rank 0 alone the prompt encoder and
    the VAE), text conditioning encoded once per group and shared, the denoise loop, decoding on rank 0, timings.

    A family supplies ``CONDITIONING`` (the names of the tensors its prompt encoding produces) and the hooks:
    ``build_transformer``, ``load_conditioners`` (the prompt encoders, placed as asked, and the VAE), ``resolve``,
    ``encode``, ``initial_latents``, ``make_scheduler``, ``predictor`` and ``decode``; ``after_dummy_init`` where
    random weights need more than ``DummyTensors``.
    """

    CONDITIONING: tuple[str, ...] = ()

    def __init__(self, spec: ModelSpec, transformer: nn.Module, prompt_encoder, vae, device: torch.device,
                 dtype: torch.dtype, parallel: ParallelContext | None = None) -> None:  # fmt: skip
        """In a group, only rank 0 holds the prompt encoder and the VAE (None elsewhere)."""
        self.spec = spec
        self.transformer = transformer
        self.prompt_encoder = prompt_encoder
        self.vae = vae
        self.device = device
        self.dtype = dtype
        self.parallel = parallel

    @classmethod
    def load(
        cls,
        spec: ModelSpec,
        device: torch.device,
        dtype: torch.dtype,
        dummy: bool,
        parallel: ParallelContext | None = None,
        quantize: str = "none",
        text_encoder_placement: str = "gpu",
    ) -> DiffusionPipeline:
        """``quantize``: see ``load_transformer``. ``text_encoder_placement`` (one of ``text_encoder.PLACEMENTS``): how
        rank 0 holds the prompt encoders."""
        transformer = cls.load_transformer(spec, device, dtype, dummy, parallel, quantize)
        if parallel is not None and not parallel.is_leader:
            return cls(spec, transformer, None, None, device, dtype, parallel)
        prompt_encoder, vae = cls.load_conditioners(spec, device, dtype, dummy, placement=text_encoder_placement)
        vae = vae.to(device).eval().requires_grad_(False)
        return cls(spec, transformer, prompt_encoder, vae, device, dtype, parallel)

    @classmethod
    def load_transformer(
        cls,
        spec: ModelSpec,
        device: torch.device,
        dtype: torch.dtype,
        dummy: bool,
        parallel: ParallelContext | None = None,
        quantize: str = "none",
    ) -> nn.Module:
        """This rank's transformer, parallelized: built and parallelized on the meta device, then only the tensors
        (and tensor-parallel slices) the rank kept are read or drawn. ``quantize="fp8"`` converts the quantizable
        linears as they load; an FP8 checkpoint's linears load as FP8 whatever ``quantize`` says. No check that
        FP8 can run here: converting on the CPU is allowed (``ExecutionOptions.validate`` guards execution)."""
        with torch.device("meta"):
            plain = cls.build_transformer(spec).eval()
        names = ModelNames(plain)
        transformer, slices = plain, {}
        if parallel is not None:
            # Tensor first: it shards the plain model's linears, which the sequence wrapper then runs unchanged.
            # PipeFusion last: its stages are sequence-parallel groups, each patch split across one.
            if parallel.config.tensor > 1:
                slices = tensor_slices(plain, parallel.config.tensor, parallel.local_rank("tensor"))
                transformer = parallelize_tensor(transformer, parallel)
            transformer = parallelize_sequence(transformer, parallel)
            transformer = parallelize_pipefusion(transformer, parallel)
        fp8 = fp8_load(transformer, names, spec.transformer, quantize, fp8_dtype(device))
        # A folder written by ``paradit quantize`` for a preset holds the transformer alone, read even when the
        # rest of the pipeline is random.
        component = spec.extra.get("transformer_folder")
        if component is None and not dummy:
            component = component_dir(spec.extra["folder"], "transformer")
        if component is None:
            buffers = {name for name, _ in plain.named_buffers()}
            materialize(transformer, names, DummyTensors(device, dtype, buffers), slices, fp8)
            cls.after_dummy_init(plain)
        else:
            source = CheckpointTensors(safetensors_files(component), device, dtype)
            try:
                materialize(transformer, names, source, slices, fp8)
            finally:
                source.close()
        return transformer

    @classmethod
    def after_dummy_init(cls, transformer: nn.Module) -> None:
        """Random weights are complete for most models; a model with fixed buffers fills them here."""

    def band_mask(self, latents: torch.Tensor, start: int, stop: int) -> torch.Tensor:
        """Which latent elements rows ``start:stop`` of the transformer's output stream become (PipeFusion updates
        the latents band by band): packed latents, one token per row, unless a family says otherwise."""
        return token_band_mask(latents, start, stop)

    def conditioning(self, request: ResolvedRequest) -> dict[str, torch.Tensor]:
        """The family's prompt encoding on rank 0, shared with the group tensor by tensor."""
        encoded = self.encode(request) if self.prompt_encoder is not None else {}
        if self.parallel is None:
            return encoded
        return {name: self.parallel.share_from_leader(encoded.get(name)) for name in self.CONDITIONING}

    def generate(self, request: GenerationRequest, progress: bool = False) -> GenerationResult | None:
        """The images on the rank that decodes (rank 0 of the group); None on the other ranks."""
        resolved = self.resolve(request)
        timings = Timings()
        stats = self.parallel.stats if self.parallel else None
        if stats:
            stats.reset()
        for module in self.transformer.modules():  # PipeFusion's step count decides warm-up and patched steps
            if isinstance(module, PipeFusion):
                module.begin_request()
        reset_peak_memory(self.device)
        start = time.perf_counter()
        conditioning = self.conditioning(resolved)
        synchronize(self.device)
        timings.text_encode_s = time.perf_counter() - start

        latents, layout = self.initial_latents(resolved)
        scheduler, timesteps = self.make_scheduler(resolved, latents)
        clock = StepClock(self.device)
        predict = self.predictor(resolved, conditioning, layout)
        if stats:
            stats.phase = "denoise"
        pipefusion = next((m for m in self.transformer.modules() if isinstance(m, PipeFusion)), None)
        if pipefusion is not None and pipefusion.patches > 1:
            latents = denoise_by_patches(
                predict, scheduler, latents, timesteps, pipefusion, self.band_mask, clock.mark, progress
            )
        else:
            latents = denoise(predict, scheduler, latents, timesteps, clock, progress)
        timings.step_ms = clock.durations_ms()
        if stats:
            stats.phase = "decode"
            timings.comm_bytes_per_step = stats.bytes_sent["denoise"] // len(timesteps)
        if self.parallel is not None:
            timings.peak_memory_per_rank = self.parallel.gather_int(peak_memory(self.device))
        if self.vae is None:
            return None

        decode_start = time.perf_counter()
        pixels = self.decode(latents, layout).float().cpu()
        timings.vae_decode_s = time.perf_counter() - decode_start
        timings.total_s = time.perf_counter() - start
        record_peak_memory(timings, self.device)
        return GenerationResult(pixels=pixels, seed=resolved.seed, timings=timings)


def cfg_step_inputs(branches, cfg: bool, latents: torch.Tensor, timestep: torch.Tensor):
    """This rank's rows of the [conditional; unconditional] model input and timesteps (everything when no CFG)."""
    if not cfg:
        return latents, timestep
    return branches.local(torch.cat([latents, latents])), branches.local(torch.cat([timestep, timestep]))
