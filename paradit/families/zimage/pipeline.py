"""Z-Image (Turbo, base) as diffusers' ``ZImagePipeline`` and ``ZImageImg2ImgPipeline`` run it."""

from __future__ import annotations

import torch
from diffusers import FlowMatchEulerDiscreteScheduler
from diffusers.image_processor import VaeImageProcessor

from paradit.families.zimage.latents import pixel_granularity
from paradit.families.zimage.model import unpatchify
from paradit.pipelines.base import DiffusionPipeline, dynamic_shift, seeded_noise
from paradit.request import ResolvedRequest
from paradit.text_encoder import DecoderPromptEncoder


class CaptionEncoder(DecoderPromptEncoder):
    """Qwen3 at one hidden layer, the chat template's thinking on (no empty think block), padding dropped."""

    thinking = True

    @torch.no_grad()
    def encode(self, prompts: list[str], dtype: torch.dtype) -> list[torch.Tensor]:
        hidden_states, mask = self.hidden_states(prompts)
        (layer,) = self.spec.layers
        return [row[keep] for row, keep in zip(hidden_states[layer].to(dtype), mask.bool())]


class ZImagePipeline(DiffusionPipeline):
    CONDITIONING = ("embeds", "mask")

    def encode(self, request: ResolvedRequest) -> dict[str, torch.Tensor]:
        return self.encode_rows(request, lambda prompts: self.prompt_encoder.encode(prompts, self.dtype))

    def initial_latents(self, request: ResolvedRequest) -> tuple[torch.Tensor, None]:
        """Seeded noise, float32 whatever the model dtype (the scheduler steps in float32)."""
        stride = pixel_granularity(self.spec.vae) // self.transformer.config.patch_size
        shape = (request.batch, self.transformer.config.in_channels, request.height // stride, request.width // stride)
        return seeded_noise(shape, request.seed, torch.float32, self.device), None

    def make_scheduler(self, request: ResolvedRequest, latents: torch.Tensor):
        # Sigmas as the reference makes them, a float32 linspace as Python floats; mu: unused by fixed-shift schedulers.
        sigmas = torch.linspace(1.0, 1 / request.steps, request.steps).tolist()
        patch = self.transformer.config.patch_size
        mu = dynamic_shift(latents.shape[2] // patch * (latents.shape[3] // patch), self.spec.scheduler)
        return self.scheduled(FlowMatchEulerDiscreteScheduler, sigmas=sigmas, mu=mu)

    @torch.inference_mode()
    def image_latents(self, request: ResolvedRequest, generator: torch.Generator) -> torch.Tensor:
        processor = VaeImageProcessor(vae_scale_factor=pixel_granularity(self.spec.vae))
        pixels = processor.preprocess(request.images[0], height=request.height, width=request.width)
        sample = self.vae_encode(pixels.to(self.device, self.vae.dtype)).sample(generator)
        return ((sample - self.vae.config.shift_factor) * self.vae.config.scaling_factor).float()

    def model_inputs(self, request: ResolvedRequest, latents: torch.Tensor, t: torch.Tensor, layout):
        # The transformer is conditioned on 1 - sigma, which the reference derives from the scheduler's t.
        return latents.to(self.dtype), (1000 - t.expand(latents.shape[0])) / 1000

    def transformer_inputs(self, conditioning: dict[str, torch.Tensor], layout) -> tuple:
        """What the transformer takes after the latents and timestep, once per request: the captions and their mask."""
        return conditioning["embeds"], conditioning["mask"]

    def model_call(self, request: ResolvedRequest, conditioning: dict[str, torch.Tensor], layout):
        inputs, patch = self.transformer_inputs(conditioning, layout), self.transformer.config.patch_size

        def call(transformer, x: torch.Tensor, timestep: torch.Tensor, latents: torch.Tensor) -> torch.Tensor:
            rows, cols = (side // patch for side in latents.shape[2:])
            # The model predicts velocity towards the image; the scheduler steps along noise minus image.
            return -unpatchify(transformer(x, timestep, *inputs), rows, cols, patch).float()

        return call

    def guide(self, cond: torch.Tensor, uncond: torch.Tensor, scale: float) -> torch.Tensor:
        return cond + scale * (cond - uncond)

    @torch.inference_mode()
    def decode(self, latents: torch.Tensor, layout: None) -> torch.Tensor:
        latents = latents.to(self.vae.dtype)
        return self.vae_decode(latents / self.vae.config.scaling_factor + self.vae.config.shift_factor)
