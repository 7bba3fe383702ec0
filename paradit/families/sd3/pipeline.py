"""Stable Diffusion 3 / 3.5 as ``StableDiffusion3Pipeline`` and its image-to-image and inpainting pipelines run it."""

from __future__ import annotations

import torch
import transformers
from diffusers import FlowMatchEulerDiscreteScheduler
from diffusers.image_processor import VaeImageProcessor
from tokenizers import pre_tokenizers
from torch import nn
from transformers import CLIPTextConfig, CLIPTextModelWithProjection, T5Config, T5EncoderModel

from paradit.checkpoint import component_dir, read_json
from paradit.families.sd3.latents import vae_scale_factor
from paradit.families.sd3.model import unpatchify
from paradit.families.sd3.presets import SD3TextEncoders
from paradit.offline_tokenizer import offline_t5_tokenizer
from paradit.pipelines.base import DiffusionPipeline, seeded_noise
from paradit.request import ResolvedRequest
from paradit.spec import CheckpointFolder
from paradit.text_encoder import place, random_encoder, warn_if_truncated, weights_device

CLIP_LENGTH = 77


def offline_clip_tokenizer(pad_token: str) -> transformers.CLIPTokenizer:
    """A byte-level CLIP tokenizer for random-weight runs, start and end tokens last (pooling reads the highest id)."""
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    symbols = [*alphabet, *(symbol + "</w>" for symbol in alphabet), "<|startoftext|>", "<|endoftext|>"]
    vocab = {symbol: i for i, symbol in enumerate(symbols)}
    return transformers.CLIPTokenizer(vocab=vocab, merges=[], pad_token=pad_token, model_max_length=CLIP_LENGTH)


class SD3PromptEncoder:
    """CLIP-L, OpenCLIP bigG and T5 with their tokenizers: diffusers' ``prompt_embeds`` and ``pooled_prompt_embeds``."""

    def __init__(
        self,
        clip_encoders: list[nn.Module],
        t5: nn.Module,
        tokenizers: list,
        max_sequence_length: int,
        device: torch.device,
        placement: str = "gpu",
    ) -> None:
        self.clip_encoders = [
            place(encoder.eval().requires_grad_(False), placement, device) for encoder in clip_encoders
        ]
        self.t5 = place(t5.eval().requires_grad_(False), placement, device)
        self.device = device
        self.clip_tokenizers, self.t5_tokenizer = tokenizers[:2], tokenizers[2]
        self.max_sequence_length = max_sequence_length
        # Both CLIP tokenizers pad to the first one's length, as the reference pipeline does.
        self.clip_length = self.clip_tokenizers[0].model_max_length

    def modules(self) -> list[nn.Module]:
        return [*self.clip_encoders, self.t5]

    @classmethod
    def from_folder(
        cls,
        weights: CheckpointFolder,
        spec: SD3TextEncoders,
        device: torch.device,
        dtype: torch.dtype,
        placement: str = "gpu",
    ) -> SD3PromptEncoder:
        folder, placed = weights.path, weights_device(placement, device)
        index = read_json(folder / "model_index.json")

        def load(model_class, name: str) -> nn.Module:
            return model_class.from_pretrained(
                component_dir(folder, name),
                dtype=dtype,
                device_map=placed,
                use_safetensors=weights.use_safetensors(name),
            )

        clip_encoders = [load(CLIPTextModelWithProjection, name) for name in ("text_encoder", "text_encoder_2")]
        t5 = load(T5EncoderModel, "text_encoder_3")
        tokenizers = [
            getattr(transformers, index[name][1]).from_pretrained(component_dir(folder, name))
            for name in ("tokenizer", "tokenizer_2", "tokenizer_3")
        ]
        return cls(clip_encoders, t5, tokenizers, spec.max_sequence_length, device, placement)

    @classmethod
    def dummy(
        cls, spec: SD3TextEncoders, device: torch.device, dtype: torch.dtype, placement: str = "gpu", seed: int = 0
    ) -> SD3PromptEncoder:
        def random(model_class, config: transformers.PretrainedConfig, offset: int) -> nn.Module:
            return random_encoder(
                lambda: model_class._from_config(config, dtype=dtype), placement, device, dtype, seed + offset
            )

        clip_l = random(CLIPTextModelWithProjection, CLIPTextConfig.from_dict(spec.clip_l), 0)
        clip_g = random(CLIPTextModelWithProjection, CLIPTextConfig.from_dict(spec.clip_g), 1)
        t5 = random(T5EncoderModel, T5Config.from_dict(spec.t5), 2)
        # The published bigG tokenizer pads with "!", CLIP-L's with its end token.
        tokenizers = [offline_clip_tokenizer("<|endoftext|>"), offline_clip_tokenizer("!"), offline_t5_tokenizer()]
        return cls([clip_l, clip_g], t5, tokenizers, spec.max_sequence_length, device, placement)

    def _clip(self, which: int, prompts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
        """(penultimate hidden states, pooled projection) of CLIP encoder ``which``."""
        ids = self.clip_tokenizers[which](
            prompts, padding="max_length", max_length=self.clip_length, truncation=True, return_tensors="pt"
        ).input_ids
        output = self.clip_encoders[which](ids.to(self.device), output_hidden_states=True)
        return output.hidden_states[-2], output.text_embeds

    @torch.no_grad()
    def encode(self, prompts: list[str], dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """(batch, clip length + max_sequence_length, T5 width) embeddings and (batch, pooled width) vectors."""
        warn_if_truncated(self.clip_tokenizers[0], prompts, self.clip_length, "CLIP")  # once: both CLIPs read them
        (hidden_l, pooled_l), (hidden_g, pooled_g) = self._clip(0, prompts), self._clip(1, prompts)
        warn_if_truncated(self.t5_tokenizer, prompts, self.max_sequence_length, "T5")
        ids = self.t5_tokenizer(
            prompts,
            padding="max_length",
            max_length=self.max_sequence_length,
            truncation=True,
            add_special_tokens=True,
            return_tensors="pt",
        ).input_ids
        t5_hidden = self.t5(ids.to(self.device))[0]
        clip_hidden = torch.cat([hidden_l, hidden_g], dim=-1)
        clip_hidden = nn.functional.pad(clip_hidden, (0, t5_hidden.shape[-1] - clip_hidden.shape[-1]))
        embeds = torch.cat([clip_hidden.to(t5_hidden.device, t5_hidden.dtype), t5_hidden], dim=-2)
        return embeds.to(dtype), torch.cat([pooled_l, pooled_g], dim=-1).to(dtype)


class SD3Pipeline(DiffusionPipeline):
    CONDITIONING = ("embeds", "pooled")

    def encode(self, request: ResolvedRequest) -> dict[str, torch.Tensor]:
        prompts = [prompt for branch in self.branch_prompts(request) for prompt in branch]  # one encoder call
        encoded = self.prompt_encoder.encode(prompts, self.dtype)
        return {
            name: tensor.to(self.device).repeat_interleave(request.images_per_prompt, dim=0)
            for name, tensor in zip(self.CONDITIONING, encoded)
        }

    def initial_latents(self, request: ResolvedRequest) -> tuple[torch.Tensor, None]:
        stride = vae_scale_factor(self.spec.vae)
        shape = (request.batch, self.transformer.config.in_channels, request.height // stride, request.width // stride)
        return seeded_noise(shape, request.seed, self.dtype, self.device), None

    def make_scheduler(self, request: ResolvedRequest, latents: torch.Tensor):
        return self.scheduled(FlowMatchEulerDiscreteScheduler, num_inference_steps=request.steps)

    @torch.inference_mode()
    def image_latents(self, request: ResolvedRequest, generator: torch.Generator) -> torch.Tensor:
        processor = VaeImageProcessor(vae_scale_factor=vae_scale_factor(self.spec.vae))
        pixels = processor.preprocess(request.images[0], height=request.height, width=request.width)
        sample = self.vae_encode(pixels.to(self.device, self.vae.dtype)).sample(generator)
        return (sample - self.vae.config.shift_factor) * self.vae.config.scaling_factor

    def model_inputs(self, request: ResolvedRequest, latents: torch.Tensor, t: torch.Tensor, layout):
        return latents, t.expand(latents.shape[0])

    def model_call(self, request: ResolvedRequest, conditioning: dict[str, torch.Tensor], layout: None):
        embeds, pooled, patch = conditioning["embeds"], conditioning["pooled"], self.transformer.config.patch_size

        def call(transformer, x: torch.Tensor, timestep: torch.Tensor, latents: torch.Tensor) -> torch.Tensor:
            return unpatchify(transformer(x, embeds, pooled, timestep), patch, *latents.shape[-2:])

        return call

    @torch.inference_mode()
    def decode(self, latents: torch.Tensor, layout: None) -> torch.Tensor:
        latents = latents / self.vae.config.scaling_factor + self.vae.config.shift_factor
        return self.vae_decode(latents.to(self.vae.dtype))
