"""Qwen-Image text-to-image: prompt encoding, seeded latents, denoising with true CFG, VAE decoding.

Reproduces diffusers' ``QwenImagePipeline``: the same checkpoint, request and seed give the same image.

- Prompts go through Qwen-Image's chat template and are read from Qwen2.5-VL's last hidden state (after the final norm),
  the template's leading tokens dropped, prompts of different lengths padded and masked.
- CFG (``true_cfg_scale``) runs only above 1 with a negative prompt, each token rescaled to the conditional norm.
- The scheduler's shift ``mu`` is linear in the image token count, from the scheduler config.

Differences for speed only: the unconditional branch joins the conditional batch (or, under CFG parallelism, the group's
other half), padded to one text length and masked; the vision tower and LM head, which text prompts never reach, never
run. One deliberate difference: with prompts of differing lengths and several images each, each image keeps its own
prompt's text mask; diffusers' ``encode_prompt`` repeats embeddings image by image, but tiles masks prompt by prompt."""

from __future__ import annotations

import numpy as np
import torch
import transformers
from diffusers import FlowMatchEulerDiscreteScheduler
from diffusers.image_processor import VaeImageProcessor
from torch import nn

from paradit.checkpoint import component_dir
from paradit.offline_tokenizer import build_offline_tokenizer
from paradit.pipelines.base import DiffusionPipeline, dynamic_shift, latent_statistics, pad_rows, seeded_noise
from paradit.pipelines.requests import ResolvedRequest
from paradit.spec import CheckpointFolder
from paradit.text_encoder import place, random_encoder, warn_if_truncated, weights_device

PROMPT_TEMPLATE = (
    "<|im_start|>system\nDescribe the image by detailing the color, shape, size, texture, quantity, text, spatial "
    "relationships of the objects and background:<|im_end|>\n<|im_start|>user\n{}<|im_end|>\n"
    "<|im_start|>assistant\n"
)
# Hidden states dropped from the front of every encoded prompt: the system turn and "<|im_start|>user\n", 34 tokens
# in Qwen2.5-VL's tokenizer. diffusers drops this count whatever the tokenizer, and so does paradit.
TEMPLATE_PREFIX_TOKENS = 34
# Tokenizer limit past the prefix; embeddings are cut to MAX_SEQUENCE_LENGTH (diffusers' ``max_sequence_length``).
TOKENIZER_MAX_LENGTH = 1024
MAX_SEQUENCE_LENGTH = 512


def pixel_granularity(vae_config: dict) -> int:
    """Pixels per latent token side: the VAE's spatial stride, doubled by the 2x2 packing."""
    return 2 ** len(vae_config.get("temperal_downsample", [False, True, True])) * 2


class QwenPromptEncoder:
    """Tokenizer + the Qwen2.5-VL language model running on ``device``; ``encode`` gives each prompt's last hidden
    states past the template prefix, padded to the longest in the batch, with the mask of real tokens."""

    def __init__(self, language_model: nn.Module, tokenizer, device: torch.device) -> None:
        self.language_model, self.tokenizer, self.device = language_model, tokenizer, device

    def modules(self) -> list[nn.Module]:
        return [self.language_model]

    @classmethod
    def from_folder(cls, weights: CheckpointFolder, config: dict, device: torch.device, dtype: torch.dtype,
                    placement: str = "gpu") -> QwenPromptEncoder:  # fmt: skip
        """``config`` is the folder's own, which transformers reads again."""
        model = transformers.Qwen2_5_VLForConditionalGeneration.from_pretrained(
            component_dir(weights.path, "text_encoder"), dtype=dtype, device_map=weights_device(placement, device),
            use_safetensors=weights.use_safetensors("text_encoder"),
        )  # fmt: skip
        tokenizer = transformers.AutoTokenizer.from_pretrained(component_dir(weights.path, "tokenizer"))
        # Keeping only the language model frees the vision tower and the LM head once loading returns.
        language_model = model.model.language_model.eval().requires_grad_(False)
        return cls(place(language_model, placement, device), tokenizer, device)

    @classmethod
    def dummy(
        cls, config: dict, device: torch.device, dtype: torch.dtype, placement: str = "gpu", seed: int = 0
    ) -> QwenPromptEncoder:
        text_config = transformers.Qwen2_5_VLTextConfig(**config["text_config"])
        model = random_encoder(
            lambda: transformers.AutoModel.from_config(text_config, dtype=dtype), placement, device, dtype, seed
        )
        tokenizer = build_offline_tokenizer(TOKENIZER_MAX_LENGTH + TEMPLATE_PREFIX_TOKENS)
        return cls(place(model, placement, device), tokenizer, device)

    @torch.no_grad()
    def encode(self, prompts: list[str], dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """(batch, tokens, hidden) embeddings and the (batch, tokens) bool mask of real tokens."""
        texts = [PROMPT_TEMPLATE.format(prompt) for prompt in prompts]
        warn_if_truncated(self.tokenizer, texts, MAX_SEQUENCE_LENGTH + TEMPLATE_PREFIX_TOKENS)
        length = TOKENIZER_MAX_LENGTH + TEMPLATE_PREFIX_TOKENS
        inputs = self.tokenizer(texts, max_length=length, padding=True, truncation=True, return_tensors="pt")
        attention_mask = inputs["attention_mask"].to(self.device)
        hidden = self.language_model(input_ids=inputs["input_ids"].to(self.device), attention_mask=attention_mask)
        hidden = hidden.last_hidden_state
        # Real tokens wherever the padding put them, then the template prefix off the front of each prompt.
        prompts_hidden = [
            h[m.bool()][TEMPLATE_PREFIX_TOKENS:][:MAX_SEQUENCE_LENGTH].to(dtype) for h, m in zip(hidden, attention_mask)
        ]
        return pad_rows(prompts_hidden)


class QwenImagePipeline(DiffusionPipeline):
    CONDITIONING = ("embeds", "mask")

    def encode(self, request: ResolvedRequest) -> dict[str, torch.Tensor]:
        """[conditional; unconditional] embeddings and mask, branches encoded apart as diffusers does, then padded."""

        def rows(prompts: list[str]) -> list[torch.Tensor]:
            embeds, mask = self.prompt_encoder.encode(prompts, self.dtype)
            return [row[keep] for row, keep in zip(embeds, mask)]

        return self.encode_rows(request, rows)

    def initial_latents(self, request: ResolvedRequest) -> tuple[torch.Tensor, tuple[int, int]]:
        """Noise drawn as diffusers draws it (in the unpacked (batch, 1, channels, 2 * rows, 2 * cols) layout),
        packed 2x2 into (batch, rows * cols, 4 * channels); returns it with the token grid's rows and columns."""
        granularity = pixel_granularity(self.spec.vae)
        rows, cols = request.height // granularity, request.width // granularity
        channels = self.transformer.config.in_channels // 4
        noise = seeded_noise((request.batch, 1, channels, 2 * rows, 2 * cols), request.seed, self.dtype, self.device)
        return self.pack_drawn(noise, request), (rows, cols)

    def pack_drawn(self, latents: torch.Tensor, request: ResolvedRequest) -> torch.Tensor:
        """(batch, 1, channels, 2 * rows, 2 * cols) packed 2x2 into (batch, rows * cols, 4 * channels)."""
        batch, _, channels, height, width = latents.shape
        packed = latents.reshape(batch, channels, height // 2, 2, width // 2, 2).permute(0, 2, 4, 1, 3, 5)
        return packed.reshape(batch, height // 2 * (width // 2), channels * 4)

    @torch.inference_mode()
    def image_latents(self, request: ResolvedRequest, generator: torch.Generator) -> torch.Tensor:
        """The image resized to the output's size (diffusers' ``QwenImageImg2ImgPipeline``), as a one-frame video,
        a sample of its latent distribution normalised by the VAE's statistics, in the noise's drawn layout."""
        processor = VaeImageProcessor(vae_scale_factor=pixel_granularity(self.spec.vae))
        pixels = processor.preprocess(request.images[0], height=request.height, width=request.width).unsqueeze(2)
        sample = self.vae_encode(pixels.to(self.device, self.vae.dtype)).sample(generator)
        mean, inverse_std = latent_statistics(self.vae.config, sample)
        return ((sample - mean) * inverse_std).transpose(1, 2)

    def make_scheduler(self, request: ResolvedRequest, latents: torch.Tensor):
        sigmas = np.linspace(1.0, 1 / request.steps, request.steps)
        mu = dynamic_shift(latents.shape[1], self.spec.scheduler)
        return self.scheduled(FlowMatchEulerDiscreteScheduler, sigmas=sigmas, mu=mu)

    def model_call(self, request: ResolvedRequest, conditioning: dict[str, torch.Tensor], layout: tuple[int, int]):
        embeds, mask = conditioning["embeds"], conditioning["mask"]
        return lambda transformer, x, timestep, latents: transformer(x, embeds, timestep, *layout, mask)

    def guide(self, cond: torch.Tensor, uncond: torch.Tensor, scale: float) -> torch.Tensor:
        """Qwen-Image keeps each token's guided prediction at the conditional branch's norm."""
        guided = uncond + scale * (cond - uncond)
        return guided * (cond.norm(dim=-1, keepdim=True) / guided.norm(dim=-1, keepdim=True))

    @torch.inference_mode()
    def decode(self, latents: torch.Tensor, layout: tuple[int, int]) -> torch.Tensor:
        rows, cols = layout
        batch, _, packed_channels = latents.shape
        channels = packed_channels // 4
        latents = latents.view(batch, rows, cols, channels, 2, 2).permute(0, 3, 1, 4, 2, 5)
        latents = latents.reshape(batch, channels, 1, 2 * rows, 2 * cols).to(self.vae.dtype)
        mean, inverse_std = latent_statistics(self.vae.config, latents)
        return self.vae_decode(latents / inverse_std + mean)[:, :, 0]
