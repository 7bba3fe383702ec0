"""What every family's pipeline shares: the skeleton, noise, timestep shift, VAE and step clocks; it names no family."""

from __future__ import annotations

import inspect
import math
import resource
import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from diffusers import DPMSolverMultistepScheduler, FlowMatchEulerDiscreteScheduler, UniPCMultistepScheduler
from torch import nn

from paradit.checkpoint import component_dir
from paradit.device_memory import unmap_free
from paradit.errors import NonFinitePrediction
from paradit.expert_swap import ExpertSwap
from paradit.parallel.cfg import BatchedBranches
from paradit.parallel.comm import CommStats
from paradit.parallel.mesh import ParallelContext
from paradit.parallel.parallelize import NoisePredictor
from paradit.pipelines.inpainting import ImageToImage, latent_mask
from paradit.pipelines.requests import one_batch
from paradit.pipelines.step_cache import StepCaching
from paradit.request import GenerationResult, ResolvedRequest, Timings, rgb8_of
from paradit.request_hooks import Denoise, RequestHook
from paradit.spec import ModelSpec

if TYPE_CHECKING:
    from paradit.family import Family
    from paradit.runtime import Runtime

# ``--scheduler``'s choices: the class and the config it takes over the checkpoint's, as one swaps it into diffusers'.
FLOW_SOLVER = {"prediction_type": "flow_prediction", "use_flow_sigmas": True}
SCHEDULER_CHOICES = {
    "flow-euler": (FlowMatchEulerDiscreteScheduler, {}),
    "unipc": (UniPCMultistepScheduler, FLOW_SOLVER),
    "dpmpp-2m": (DPMSolverMultistepScheduler, {**FLOW_SOLVER, "algorithm_type": "dpmsolver++", "solver_order": 2}),
}

ModelCall = Callable[[Callable[..., torch.Tensor], torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


class StepClock:
    """Per-step durations: events read once at the end on accelerators (no host sync in the loop); else wall clock."""

    def __init__(self, device: torch.device) -> None:
        self.use_events = device.type == "cuda"
        self.marks: list = []

    def mark(self) -> None:
        if self.use_events:
            self.marks.append(torch.cuda.Event(enable_timing=True))
            self.marks[-1].record()
        else:
            self.marks.append(time.perf_counter())

    def durations_ms(self) -> list[float]:
        if self.use_events:
            self.marks[-1].synchronize()
            return [a.elapsed_time(b) for a, b in zip(self.marks, self.marks[1:])]
        return [(b - a) * 1000 for a, b in zip(self.marks, self.marks[1:])]


def peak_memory(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    # ru_maxrss is KiB on Linux: the process's peak resident memory, the CPU's closest equivalent.
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def seeded_noise(shape: tuple[int, ...], seed: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Noise as diffusers draws it: one CPU generator seeded with ``seed`` for the whole batch, then moved."""
    return torch.randn(shape, generator=torch.Generator("cpu").manual_seed(seed), dtype=dtype).to(device)


def dynamic_shift(image_tokens: int, scheduler_config: dict) -> float:
    """diffusers' ``calculate_shift``, its intercept first as there (the other order differs in the last bit)."""
    base_len, max_len = scheduler_config.get("base_image_seq_len", 256), scheduler_config.get("max_image_seq_len", 4096)
    base_shift = scheduler_config.get("base_shift", 0.5)
    slope = (scheduler_config.get("max_shift", 1.15) - base_shift) / (max_len - base_len)
    return image_tokens * slope + (base_shift - slope * base_len)


def latent_statistics(vae_config, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``latents_mean`` and ``1 / latents_std`` in ``like``'s dtype, rounded as the reference (which divides by it)."""
    shape = (1, -1) + (1,) * (like.ndim - 2)
    mean = torch.tensor(vae_config.latents_mean).view(shape).to(like.device, like.dtype)
    return mean, 1.0 / torch.tensor(vae_config.latents_std).view(shape).to(like.device, like.dtype)


def pad_rows(rows: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """(tokens_i, hidden) rows -> zero-padded to the longest, (batch, tokens, hidden), and the mask of real tokens."""
    lengths = torch.tensor([row.shape[0] for row in rows], device=rows[0].device)
    padded = nn.utils.rnn.pad_sequence(rows, batch_first=True)
    return padded, torch.arange(padded.shape[1], device=padded.device) < lengths[:, None]


def unpadded_halves(conditioning: dict[str, torch.Tensor]) -> list[dict[str, torch.Tensor | None]]:
    """``encode_rows``' two branches apart, each cut to its longest text, its mask dropped where nothing is padded."""
    halves = []
    for embeds, mask in zip(conditioning["embeds"].chunk(2), conditioning["mask"].chunk(2)):
        mask = mask[:, : int(mask.sum(1).max())]
        halves.append({"embeds": embeds[:, : mask.shape[1]], "mask": None if bool(mask.all()) else mask})
    return halves


def load_vae(family: Family, spec: ModelSpec, device: torch.device, dtype: torch.dtype, dummy: bool) -> nn.Module:
    """The family's VAE from ``spec.folder``, or seeded random weights (``dummy``), the caller's random state kept."""
    vae_class = family.vae_class
    if not dummy:
        vae = component_dir(spec.folder, "vae")
        return vae_class.from_pretrained(vae, dtype=dtype, use_safetensors=spec.weights.use_safetensors("vae"))
    with torch.random.fork_rng(devices=[]), torch.device(device):
        torch.manual_seed(0)
        vae = vae_class.from_config(spec.vae)
    # nn.Module.to, not ModelMixin.to: the latter only adds a warning about fp32-pinned modules these VAEs lack.
    return nn.Module.to(vae, dtype)


class DiffusionPipeline(ABC):
    """A family implements the abstract hooks and names in ``CONDITIONING`` the tensors its encoding makes."""

    CONDITIONING: ClassVar[tuple[str, ...]] = ("embeds",)
    # Whether the diffusers pipeline drops its sigmas for a flow-sigmas scheduler (unipc, dpmpp-2m), as Flux's do.
    FLOW_SIGMAS_SPACE_THEMSELVES: ClassVar[bool] = False

    def __init__(
        self,
        family: Family,
        spec: ModelSpec,
        transformer: Runtime,
        prompt_encoder,
        vae,
        device: torch.device,
        dtype: torch.dtype,
        parallel: ParallelContext | None = None,
        experts: dict[str, Runtime] | None = None,
        expert_swap: ExpertSwap | None = None,
    ) -> None:
        """Only rank 0 holds the prompt encoder (None elsewhere); every rank holds the VAE, so the group decodes."""
        self.family, self.spec, self.parallel = family, spec, parallel
        self.runtime, self.transformer = transformer, transformer.forward
        self.experts, self.expert_swap = experts or {}, expert_swap
        self.prompt_encoder, self.vae, self.device, self.dtype = prompt_encoder, vae, device, dtype
        runtimes = (transformer, *self.experts.values())
        reduce = parallel.sum_across if parallel is not None else (lambda sums: sums)
        # In the order they act: the transformers' own (FP8 attention's exact steps, a server's adapter choice), the
        # image-to-image start (which cuts the steps), the family's, step caching (which counts the steps left).
        self.hooks: list[RequestHook] = [
            *(hook for runtime in runtimes for hook in runtime.hooks),
            ImageToImage(self),
            *self.request_hooks(),
            StepCaching([runtime.model for runtime in runtimes], reduce, transformer.parallel.branches),
        ]
        self.stage = "before its first request"  # where ``generate`` is, in words (an out-of-memory error names it)
        self.scheduling: ResolvedRequest | None = None  # set by generate: ``scheduled`` applies its scheduler and shift

    def request_hooks(self) -> list[RequestHook]:
        return []

    def uses_cfg(self, request: ResolvedRequest) -> bool:
        return self.family.uses_cfg(self.spec, request)

    def branch_prompts(self, request: ResolvedRequest) -> list[list[str]]:
        """The request's prompts, and when it guides its negative prompts ("" unless given)."""
        if not self.uses_cfg(request):
            return [request.prompts]
        return [request.prompts, request.negative_prompts or [""] * len(request.prompts)]

    def encode(self, request: ResolvedRequest) -> dict[str, torch.Tensor]:
        """The ``CONDITIONING`` tensors (rank 0 only), [conditional; unconditional] rows when the request guides."""
        branches = self.branch_prompts(request)
        embeds = torch.cat([self.prompt_encoder.encode(prompts, self.dtype).to(self.device) for prompts in branches])
        return {"embeds": embeds.repeat_interleave(request.images_per_prompt, dim=0)}

    def encode_rows(self, request: ResolvedRequest, rows: Callable[[list[str]], list[torch.Tensor]]) -> dict:
        """``encode`` for prompts that keep their own lengths (``rows``: a (tokens, hidden) tensor each), padded."""
        repeat, branches = request.images_per_prompt, self.branch_prompts(request)
        embeds, mask = pad_rows([row.to(self.device) for p in branches for row in rows(p) for _ in range(repeat)])
        return {"embeds": embeds, "mask": mask}

    @abstractmethod
    def initial_latents(self, request: ResolvedRequest) -> tuple[torch.Tensor, Any]:
        """Seeded noise as diffusers draws it, and whatever layout the model call and ``decode`` need."""

    @abstractmethod
    def make_scheduler(self, request: ResolvedRequest, latents: torch.Tensor) -> tuple[Any, torch.Tensor]:
        """The diffusers scheduler and its timesteps (``scheduled``)."""

    def scheduled(self, scheduler_class, **timesteps) -> tuple[Any, torch.Tensor]:
        """``scheduler_class`` set to ``timesteps``, or the request's scheduler and shift as diffusers swaps them."""
        config, request = dict(self.spec.scheduler), self.scheduling
        if request is not None and request.scheduler is not None:
            scheduler_class, overrides = SCHEDULER_CHOICES[request.scheduler]
            shift = config.get("shift", config.get("flow_shift", 1.0))  # the checkpoint's, as the chosen class names it
            config.update(overrides, **{shift_name(scheduler_class): shift})
        if request is not None and request.shift is not None:
            config.update({shift_name(scheduler_class): request.shift, "use_dynamic_shifting": False})
        # Only the keys the class takes: diffusers would drop another scheduler's with a warning, each request.
        accepted = inspect.signature(scheduler_class.__init__).parameters
        scheduler = scheduler_class.from_config({key: value for key, value in config.items() if key in accepted})
        if self.FLOW_SIGMAS_SPACE_THEMSELVES and scheduler.config.get("use_flow_sigmas"):
            timesteps["num_inference_steps"] = len(timesteps.pop("sigmas"))
        scheduler.set_timesteps(device=self.device, **timesteps)
        scheduler.set_begin_index(0)
        return scheduler, scheduler.timesteps

    def model_inputs(
        self, request: ResolvedRequest, latents: torch.Tensor, t: torch.Tensor, layout
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """By default t cast to the latent dtype, then / 1000, as the reference does (bf16 stays bit-faithful)."""
        return latents.to(self.dtype), t.expand(latents.shape[0]).to(latents.dtype) / 1000

    @abstractmethod
    def model_call(self, request: ResolvedRequest, conditioning: dict[str, torch.Tensor], layout) -> ModelCall:
        """``call(transformer, model_input, timestep, latents)``: the model's prediction in the latents' layout, for
        the rows of ``conditioning`` this rank computes, rows independent after the transformer (PipeFusion's loop)."""

    def keeps_only_output_rows(self, request: ResolvedRequest) -> bool:
        """Whether the model may compute its last block for the rows the step keeps alone (a joint model's text and
        references are dropped after it): on a plan whose every rank holds every token and block (one GPU, --tensor,
        --cfg-parallel), without step caching (which runs slices of the stack and keeps every stream's residual)."""
        plan = None if self.parallel is None else self.parallel.config
        return request.cache is None and (plan is None or plan.keeps_sequence_and_stack_whole)

    def guide(self, cond: torch.Tensor, uncond: torch.Tensor, scale: float) -> torch.Tensor:
        return uncond + scale * (cond - uncond)

    def expert_at(self, request: ResolvedRequest, t: torch.Tensor) -> tuple[str, float | None]:
        """Which transformer (a component of ``spec.experts``, or ``transformer``) predicts at ``t``, and its scale."""
        return "transformer", request.guidance

    @abstractmethod
    def decode(self, latents: torch.Tensor, layout) -> torch.Tensor:
        """Pixels in [0, 1], (batch, 3, H, W); for a video family (batch, frames, 3, H, W)."""

    def band_mask(self, latents: torch.Tensor, start: int, stop: int) -> torch.Tensor:
        """Which latent elements rows ``start:stop`` of the output stream become (PipeFusion's bands)."""
        if latents.ndim > 3:
            return patch_grid_band_mask(latents, self.transformer.config.patch_size, start, stop)
        return token_band_mask(latents, start, stop)

    def predictor(
        self, request: ResolvedRequest, conditioning: dict[str, torch.Tensor], layout, finite: list[torch.Tensor]
    ) -> NoisePredictor:
        """``predict(latents, t, transformer)``: the guided prediction; ``finite[-1] &=`` whether it is finite."""
        cfg = self.uses_cfg(request)
        branches = self.runtime.parallel.branches if cfg else BatchedBranches()
        # A mask with no padding is dropped, so attention runs unmasked (every rank holds it whole: all decide alike).
        local = {
            name: None if value.dtype == torch.bool and bool(value.all()) else branches.local(value)
            for name, value in conditioning.items()
        }
        call = self.model_call(request, local, layout)
        # CFG's branches run apart, unpadded: a mask costs the flash kernel (Qwen-Image-Edit's batched step was 1.45x
        # diffusers', docs/benchmarks.md, issue 51). Not with step caching (per call) or PipeFusion (one text length).
        pipefusion = self.parallel is not None and self.parallel.config.pipefusion > 1
        padded = set(local) == {"embeds", "mask"} and local["mask"] is not None
        apart = cfg and isinstance(branches, BatchedBranches) and padded and request.cache is None and not pipefusion
        halves = [self.model_call(request, half, layout) for half in unpadded_halves(local)] if apart else None

        def predict(latents: torch.Tensor, t: torch.Tensor, transformer) -> torch.Tensor:
            expert, scale = self.expert_at(request, t)
            transformer = transformer if expert == "transformer" else self.experts[expert].forward
            if self.expert_swap is not None:
                self.expert_swap.activate(expert)
            model_input, timestep = self.model_inputs(request, latents, t, layout)
            if cfg:
                model_input = branches.local(torch.cat([model_input, model_input]))
                timestep = branches.local(torch.cat([timestep, timestep]))
            with torch.inference_mode():
                if halves is None:
                    prediction = call(transformer, model_input, timestep, latents)
                else:
                    inputs = zip(halves, model_input.chunk(2), timestep.chunk(2))
                    prediction = torch.cat([half(transformer, x, step, latents) for half, x, step in inputs])
            if cfg:
                prediction = self.guide(*branches.combine(prediction).chunk(2), scale)
            finite[-1] &= torch.isfinite(prediction).all()
            return prediction

        return predict

    def image_latents(self, request: ResolvedRequest, generator: torch.Generator) -> torch.Tensor:
        """Image-to-image: the input image's latents (batch 1) in the drawn layout, sampled with ``generator``."""
        raise NotImplementedError(f"{type(self).__name__} does no image-to-image")

    def pack_drawn(self, latents: torch.Tensor, request: ResolvedRequest) -> torch.Tensor:
        """Drawn latents in the layout the denoise loop steps (by default the same)."""
        return latents

    def latent_mask(self, request: ResolvedRequest, image: torch.Tensor) -> torch.Tensor:
        """Inpainting: the request's mask over ``image``'s latents, as the family's diffusers pipeline makes it."""
        return latent_mask(request, image)

    def vae_decode(self, latents: torch.Tensor) -> torch.Tensor:
        return (self.runtime.parallel.vae_decode(self.vae, latents) / 2 + 0.5).clamp(0, 1)

    def vae_encode(self, images: torch.Tensor):
        return self.runtime.parallel.vae_encode(self.vae, images)

    def conditioning(self, request: ResolvedRequest) -> dict[str, torch.Tensor]:
        encoded = self.encode(request) if self.prompt_encoder is not None else {}
        if self.parallel is None:
            return encoded
        return {name: self.parallel.share_from_leader(encoded.get(name)) for name in self.CONDITIONING}

    def generate(
        self, requests: list[ResolvedRequest], progress: bool = False, on_step: Callable[[int], None] | None = None
    ) -> list[GenerationResult] | None:
        """One result per request on rank 0, None elsewhere; requests of one ``batch_key`` run as one batch.
        ``on_step(k)`` runs when k steps are done; it may raise to stop the request (in a group, all at one k)."""
        resolved = one_batch(requests)
        timings = Timings()
        stats = self.parallel.stats if self.parallel else CommStats()  # one process's: sends nothing
        stats.reset()
        for hook in self.hooks:
            hook.begin_request(resolved)
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        start = time.perf_counter()
        self.stage = "while encoding the prompt"
        conditioning = self.conditioning(resolved)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        timings.text_encode_s = time.perf_counter() - start
        unmap_free(self.device)

        self.stage = "while preparing the latents"
        noise = [self.initial_latents(part) for part in requests]
        latents, layout = torch.cat([latents for latents, _ in noise]), noise[0][1]
        self.scheduling = resolved
        scheduler, timesteps = self.make_scheduler(resolved, latents)
        denoise = Denoise(
            requests, resolved, self.uses_cfg(resolved), latents, layout, scheduler, timesteps, timings.features
        )
        for hook in self.hooks:
            hook.begin_denoise(denoise)
        latents, layout, scheduler, timesteps = denoise.latents, denoise.layout, denoise.scheduler, denoise.timesteps
        steps = len(timesteps)
        clock = StepClock(self.device)
        finite: list[torch.Tensor] = []  # per step begun: whether all its predictions were finite

        def mark_step() -> None:
            clock.mark()
            done = len(clock.marks) - 1
            self.stage = f"at denoise step {min(done + 1, steps)} of {steps}"
            for hook in self.hooks:
                hook.at_step(done, steps)
            finite.append(torch.ones((), dtype=torch.bool, device=self.device))
            if on_step is not None:
                on_step(done)

        predict = self.predictor(resolved, conditioning, layout, finite)
        stats.phase = "denoise"
        latents = self.runtime.parallel.loop.run(
            predict, self.transformer, scheduler, latents, timesteps, self.band_mask, mark_step, progress
        )
        timings.step_ms = clock.durations_ms()
        bad = [*torch.stack(finite).tolist(), False].index(False)  # read once: per step, it would stall the device
        if self.parallel is not None:  # all stop at the first any rank saw, or some would wait in a collective
            bad = min(self.parallel.gather_int(bad))
        if bad < len(finite):
            scale = self.expert_at(resolved, timesteps[bad])[1]
            guidance = "" if scale is None else f"a guidance scale too large ({scale:g} at this step) or "
            adapters = [adapter for runtime in (self.runtime, *self.experts.values()) for adapter in runtime.adapters]
            adapters += [f"{name} at scale {weight:g}" for name, weight in resolved.lora or ()]
            lora = f"a LoRA scale too large ({', '.join(adapters)}) or " if adapters else ""
            raise NonFinitePrediction(
                f"denoise step {bad + 1} of {steps} predicted NaN or inf (the image "
                f"would be black); likely {guidance}{lora}NaN or inf in the weights"
            )
        stats.phase = "decode"
        self.stage = "while decoding"
        unmap_free(self.device)
        timings.comm_bytes_per_step = stats.bytes_sent["denoise"] // steps
        decode_start = time.perf_counter()
        decoded = self.decode(latents, layout).float()
        pixels = decoded.cpu()
        # Images only: a video's 8-bit copy on the device would add to the decode's peak, which the memory plan holds.
        rgb8 = rgb8_of(decoded).cpu() if decoded.is_cuda and decoded.ndim == 4 else None
        del decoded
        timings.vae_decode_s = time.perf_counter() - decode_start
        if self.parallel is not None:
            timings.peak_memory_per_rank = self.parallel.gather_int(peak_memory(self.device))
            if not self.parallel.is_leader:
                return None
        timings.total_s = time.perf_counter() - start
        timings.peak_memory_bytes = peak_memory(self.device)
        if self.device.type == "cuda":
            timings.peak_reserved_bytes = torch.cuda.max_memory_reserved(self.device)
        timings.peak_memory_kind = "device" if self.device.type == "cuda" else "process RSS"
        if timings.peak_memory_per_rank:  # rank 0 decodes after the others reported: its own peak is final only now
            timings.peak_memory_per_rank[0] = timings.peak_memory_bytes
        batches = [part.batch for part in requests]
        eight_bits = rgb8.split(batches) if rgb8 is not None else [None] * len(requests)
        return [
            GenerationResult(pixels=images, seed=part.seed, timings=timings, request=part, rgb8=images8)
            for part, images, images8 in zip(requests, pixels.split(batches), eight_bits)
        ]


def shift_name(scheduler_class: type) -> str:
    return "shift" if issubclass(scheduler_class, FlowMatchEulerDiscreteScheduler) else "flow_shift"


def token_band_mask(latents: torch.Tensor, start: int, stop: int) -> torch.Tensor:
    tokens = torch.arange(latents.shape[1], device=latents.device)
    return ((tokens >= start) & (tokens < stop)).view(1, -1, 1)


def patch_grid_band_mask(latents: torch.Tensor, patch, start: int, stop: int) -> torch.Tensor:
    """Rows are ``patch`` boxes of (batch, channels, *sides) latents in raster order; pad rows cover no latent."""
    patch = (patch,) * (latents.ndim - 2) if isinstance(patch, int) else patch
    grid = [side // size for side, size in zip(latents.shape[2:], patch)]
    tokens = torch.arange(math.prod(grid), device=latents.device)
    mask = ((tokens >= start) & (tokens < stop)).view(grid)
    for axis, size in enumerate(patch):
        mask = mask.repeat_interleave(size, axis)
    return mask.view(1, 1, *mask.shape)
