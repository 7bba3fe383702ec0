"""FLUX.2 text-to-image: prompt encoding, seeded latents, denoising, VAE decoding.

Reproduces diffusers' ``Flux2Pipeline`` (dev: Mistral3 encoder, embedded guidance) and ``Flux2KleinPipeline``
(klein: Qwen3 encoder, true CFG unless step-distilled) so that the same checkpoint and seed give the same image.
Differences that only make it faster: the unconditional branch of CFG runs in the same batch as the conditional one
(or on the other half of the group under CFG parallelism), and the text encoder stops at the deepest layer it is
read at.
"""

from __future__ import annotations

import dataclasses
import random
import time
from pathlib import Path

import numpy as np
import torch
from diffusers import AutoencoderKLFlux2, FlowMatchEulerDiscreteScheduler
from torch import nn

from paradit.errors import InvalidRequest
from paradit.models.flux2 import Flux2Config, Flux2Transformer
from paradit.parallel.cfg import BatchedBranches, guidance_branches
from paradit.parallel.mesh import ParallelContext
from paradit.parallel.sequence import parallelize_sequence
from paradit.pipelines.base import (
    NoisePredictor,
    StepClock,
    denoise,
    record_peak_memory,
    reset_peak_memory,
    synchronize,
)
from paradit.request import GenerationRequest, GenerationResult, Timings
from paradit.spec import ModelSpec
from paradit.text_encoder import PromptEncoder, TextEncoderSpec
from paradit.weights import component_dir, init_dummy_weights, load_module_weights, read_json, safetensors_files

PIPELINE_CLASSES = ("Flux2Pipeline", "Flux2KleinPipeline")


def empirical_mu(image_tokens: int, steps: int) -> float:
    """FLUX.2's timestep shift: linear in the image token count, and for small images also in the step count
    (fitted by BFL between 10 and 200 steps)."""
    slope_200, intercept_200 = 0.00016927, 0.45666666
    slope_10, intercept_10 = 8.73809524e-05, 1.89833333
    mu_200 = slope_200 * image_tokens + intercept_200
    if image_tokens > 4300:
        return float(mu_200)
    mu_10 = slope_10 * image_tokens + intercept_10
    per_step = (mu_200 - mu_10) / 190.0
    return float(per_step * steps + mu_200 - 200.0 * per_step)


def spec_from_folder(folder: Path, index: dict) -> ModelSpec:
    """The ModelSpec of a diffusers FLUX.2 checkpoint: architecture from its configs, defaults from its pipeline."""
    pipeline_class = index["_class_name"]
    transformer = read_json(component_dir(folder, "transformer") / "config.json")
    if pipeline_class == "Flux2Pipeline":
        encoder = TextEncoderSpec({}, layers=(10, 20, 30), prompt_format="mistral")
        mode, steps, guidance = "embedded", 50, 4.0
    else:
        encoder = TextEncoderSpec({}, layers=(9, 18, 27), prompt_format="qwen3")
        distilled = bool(index.get("is_distilled", False))
        mode, steps, guidance = ("none", 4, None) if distilled else ("cfg", 50, 4.0)
    return ModelSpec(
        name=str(folder),
        family="flux2",
        description=f"{pipeline_class} checkpoint",
        transformer=transformer,
        text_encoder=encoder,
        vae=read_json(component_dir(folder, "vae") / "config.json"),
        scheduler=read_json(component_dir(folder, "scheduler") / "scheduler_config.json"),
        guidance_mode=mode,
        steps=steps,
        guidance=guidance,
        height=1024,
        width=1024,
        extra={"folder": folder, "text_encoder_class": index.get("text_encoder", [None, None])[1]},
    )


def pixel_granularity(vae_config) -> int:
    """Pixels per latent token side: the VAE's stride, doubled by the 2x2 patchify after it."""
    return 2 ** len(vae_config["block_out_channels"])


@dataclasses.dataclass
class ResolvedRequest:
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


def resolve_request(spec: ModelSpec, request: GenerationRequest) -> ResolvedRequest:
    """The request with defaults filled in, or an InvalidRequest naming what is wrong and what is allowed."""
    prompts = request.prompts
    if not prompts or any(not isinstance(p, str) or not p.strip() for p in prompts):
        raise InvalidRequest("prompt is empty; give at least one non-empty prompt")
    height = spec.height if request.height is None else request.height
    width = spec.width if request.width is None else request.width
    g = pixel_granularity(spec.vae)
    for name, value in (("height", height), ("width", width)):
        if value < g or value % g:
            raise InvalidRequest(f"{name} {value} is not allowed; this model takes multiples of {g} (>= {g})")
    steps = spec.steps if request.steps is None else request.steps
    if steps < 1:
        raise InvalidRequest(f"steps {steps} is not allowed; give 1 or more")
    if spec.guidance_mode == "none" and request.guidance is not None:
        raise InvalidRequest(f"{spec.name} is step-distilled and takes no guidance; leave guidance unset")
    guidance = spec.guidance if request.guidance is None else float(request.guidance)
    if guidance is not None and guidance < 0:
        raise InvalidRequest(f"guidance {guidance} is not allowed; give a value >= 0")
    negatives = None
    if request.negative_prompt is not None:
        if spec.guidance_mode != "cfg":
            raise InvalidRequest(f"{spec.name} does not use classifier-free guidance, so it takes no negative prompt")
        negatives = (
            [request.negative_prompt] if isinstance(request.negative_prompt, str) else list(request.negative_prompt)
        )
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


class Flux2Pipeline:
    def __init__(
        self,
        spec: ModelSpec,
        transformer: Flux2Transformer,
        prompt_encoder: PromptEncoder,
        vae: AutoencoderKLFlux2 | None,
        device: torch.device,
        dtype: torch.dtype,
        parallel: ParallelContext | None = None,
    ) -> None:
        """In a group, only rank 0 holds the prompt encoder and the VAE (None elsewhere)."""
        self.spec = spec
        self.transformer = transformer
        self.prompt_encoder = prompt_encoder
        self.vae = vae
        self.device = device
        self.dtype = dtype
        self.parallel = parallel
        self.pixel_granularity = pixel_granularity(spec.vae)

    @classmethod
    def load(
        cls,
        spec: ModelSpec,
        device: torch.device,
        dtype: torch.dtype,
        dummy: bool,
        parallel: ParallelContext | None = None,
    ) -> Flux2Pipeline:
        """Every rank loads the transformer; only rank 0 loads the prompt encoder and the VAE."""
        with torch.device("meta"):
            transformer = Flux2Transformer(Flux2Config.from_dict(spec.transformer))
        folder = spec.extra.get("folder")
        if dummy:
            init_dummy_weights(transformer, device, dtype)
        else:
            load_module_weights(transformer, safetensors_files(component_dir(folder, "transformer")), device, dtype)
        transformer = transformer.eval()
        if parallel is not None:
            transformer = parallelize_sequence(transformer, parallel)
        if parallel is not None and not parallel.is_leader:
            return cls(spec, transformer, None, None, device, dtype, parallel)

        if dummy:
            prompt_encoder = PromptEncoder.dummy(spec.text_encoder, device, dtype)
            with torch.random.fork_rng(devices=[]), torch.device(device):
                torch.manual_seed(0)
                vae = AutoencoderKLFlux2(**spec.vae)
            # nn.Module.to, not ModelMixin.to: the latter only adds a warning about fp32-pinned modules, and this
            # VAE pins none.
            vae = nn.Module.to(vae, dtype)
        else:
            encoder_class = spec.extra["text_encoder_class"]
            prompt_encoder = PromptEncoder.from_folder(folder, encoder_class, spec.text_encoder, device, dtype)
            vae = AutoencoderKLFlux2.from_pretrained(component_dir(folder, "vae"), dtype=dtype)
        vae = vae.to(device).eval().requires_grad_(False)
        return cls(spec, transformer, prompt_encoder, vae, device, dtype, parallel)

    def uses_cfg(self, request: ResolvedRequest) -> bool:
        return self.spec.guidance_mode == "cfg" and request.guidance is not None and request.guidance > 1.0

    def encode_prompts(self, prompts: list[str], images_per_prompt: int) -> torch.Tensor:
        embeds = self.prompt_encoder.encode(prompts, self.dtype).to(self.device)
        return embeds.repeat_interleave(images_per_prompt, dim=0)

    def initial_latents(self, request: ResolvedRequest) -> tuple[torch.Tensor, int, int]:
        """Noise drawn as diffusers draws it (one CPU generator seeded with ``seed`` for the whole batch), packed to
        (batch, tokens, channels); returns it with the token grid's height and width."""
        rows, cols = request.height // self.pixel_granularity, request.width // self.pixel_granularity
        shape = (request.batch, self.transformer.config.in_channels, rows, cols)
        generator = torch.Generator("cpu").manual_seed(request.seed)
        noise = torch.randn(shape, generator=generator, dtype=self.dtype).to(self.device)
        return noise.flatten(2).transpose(1, 2), rows, cols

    def position_ids(self, rows: int, cols: int, text_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        one = torch.arange(1)
        img_ids = torch.cartesian_prod(one, torch.arange(rows), torch.arange(cols), one)
        txt_ids = torch.cartesian_prod(one, one, one, torch.arange(text_len))
        return img_ids.to(self.device), txt_ids.to(self.device)

    def make_scheduler(self, steps: int, image_tokens: int) -> tuple[FlowMatchEulerDiscreteScheduler, torch.Tensor]:
        scheduler = FlowMatchEulerDiscreteScheduler.from_config(self.spec.scheduler)
        sigmas = np.linspace(1.0, 1 / steps, steps)
        scheduler.set_timesteps(sigmas=sigmas, device=self.device, mu=empirical_mu(image_tokens, steps))
        scheduler.set_begin_index(0)
        return scheduler, scheduler.timesteps

    def predictor(
        self, request: ResolvedRequest, embeds: torch.Tensor, img_ids: torch.Tensor, txt_ids: torch.Tensor, cfg: bool
    ) -> NoisePredictor:
        """``embeds`` holds [conditional; unconditional] rows when ``cfg``; the branches object decides which of them
        this rank computes (all of them on one GPU, one half under CFG parallelism)."""
        branches = guidance_branches(self.parallel) if cfg else BatchedBranches()
        embeds = branches.local(embeds)
        guidance = None
        if self.spec.guidance_mode == "embedded":
            guidance = torch.full((embeds.shape[0],), request.guidance, device=self.device, dtype=torch.float32)
        scale = request.guidance

        def predict(latents: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
            # The reference casts t to the latent dtype before dividing; matching it keeps bf16 runs bit-faithful.
            timestep = t.expand(latents.shape[0]).to(latents.dtype) / 1000
            model_input = latents
            if cfg:
                model_input = branches.local(torch.cat([latents, latents]))
                timestep = branches.local(torch.cat([timestep, timestep]))
            with torch.inference_mode():
                noise = self.transformer(model_input.to(self.dtype), embeds, timestep, img_ids, txt_ids, guidance)
            if not cfg:
                return noise
            cond, uncond = branches.combine(noise).chunk(2)
            return uncond + scale * (cond - uncond)

        return predict

    @torch.inference_mode()
    def decode(self, latents: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
        latents = latents.transpose(1, 2).unflatten(2, (rows, cols))
        mean = self.vae.bn.running_mean.view(1, -1, 1, 1).to(latents)
        std = torch.sqrt(self.vae.bn.running_var.view(1, -1, 1, 1) + self.vae.config.batch_norm_eps).to(latents)
        latents = latents * std + mean
        batch, channels = latents.shape[:2]
        latents = latents.reshape(batch, channels // 4, 2, 2, rows, cols).permute(0, 1, 4, 2, 5, 3)
        latents = latents.reshape(batch, channels // 4, rows * 2, cols * 2)
        image = self.vae.decode(latents.to(self.vae.dtype), return_dict=False)[0]
        return (image / 2 + 0.5).clamp(0, 1)

    def text_embeddings(self, request: ResolvedRequest, cfg: bool) -> torch.Tensor:
        """[conditional; unconditional] prompt embeddings, encoded once per group (by rank 0) and shared."""
        if self.prompt_encoder is not None:
            embeds = self.encode_prompts(request.prompts, request.images_per_prompt)
            if cfg:
                negatives = request.negative_prompts or [""] * len(request.prompts)
                embeds = torch.cat([embeds, self.encode_prompts(negatives, request.images_per_prompt)])
        else:
            embeds = None
        return embeds if self.parallel is None else self.parallel.share_from_leader(embeds)

    def generate(self, request: GenerationRequest, progress: bool = False) -> GenerationResult | None:
        """The images on the rank that decodes (rank 0 of the group); None on the other ranks."""
        resolved = resolve_request(self.spec, request)
        timings = Timings()
        stats = self.parallel.stats if self.parallel else None
        if stats:
            stats.reset()
        reset_peak_memory(self.device)
        start = time.perf_counter()
        cfg = self.uses_cfg(resolved)
        embeds = self.text_embeddings(resolved, cfg)
        synchronize(self.device)
        timings.text_encode_s = time.perf_counter() - start

        latents, rows, cols = self.initial_latents(resolved)
        img_ids, txt_ids = self.position_ids(rows, cols, embeds.shape[1])
        scheduler, timesteps = self.make_scheduler(resolved.steps, latents.shape[1])
        clock = StepClock(self.device)
        predict = self.predictor(resolved, embeds, img_ids, txt_ids, cfg)
        if stats:
            stats.phase = "denoise"
        latents = denoise(predict, scheduler, latents, timesteps, clock, progress)
        timings.step_ms = clock.durations_ms()
        if stats:
            stats.phase = "decode"
            timings.comm_bytes_per_step = stats.bytes_sent["denoise"] // len(timesteps)
        if self.vae is None:
            return None

        decode_start = time.perf_counter()
        pixels = self.decode(latents, rows, cols)
        pixels = pixels.float().cpu()
        timings.vae_decode_s = time.perf_counter() - decode_start
        timings.total_s = time.perf_counter() - start
        record_peak_memory(timings, self.device)
        return GenerationResult(pixels=pixels, seed=resolved.seed, timings=timings)
