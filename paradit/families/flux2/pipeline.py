"""FLUX.2 as diffusers' dev, klein, klein inpainting and klein KV pipelines run it, image for image."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch
from diffusers import FlowMatchEulerDiscreteScheduler
from diffusers.pipelines.flux2.image_processor import Flux2ImageProcessor
from diffusers.pipelines.flux2.system_messages import SYSTEM_MESSAGE

from paradit.families.flux2.latents import pixel_granularity, reference_size
from paradit.families.flux2.presets import caches_references
from paradit.pipelines.base import DiffusionPipeline, seeded_noise
from paradit.pipelines.inpainting import latent_mask
from paradit.request import ResolvedRequest
from paradit.request_hooks import Denoise, RequestHook
from paradit.text_encoder import DecoderPromptEncoder, warn_if_truncated

if TYPE_CHECKING:
    from paradit.families.flux2.model import ReferenceKV


def empirical_mu(image_tokens: int, steps: int) -> float:
    """FLUX.2's timestep shift: linear in image tokens, for small images in the steps too (BFL's fit, 10-200 steps)."""
    slope_200, intercept_200 = 0.00016927, 0.45666666
    slope_10, intercept_10 = 8.73809524e-05, 1.89833333
    mu_200 = slope_200 * image_tokens + intercept_200
    if image_tokens > 4300:
        return float(mu_200)
    mu_10 = slope_10 * image_tokens + intercept_10
    per_step = (mu_200 - mu_10) / 190.0
    return float(per_step * steps + mu_200 - 200.0 * per_step)


def batch_norm_statistics(vae, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The FLUX VAE's batch-norm mean and std over patchified latents, as (1, channels, 1, 1) like ``like``."""
    mean = vae.bn.running_mean.view(1, -1, 1, 1).to(like)
    std = torch.sqrt(vae.bn.running_var.view(1, -1, 1, 1) + vae.config.batch_norm_eps).to(like)
    return mean, std


def packed_latents(vae, mode: torch.Tensor) -> torch.Tensor:
    """A latent mode (batch, channels, rows, cols) patchified 2x2 and normalised by the VAE's batch-norm statistics:
    (batch, channels * 4, rows / 2, cols / 2)."""
    batch, channels, rows, cols = mode.shape
    latents = mode.view(batch, channels, rows // 2, 2, cols // 2, 2).permute(0, 1, 3, 5, 2, 4)
    latents = latents.reshape(batch, channels * 4, rows // 2, cols // 2)
    mean, std = batch_norm_statistics(vae, latents)
    return (latents - mean) / std


def unpacked_latents(vae, latents: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """``packed_latents`` undone for (batch, rows * cols, channels) tokens: what the VAE decodes, in its dtype."""
    latents = latents.transpose(1, 2).unflatten(2, (rows, cols))
    mean, std = batch_norm_statistics(vae, latents)
    latents = latents * std + mean
    batch, channels = latents.shape[:2]
    latents = latents.reshape(batch, channels // 4, 2, 2, rows, cols).permute(0, 1, 4, 2, 5, 3)
    return latents.reshape(batch, channels // 4, rows * 2, cols * 2).to(vae.dtype)


class MistralPromptEncoder(DecoderPromptEncoder):
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
            conversations,
            add_generation_prompt=False,
            tokenize=True,
            return_dict=True,
            return_tensors="pt",
            padding="max_length",
            truncation=True,
            max_length=self.spec.max_length,
        )
        return inputs["input_ids"], inputs["attention_mask"]


@dataclass(frozen=True)
class Flux2Layout:
    """The target's token grid; the references' packed latents (1, tokens, channels), ids (tokens, 4) and cached KV."""

    rows: int
    cols: int
    references: torch.Tensor | None = None
    reference_ids: torch.Tensor | None = None
    reference_kv: ReferenceKV | None = None


class CachedReferences(RequestHook):
    """A KV checkpoint's references, run through the plain model once per request before the first step."""

    def __init__(self, model, dtype: torch.dtype) -> None:
        self.model, self.dtype = model, dtype

    def begin_denoise(self, denoise: Denoise) -> None:
        layout = denoise.layout
        if layout.references is not None:
            with torch.inference_mode():
                cached = self.model.cache_references(layout.references.to(self.dtype), layout.reference_ids)
            denoise.layout = dataclasses.replace(layout, reference_kv=cached)


class Flux2Pipeline(DiffusionPipeline):
    FLOW_SIGMAS_SPACE_THEMSELVES = True  # its diffusers pipelines pass no sigmas to a scheduler of flow sigmas

    def request_hooks(self) -> list[RequestHook]:
        return [CachedReferences(self.runtime.model, self.dtype)] if caches_references(self.spec) else []

    def initial_latents(self, request: ResolvedRequest) -> tuple[torch.Tensor, Flux2Layout]:
        granularity = pixel_granularity(self.spec.vae)
        rows, cols = request.height // granularity, request.width // granularity
        shape = (request.batch, self.transformer.config.in_channels, rows, cols)
        noise = seeded_noise(shape, request.seed, self.dtype, self.device)
        return self.pack_drawn(noise, request), Flux2Layout(rows, cols, *self.encode_references(request))

    def pack_drawn(self, latents: torch.Tensor, request: ResolvedRequest) -> torch.Tensor:
        return latents.flatten(2).transpose(1, 2)

    def encode_references(self, request: ResolvedRequest) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """The references encoded and packed into one sequence, at time coordinates 10, 20, ... as in diffusers."""
        if not request.images:
            return None, None
        tokens, ids = [], []
        for index, image in enumerate(request.images):
            if index == 0 and request.mask is not None:
                latents = self.encode_image(image, request.height, request.width, "default")
            else:
                latents = self.encode_image(image, *reference_size(image, pixel_granularity(self.spec.vae)), "crop")
            tokens.append(self.pack_drawn(latents, request))
            _, _, rows, cols = latents.shape
            time = torch.tensor([10 * (index + 1)])
            ids.append(torch.cartesian_prod(time, torch.arange(rows), torch.arange(cols), torch.arange(1)))
        return torch.cat(tokens, dim=1), torch.cat(ids).to(self.device)

    @torch.inference_mode()
    def encode_image(self, image, height: int, width: int, resize_mode: str) -> torch.Tensor:
        """Its latent mode, patchified 2x2, normalised by the VAE's batch-norm statistics: (1, channels, rows, cols)."""
        processor = Flux2ImageProcessor(vae_scale_factor=pixel_granularity(self.spec.vae))
        pixels = processor.preprocess(image, height=height, width=width, resize_mode=resize_mode)
        return packed_latents(self.vae, self.vae_encode(pixels.to(self.device, self.vae.dtype)).mode())

    def image_latents(self, request: ResolvedRequest, generator: torch.Generator) -> torch.Tensor:
        """Inpainting (klein): the image to repaint at the output's size, its latent mode; nothing is drawn."""
        return self.encode_image(request.images[0], request.height, request.width, "default")

    def latent_mask(self, request: ResolvedRequest, image: torch.Tensor) -> torch.Tensor:
        """klein resizes the mask to the token grid bilinearly: its edges blend."""
        return latent_mask(request, image, mode="bilinear")

    def make_scheduler(self, request: ResolvedRequest, latents: torch.Tensor):
        sigmas = np.linspace(1.0, 1 / request.steps, request.steps)
        mu = empirical_mu(latents.shape[1], request.steps)
        return self.scheduled(FlowMatchEulerDiscreteScheduler, sigmas=sigmas, mu=mu)

    def model_call(self, request: ResolvedRequest, conditioning: dict[str, torch.Tensor], layout: Flux2Layout):
        """References follow the target in the image stream (a KV checkpoint attends to their cached keys, values)."""
        embeds = conditioning["embeds"]
        one = torch.arange(1)
        img_ids = torch.cartesian_prod(one, torch.arange(layout.rows), torch.arange(layout.cols), one).to(self.device)
        txt_ids = torch.cartesian_prod(one, one, one, torch.arange(embeds.shape[1])).to(self.device)
        guidance = None
        if self.spec.guidance_mode == "embedded":
            guidance = torch.full((embeds.shape[0],), request.guidance, device=self.device, dtype=torch.float32)
        references, cached = layout.references, layout.reference_kv
        if references is not None and cached is None:
            img_ids = torch.cat([img_ids, layout.reference_ids])
        kept_only = self.keeps_only_output_rows(request)

        def call(transformer, x: torch.Tensor, timestep: torch.Tensor, latents: torch.Tensor) -> torch.Tensor:
            output_tokens = x.shape[1] if kept_only else None
            if references is None or cached is not None:
                return transformer(x, embeds, timestep, img_ids, txt_ids, guidance, cached, output_tokens)
            joined = torch.cat([x, references.to(x.dtype).expand(x.shape[0], -1, -1)], dim=1)
            prediction = transformer(joined, embeds, timestep, img_ids, txt_ids, guidance, None, output_tokens)
            return prediction[:, : x.shape[1]]

        return call

    @torch.inference_mode()
    def decode(self, latents: torch.Tensor, layout: Flux2Layout) -> torch.Tensor:
        return self.vae_decode(unpacked_latents(self.vae, latents, layout.rows, layout.cols))
