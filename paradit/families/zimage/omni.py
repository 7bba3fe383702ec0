"""Z-Image-Omni, as diffusers' ``ZImageOmniPipeline``. One deliberate difference: diffusers casts condition images to
bfloat16 for the VAE (a float32 VAE then fails); paradit uses the VAE's dtype, for a bfloat16 run the same."""

from __future__ import annotations

from typing import Any

import torch
import transformers
from diffusers.pipelines.flux2.image_processor import Flux2ImageProcessor
from torch import nn

from paradit.checkpoint import component_dir
from paradit.families.zimage.latents import pixel_granularity
from paradit.families.zimage.model import OmniInputs
from paradit.families.zimage.pipeline import CaptionEncoder, ZImagePipeline
from paradit.families.zimage.presets import OmniEncoders
from paradit.pipelines.base import pad_rows
from paradit.request import ResolvedRequest
from paradit.spec import CheckpointFolder
from paradit.text_encoder import place, random_encoder, weights_device


def template_segments(prompt: str, images: int) -> list[str]:
    """The user turn cut before each image (the condition images, then the target) and after the last."""
    if not images:
        return [f"<|im_start|>user\n{prompt}<|im_end|>\n<|im_start|>assistant\n"]
    return [
        "<|im_start|>user\n<|vision_start|>",
        *["<|vision_end|><|vision_start|>"] * (images - 1),
        f"<|vision_end|>{prompt}<|im_end|>\n<|im_start|>assistant\n<|vision_start|>",
        "<|vision_end|><|im_end|>",
    ]


class OmniPromptEncoder(CaptionEncoder):
    """Qwen3 reading the template's pieces as they are, and SigLIP2 reading the condition images."""

    templated = False
    siglip: nn.Module
    siglip_processor: Any

    def modules(self) -> list[nn.Module]:
        return [self.decoder, self.siglip]

    @classmethod
    def from_folder(
        cls,
        weights: CheckpointFolder,
        spec: OmniEncoders,
        device: torch.device,
        dtype: torch.dtype,
        placement: str = "gpu",
    ) -> OmniPromptEncoder:
        encoder = super().from_folder(weights, spec.captions, device, dtype, placement)
        siglip = transformers.Siglip2VisionModel.from_pretrained(
            component_dir(weights.path, "siglip"),
            dtype=dtype,
            device_map=weights_device(placement, device),
            use_safetensors=weights.use_safetensors("siglip"),
        )
        encoder.siglip = place(siglip.eval().requires_grad_(False), placement, device)
        processor = component_dir(weights.path, "siglip_processor")
        encoder.siglip_processor = transformers.Siglip2ImageProcessor.from_pretrained(processor)
        return encoder

    @classmethod
    def dummy(
        cls, spec: OmniEncoders, device: torch.device, dtype: torch.dtype, placement: str = "gpu", seed: int = 0
    ) -> OmniPromptEncoder:
        encoder = super().dummy(spec.captions, device, dtype, placement, seed)
        config = transformers.Siglip2VisionConfig(**spec.siglip)
        siglip = random_encoder(
            lambda: transformers.AutoModel.from_config(config, dtype=dtype), placement, device, dtype, seed
        )
        encoder.siglip = place(siglip, placement, device)
        encoder.siglip_processor = transformers.Siglip2ImageProcessor(
            patch_size=config.patch_size, max_num_patches=config.num_patches
        )
        return encoder

    @torch.no_grad()
    def read_images(self, images: tuple, dtype: torch.dtype) -> tuple[torch.Tensor, list[tuple[int, int]]]:
        """Each image's last hidden states over its (h, w) patch grid, one image after another; and the grids."""
        features, grids = [], []
        for image in images:
            inputs = self.siglip_processor(images=[image], return_tensors="pt").to(self.device)
            height, width = inputs["spatial_shapes"][0].tolist()
            features.append(self.siglip(**inputs).last_hidden_state[0, : height * width].to(dtype))
            grids.append((height, width))
        empty = torch.empty(0, self.siglip.config.hidden_size, dtype=dtype, device=self.device)
        return torch.cat([empty, *features]), grids


class ZImageOmniPipeline(ZImagePipeline):
    CONDITIONING = ("embeds", "segments", "siglip", "siglip_grids")

    def encode(self, request: ResolvedRequest) -> dict[str, torch.Tensor]:
        """Per row: its caption's pieces' features one after another and their lengths; the images' SigLIP features."""
        rows, segments = [], []
        for prompts in self.branch_prompts(request):
            texts = [template_segments(prompt, len(request.images)) for prompt in prompts]
            features = iter(self.prompt_encoder.encode([text for pieces in texts for text in pieces], self.dtype))
            for pieces in texts:
                parts = [next(features) for _ in pieces]
                rows += [torch.cat(parts).to(self.device)] * request.images_per_prompt
                segments += [[len(part) for part in parts]] * request.images_per_prompt
        siglip, grids = self.prompt_encoder.read_images(request.images, self.dtype)
        grids = torch.tensor(grids, dtype=torch.long, device=self.device).view(1, -1, 2).expand(len(rows), -1, -1)
        return {
            "embeds": pad_rows(rows)[0],
            "segments": torch.tensor(segments, device=self.device),
            "siglip": siglip.expand(len(rows), -1, -1),
            "siglip_grids": grids,
        }

    def initial_latents(self, request: ResolvedRequest) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
        noise, _ = super().initial_latents(request)
        return noise, self.encode_conditions(request)

    @torch.inference_mode()
    def encode_conditions(self, request: ResolvedRequest) -> tuple[torch.Tensor, ...]:
        granularity = pixel_granularity(self.spec.vae)
        processor = Flux2ImageProcessor(vae_scale_factor=granularity)
        latents = []
        for image in request.images:
            height, width = image.height // granularity * granularity, image.width // granularity * granularity
            pixels = processor.preprocess(image, height=height, width=width, resize_mode="crop")
            mode = self.vae_encode(pixels.to(self.device, self.vae.dtype)).mode()
            latents.append(((mode - self.vae.config.shift_factor) * self.vae.config.scaling_factor).to(self.dtype))
        return tuple(latents)

    def transformer_inputs(self, conditioning: dict[str, torch.Tensor], layout: tuple[torch.Tensor, ...]) -> tuple:
        grids = [tuple(grid) for grid in conditioning["siglip_grids"][0].tolist()]
        features = conditioning["siglip"].split([height * width for height, width in grids], dim=1)
        siglip = tuple(part.unflatten(1, grid) for part, grid in zip(features, grids))
        omni = OmniInputs.build(conditioning["segments"].tolist(), layout, siglip, self.device)
        return conditioning["embeds"], None, omni
