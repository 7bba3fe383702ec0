"""Wan 2.2 as diffusers' ``WanPipeline`` and ``WanImageToVideoPipeline`` run it, frame for frame."""

from __future__ import annotations

import html
import math
from dataclasses import dataclass

import diffusers
import regex
import torch
from diffusers.video_processor import VideoProcessor
from torch import nn
from transformers import AutoTokenizer, UMT5Config, UMT5EncoderModel

from paradit.checkpoint import component_dir
from paradit.families.wan.latents import image_input, vae_factors
from paradit.families.wan.model import unpatchify
from paradit.families.wan.presets import WanTextEncoder
from paradit.offline_tokenizer import offline_t5_tokenizer
from paradit.pipelines.base import DiffusionPipeline, latent_statistics, seeded_noise
from paradit.request import ResolvedRequest
from paradit.spec import CheckpointFolder
from paradit.text_encoder import place, random_encoder, warn_if_truncated, weights_device

try:  # diffusers cleans prompts with ftfy when it is installed, and only then; so do we, to read the same tokens
    import ftfy
except ImportError:  # pragma: no cover - depends on the environment
    ftfy = None


def prompt_clean(text: str) -> str:
    """diffusers' ``prompt_clean``: ftfy (when installed), HTML unescaped twice, whitespace runs made one space."""
    if ftfy is not None:
        text = ftfy.fix_text(text)
    text = html.unescape(html.unescape(text)).strip()
    return regex.sub(r"\s+", " ", text).strip()


@dataclass
class ImageCondition:
    """The conditioning video's normalised latents (``channels``: mask first); ``keep``: 1 where noisy latents stay."""

    latents: torch.Tensor
    keep: torch.Tensor | None

    def model_latents(self, latents: torch.Tensor) -> torch.Tensor:
        if self.keep is None:
            return torch.cat([latents, self.latents], dim=1)
        return (1 - self.keep) * self.latents + self.keep * latents


class UMT5PromptEncoder:
    def __init__(self, encoder, tokenizer, max_length: int, device: torch.device, placement: str = "gpu") -> None:
        self.encoder = place(encoder.eval().requires_grad_(False), placement, device)
        self.tokenizer, self.max_length, self.device = tokenizer, max_length, device

    def modules(self) -> list[nn.Module]:
        return [self.encoder]

    @classmethod
    def from_folder(
        cls,
        weights: CheckpointFolder,
        spec: WanTextEncoder,
        device: torch.device,
        dtype: torch.dtype,
        placement: str = "gpu",
    ) -> UMT5PromptEncoder:
        encoder = UMT5EncoderModel.from_pretrained(
            component_dir(weights.path, "text_encoder"),
            dtype=dtype,
            device_map=weights_device(placement, device),
            use_safetensors=weights.use_safetensors("text_encoder"),
        )
        tokenizer = AutoTokenizer.from_pretrained(component_dir(weights.path, "tokenizer"))
        return cls(encoder, tokenizer, spec.max_length, device, placement)

    @classmethod
    def dummy(
        cls, spec: WanTextEncoder, device: torch.device, dtype: torch.dtype, placement: str = "gpu"
    ) -> UMT5PromptEncoder:
        config = UMT5Config.from_dict({k: v for k, v in spec.config.items() if k != "model_type"})
        encoder = random_encoder(lambda: UMT5EncoderModel._from_config(config, dtype=dtype), placement, device, dtype)
        return cls(encoder, offline_t5_tokenizer(), spec.max_length, device, placement)

    @torch.no_grad()
    def encode(self, prompts: list[str], dtype: torch.dtype) -> torch.Tensor:
        """(batch, max_length, width): each prompt's features, zero past its length, as diffusers makes them."""
        prompts = [prompt_clean(p) for p in prompts]
        warn_if_truncated(self.tokenizer, prompts, self.max_length, "umT5")
        inputs = self.tokenizer(
            prompts,
            padding="max_length",
            max_length=self.max_length,
            truncation=True,
            add_special_tokens=True,
            return_attention_mask=True,
            return_tensors="pt",
        )
        mask = inputs.attention_mask.to(self.device)
        hidden = self.encoder(inputs.input_ids.to(self.device), mask).last_hidden_state.to(dtype)
        # The padding's features are not what the model was trained on: zeroed, as the reference zeroes them.
        return hidden * mask.gt(0)[..., None].to(dtype)


class WanPipeline(DiffusionPipeline):
    def initial_latents(self, request: ResolvedRequest) -> tuple[torch.Tensor, ImageCondition | None]:
        """Seeded noise, float32 as the reference draws it, and what the request's image adds."""
        temporal, spatial = vae_factors(self.spec.vae)
        frames = (request.frames - 1) // temporal + 1
        shape = (request.batch, self.vae.config.z_dim, frames, request.height // spatial, request.width // spatial)
        noise = seeded_noise(shape, request.seed, torch.float32, self.device)
        return noise, self.image_condition(request, noise) if request.images else None

    @torch.inference_mode()
    def image_condition(self, request: ResolvedRequest, noise: torch.Tensor) -> ImageCondition:
        """The image as a one-frame video (``first_frame``) or before black frames (``channels``), as the reference."""
        temporal, spatial = vae_factors(self.spec.vae)
        processor = VideoProcessor(vae_scale_factor=spatial)
        pixels = processor.preprocess(request.images[0], height=request.height, width=request.width).unsqueeze(2)
        mode = image_input(self.spec)
        if mode == "channels":
            pixels = torch.cat([pixels, pixels.new_zeros(*pixels.shape[:2], request.frames - 1, *pixels.shape[3:])], 2)
        encoded = self.vae_encode(pixels.to(self.device, self.vae.dtype)).mode().float()
        mean, inverse_std = latent_statistics(self.vae.config, encoded)
        latents = ((encoded - mean) * inverse_std).repeat(noise.shape[0], 1, 1, 1, 1)
        if mode == "first_frame":
            keep = torch.ones(1, 1, *noise.shape[2:], device=self.device)
            keep[:, :, 0] = 0
            return ImageCondition(latents, keep)
        # The first frame's latent stands for ``temporal`` pixel frames; each gets its own mask channel, all 1.
        mask = torch.zeros(noise.shape[0], temporal, *noise.shape[2:], device=self.device)
        mask[:, :, 0] = 1
        return ImageCondition(torch.cat([mask, latents], dim=1), None)

    def make_scheduler(self, request: ResolvedRequest, latents: torch.Tensor):
        scheduler_class = getattr(diffusers, self.spec.scheduler.get("_class_name", "UniPCMultistepScheduler"))
        return self.scheduled(scheduler_class, num_inference_steps=request.steps)

    def expert_at(self, request: ResolvedRequest, t: torch.Tensor) -> tuple[str, float | None]:
        """``transformer`` (high noise) at t >= the boundary, ``transformer_2`` below, each with its guidance scale."""
        ratio = self.spec.details.boundary_ratio
        if ratio is not None and "transformer_2" in self.experts:
            if float(t) < ratio * self.spec.scheduler.get("num_train_timesteps", 1000):
                return "transformer_2", request.guidance_2
        return "transformer", request.guidance

    def model_inputs(
        self, request: ResolvedRequest, latents: torch.Tensor, t: torch.Tensor, layout: ImageCondition | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """TI2V-5B's timestep is per token as in the reference (0 on the image's frame); an image joins the latents."""
        config = self.transformer.config
        if self.spec.details.expand_timesteps and layout is not None:  # the reference's mask, per token, times t
            keep = layout.keep[0, 0, :: config.patch_size[0], :: config.patch_size[1], :: config.patch_size[2]]
            timestep = (keep * t).flatten().expand(latents.shape[0], -1)
        elif self.spec.details.expand_timesteps:  # every token at t
            tokens = math.prod(config.token_grid(*latents.shape[2:]))
            timestep = torch.full((latents.shape[0], tokens), float(t), device=latents.device)
        else:
            timestep = t.expand(latents.shape[0])
        model_latents = latents if layout is None else layout.model_latents(latents)
        return model_latents.to(self.dtype), timestep

    def model_call(self, request: ResolvedRequest, conditioning: dict[str, torch.Tensor], layout):
        embeds, config = conditioning["embeds"], self.transformer.config

        def call(transformer, x: torch.Tensor, timestep: torch.Tensor, latents: torch.Tensor) -> torch.Tensor:
            grid = config.token_grid(*latents.shape[2:])
            return unpatchify(transformer(x, timestep, embeds), grid, config.patch_size).float()

        return call

    @torch.inference_mode()
    def decode(self, latents: torch.Tensor, layout: ImageCondition | None) -> torch.Tensor:
        """Frames (batch, frames, 3, H, W), TI2V's image frame put back, divided by 1 / std as the reference does."""
        if layout is not None and layout.keep is not None:
            latents = layout.model_latents(latents)
        latents = latents.to(self.vae.dtype)
        mean, inverse_std = latent_statistics(self.vae.config, latents)
        return self.vae_decode(latents / inverse_std + mean).transpose(1, 2)
