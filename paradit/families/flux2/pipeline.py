"""FLUX.2 text-to-image: prompt encoding, seeded latents, denoising, VAE decoding.

Reproduces diffusers' ``Flux2Pipeline`` (dev: Mistral3 encoder, embedded guidance) and ``Flux2KleinPipeline``
(klein: Qwen3 encoder, true CFG unless step-distilled) so that the same checkpoint and seed give the same image.
Differences that only make it faster: the unconditional branch of CFG runs in the same batch as the conditional one
(or on the other half of the group under CFG parallelism), and the text encoder stops at the deepest layer it is
read at.
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path

import numpy as np
import torch
from diffusers import AutoencoderKLFlux2, FlowMatchEulerDiscreteScheduler
from diffusers.pipelines.flux2.system_messages import SYSTEM_MESSAGE

from paradit.errors import InvalidRequest
from paradit.families.flux2.model import Flux2Config, Flux2Transformer
from paradit.pipelines.base import (
    DiffusionPipeline,
    NoisePredictor,
    ResolvedRequest,
    cfg_step_inputs,
    resolve_common,
    seeded_noise,
)
from paradit.request import GenerationRequest
from paradit.spec import CheckpointFolder, ModelSpec, TextEncoderSpec
from paradit.text_encoder import PromptEncoder, warn_if_truncated
from paradit.weights import component_dir, read_json

logger = logging.getLogger(__name__)


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
    # The encoder's own config too: memory estimates (and random weights) build it without reading its weights.
    encoder_config = read_json(component_dir(folder, "text_encoder") / "config.json")
    if pipeline_class == "Flux2Pipeline":
        encoder = TextEncoderSpec(encoder_config, layers=(10, 20, 30))
        mode, steps, guidance = "embedded", 50, 4.0
    else:
        encoder = TextEncoderSpec(encoder_config, layers=(9, 18, 27))
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
        weights=CheckpointFolder(folder),
        extra={"text_encoder_class": index.get("text_encoder", [None, None])[1]},
    )


def pixel_granularity(vae_config) -> int:
    """Pixels per latent token side: the VAE's stride, doubled by the 2x2 patchify after it."""
    return 2 ** len(vae_config["block_out_channels"])


def resolve_request(spec: ModelSpec, request: GenerationRequest) -> ResolvedRequest:
    """The request with defaults filled in, or an InvalidRequest naming what is wrong and what is allowed."""
    if spec.guidance_mode == "none" and request.guidance is not None:
        # diffusers' Flux2KleinPipeline takes the scale and ignores it for a step-distilled checkpoint: so do we.
        logger.warning("guidance %s is ignored: %s is step-distilled", request.guidance, spec.name)
        request = dataclasses.replace(request, guidance=None)
    if request.negative_prompt is not None and spec.guidance_mode != "cfg":
        raise InvalidRequest(f"{spec.name} does not use classifier-free guidance, so it takes no negative prompt")
    return resolve_common(spec, request, pixel_granularity(spec.vae))


class MistralPromptEncoder(PromptEncoder):
    """FLUX.2-dev's prompts: diffusers' system turn, then the prompt (image tokens removed), parts-list contents."""

    def tokenize(self, prompts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
        conversations = [
            [
                {"role": "system", "content": [{"type": "text", "text": SYSTEM_MESSAGE}]},
                {"role": "user", "content": [{"type": "text", "text": prompt.replace("[IMG]", "")}]},
            ]
            for prompt in prompts
        ]
        texts = self.tokenizer.apply_chat_template(conversations, tokenize=False)
        warn_if_truncated(self.tokenizer, texts, self.spec.max_length)
        inputs = self.tokenizer.apply_chat_template(
            conversations, add_generation_prompt=False, tokenize=True, return_dict=True, return_tensors="pt",
            padding="max_length", truncation=True, max_length=self.spec.max_length,
        )  # fmt: skip
        return inputs["input_ids"], inputs["attention_mask"]


class Flux2Pipeline(DiffusionPipeline):
    DIFFUSERS_PIPELINES = ("Flux2Pipeline", "Flux2KleinPipeline")
    VAE = AutoencoderKLFlux2
    spec_from_folder = staticmethod(spec_from_folder)
    resolve_request = staticmethod(resolve_request)
    CONDITIONING = ("embeds",)

    @classmethod
    def build_transformer(cls, spec: ModelSpec) -> Flux2Transformer:
        return Flux2Transformer(Flux2Config.from_dict(spec.transformer))

    @classmethod
    def load_prompt_encoder(
        cls, spec: ModelSpec, device: torch.device, dtype: torch.dtype, dummy: bool, placement: str = "gpu"
    ) -> PromptEncoder:
        # dev's Mistral gets diffusers' system turn; klein's Qwen3 a plain user turn.
        mistral = spec.text_encoder.config.get("model_type", "").startswith("mistral")
        encoder_type = MistralPromptEncoder if mistral else PromptEncoder
        if dummy:
            return encoder_type.dummy(spec.text_encoder, device, dtype, placement)
        encoder_class = spec.extra["text_encoder_class"]
        return encoder_type.from_folder(spec.folder, encoder_class, spec.text_encoder, device, dtype, placement)

    @staticmethod
    def uses_cfg(spec: ModelSpec, request: ResolvedRequest) -> bool:
        return spec.guidance_mode == "cfg" and request.guidance is not None and request.guidance > 1.0

    def encode_prompts(self, prompts: list[str], images_per_prompt: int) -> torch.Tensor:
        embeds = self.prompt_encoder.encode(prompts, self.dtype).to(self.device)
        return embeds.repeat_interleave(images_per_prompt, dim=0)

    def encode(self, request: ResolvedRequest) -> dict[str, torch.Tensor]:
        """[conditional; unconditional] prompt embeddings (the negative prompt defaults to "", as in diffusers)."""
        embeds = self.encode_prompts(request.prompts, request.images_per_prompt)
        if self.uses_cfg(self.spec, request):
            negatives = request.negative_prompts or [""] * len(request.prompts)
            embeds = torch.cat([embeds, self.encode_prompts(negatives, request.images_per_prompt)])
        return {"embeds": embeds}

    def initial_latents(self, request: ResolvedRequest) -> tuple[torch.Tensor, tuple[int, int]]:
        """Seeded noise packed to (batch, tokens, channels), with the token grid's rows and columns."""
        granularity = pixel_granularity(self.spec.vae)
        rows, cols = request.height // granularity, request.width // granularity
        noise = seeded_noise((request.batch, self.transformer.config.in_channels, rows, cols), request.seed,
                             self.dtype, self.device)  # fmt: skip
        return noise.flatten(2).transpose(1, 2), (rows, cols)

    def make_scheduler(self, request: ResolvedRequest, latents: torch.Tensor):
        scheduler = FlowMatchEulerDiscreteScheduler.from_config(self.spec.scheduler)
        sigmas = np.linspace(1.0, 1 / request.steps, request.steps)
        mu = empirical_mu(latents.shape[1], request.steps)
        scheduler.set_timesteps(sigmas=sigmas, device=self.device, mu=mu)
        scheduler.set_begin_index(0)
        return scheduler, scheduler.timesteps

    def predictor(
        self, request: ResolvedRequest, conditioning: dict[str, torch.Tensor], layout: tuple[int, int]
    ) -> NoisePredictor:
        """The embeddings hold [conditional; unconditional] rows under CFG; the branches object decides which of
        them this rank computes (all of them on one GPU, one half under CFG parallelism)."""
        cfg = self.uses_cfg(self.spec, request)
        branches = self.branches(cfg)
        embeds = branches.local(conditioning["embeds"])
        one = torch.arange(1)
        img_ids = torch.cartesian_prod(one, torch.arange(layout[0]), torch.arange(layout[1]), one).to(self.device)
        txt_ids = torch.cartesian_prod(one, one, one, torch.arange(embeds.shape[1])).to(self.device)
        guidance = None
        if self.spec.guidance_mode == "embedded":
            guidance = torch.full((embeds.shape[0],), request.guidance, device=self.device, dtype=torch.float32)
        scale = request.guidance

        def predict(latents: torch.Tensor, t: torch.Tensor, transformer) -> torch.Tensor:
            # The reference casts t to the latent dtype before dividing; matching it keeps bf16 runs bit-faithful.
            timestep = t.expand(latents.shape[0]).to(latents.dtype) / 1000
            model_input, timestep = cfg_step_inputs(branches, cfg, latents, timestep)
            with torch.inference_mode():
                noise = transformer(model_input.to(self.dtype), embeds, timestep, img_ids, txt_ids, guidance)
            if not cfg:
                return noise
            cond, uncond = branches.combine(noise).chunk(2)
            return uncond + scale * (cond - uncond)

        return predict

    @torch.inference_mode()
    def decode(self, latents: torch.Tensor, layout: tuple[int, int]) -> torch.Tensor:
        rows, cols = layout
        latents = latents.transpose(1, 2).unflatten(2, (rows, cols))
        mean = self.vae.bn.running_mean.view(1, -1, 1, 1).to(latents)
        std = torch.sqrt(self.vae.bn.running_var.view(1, -1, 1, 1) + self.vae.config.batch_norm_eps).to(latents)
        latents = latents * std + mean
        batch, channels = latents.shape[:2]
        latents = latents.reshape(batch, channels // 4, 2, 2, rows, cols).permute(0, 1, 4, 2, 5, 3)
        latents = latents.reshape(batch, channels // 4, rows * 2, cols * 2)
        image = self.vae_decode(latents.to(self.vae.dtype))
        return (image / 2 + 0.5).clamp(0, 1)
