"""Qwen-Image and -Edit as diffusers' ``QwenImagePipeline`` and its image-to-image, inpainting and edit pipelines run
them. One deliberate difference: each image keeps its prompt's text mask (diffusers tiles masks prompt by prompt)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import transformers
from diffusers import FlowMatchEulerDiscreteScheduler
from diffusers.image_processor import VaeImageProcessor
from torch import nn

from paradit.checkpoint import component_dir
from paradit.families.qwen_image.edit import EditInputs
from paradit.families.qwen_image.latents import pixel_granularity
from paradit.offline_tokenizer import VISION_TOKENS, build_offline_tokenizer
from paradit.pipelines.base import DiffusionPipeline, dynamic_shift, latent_statistics, pad_rows, seeded_noise
from paradit.request import ResolvedRequest
from paradit.spec import CheckpointFolder, read_configs
from paradit.text_encoder import place, random_encoder, warn_if_truncated, weights_device

_CONFIGS = read_configs(__file__)
# diffusers' prompt templates. Their system turn and "<|im_start|>user\n" are dropped as diffusers drops them, whatever
# the tokenizer: 34 of Qwen2.5-VL's tokens, 64 of Edit's (whose user turn then starts with the input images' markers).
PROMPT_TEMPLATE = _CONFIGS["prompt_template"]
TEMPLATE_PREFIX_TOKENS = 34
EDIT_TEMPLATE = _CONFIGS["edit_template"]
EDIT_PREFIX_TOKENS = 64
IMAGE_MARKER = "<|vision_start|><|image_pad|><|vision_end|>"
# Tokenizer limit past the prefix; embeddings are cut to MAX_SEQUENCE_LENGTH (diffusers' ``max_sequence_length``).
TOKENIZER_MAX_LENGTH = 1024
MAX_SEQUENCE_LENGTH = 512


def load_qwen25_vl(weights: CheckpointFolder, device: torch.device, dtype: torch.dtype, placement: str) -> nn.Module:
    """Qwen2.5-VL without its LM head."""
    model = transformers.Qwen2_5_VLForConditionalGeneration.from_pretrained(
        component_dir(weights.path, "text_encoder"),
        dtype=dtype,
        device_map=weights_device(placement, device),
        use_safetensors=weights.use_safetensors("text_encoder"),
    )
    return model.model.eval().requires_grad_(False)


class QwenPromptEncoder:
    """Qwen2.5-VL's language model alone: its vision tower and LM head are freed once loading returns."""

    def __init__(self, model: nn.Module, tokenizer, device: torch.device, image_processor=None) -> None:
        self.model, self.tokenizer, self.device, self.image_processor = model, tokenizer, device, image_processor

    def modules(self) -> list[nn.Module]:
        return [self.model]

    @classmethod
    def from_folder(
        cls, weights: CheckpointFolder, config: dict, device: torch.device, dtype: torch.dtype, placement: str = "gpu"
    ) -> QwenPromptEncoder:
        """``config`` is the folder's own, which transformers reads again."""
        language_model = load_qwen25_vl(weights, device, dtype, placement).language_model
        tokenizer = transformers.AutoTokenizer.from_pretrained(component_dir(weights.path, "tokenizer"))
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
        """(batch, tokens, hidden) last hidden states past the template prefix, and the bool mask of real tokens."""
        texts = [PROMPT_TEMPLATE.format(prompt) for prompt in prompts]
        warn_if_truncated(self.tokenizer, texts, MAX_SEQUENCE_LENGTH + TEMPLATE_PREFIX_TOKENS)
        length = TOKENIZER_MAX_LENGTH + TEMPLATE_PREFIX_TOKENS
        inputs = self.tokenizer(texts, max_length=length, padding=True, truncation=True, return_tensors="pt")
        mask = inputs["attention_mask"].to(self.device)
        hidden = self.model(input_ids=inputs["input_ids"].to(self.device), attention_mask=mask).last_hidden_state
        return pad_rows(
            [h[m.bool()][TEMPLATE_PREFIX_TOKENS:][:MAX_SEQUENCE_LENGTH].to(dtype) for h, m in zip(hidden, mask)]
        )


IMAGE_PAD = "<|image_pad|>"


def widen_image_markers(text: str, counts) -> str:
    """``text`` with each image marker repeated as many times as the next image of ``counts`` has merged patches."""
    first, *rest = text.split(IMAGE_PAD)
    return first + "".join(IMAGE_PAD * next(counts) + part for part in rest)


class QwenVisionPromptEncoder(QwenPromptEncoder):
    """Qwen-Image-Edit's Qwen2.5-VL and vision tower; markers widened here (Qwen2VLProcessor needs torchvision)."""

    @classmethod
    def from_folder(
        cls, weights: CheckpointFolder, config: dict, device: torch.device, dtype: torch.dtype, placement: str = "gpu"
    ) -> QwenVisionPromptEncoder:
        model = place(load_qwen25_vl(weights, device, dtype, placement), placement, device)
        processor = component_dir(weights.path, "processor")
        tokenizer = transformers.AutoTokenizer.from_pretrained(processor)
        return cls(model, tokenizer, device, transformers.AutoImageProcessor.from_pretrained(processor))

    @classmethod
    def dummy(
        cls, config: dict, device: torch.device, dtype: torch.dtype, placement: str = "gpu", seed: int = 0
    ) -> QwenVisionPromptEncoder:
        tokenizer = build_offline_tokenizer(TOKENIZER_MAX_LENGTH + TEMPLATE_PREFIX_TOKENS)
        # The image markers where the offline tokenizer has them (the published ids are past its vocabulary).
        names = ("vision_start_token_id", "vision_end_token_id", "image_token_id", "video_token_id")
        markers = dict(zip(names, tokenizer.convert_tokens_to_ids(VISION_TOKENS)))
        settings = {key: value for key, value in config.items() if key != "model_type"}
        vl_config = transformers.Qwen2_5_VLConfig(**{**settings, **markers})
        model = random_encoder(
            lambda: transformers.AutoModel.from_config(vl_config, dtype=dtype), placement, device, dtype, seed
        )
        vision = config["vision_config"]
        # transformers names its PIL-backed processor apart since 5.x, where the plain name wants torchvision.
        processor_class = getattr(transformers, "Qwen2VLImageProcessorPil", None) or transformers.Qwen2VLImageProcessor
        image_processor = processor_class(
            patch_size=vision["patch_size"],
            temporal_patch_size=vision["temporal_patch_size"],
            merge_size=vision["spatial_merge_size"],
        )
        return cls(place(model, placement, device), tokenizer, device, image_processor)

    @torch.no_grad()
    def encode(self, texts: list[str], images: list, dtype: torch.dtype) -> list[torch.Tensor]:
        """Each text's (tokens, hidden) last hidden states, the template's included; its markers read ``images``."""
        vision = self.image_processor(images=images * len(texts), return_tensors="pt")
        counts = iter((vision["image_grid_thw"].prod(-1) // self.image_processor.merge_size**2).tolist())
        texts = [widen_image_markers(text, counts) for text in texts]
        inputs = self.tokenizer(texts, padding=True, return_tensors="pt")
        mask = inputs["attention_mask"].to(self.device)
        output = self.model(
            input_ids=inputs["input_ids"].to(self.device),
            attention_mask=mask,
            use_cache=False,
            pixel_values=vision["pixel_values"].to(self.device, self.model.dtype),
            image_grid_thw=vision["image_grid_thw"].to(self.device),
        )
        return [h[m.bool()].to(dtype) for h, m in zip(output.last_hidden_state, mask)]


@dataclass(frozen=True)
class QwenLayout:
    """The target's token grid; an edit's input images' packed latents (1, tokens, channels) and token grids."""

    rows: int
    cols: int
    inputs: torch.Tensor | None = None
    input_grids: tuple[tuple[int, int], ...] = ()


class QwenImagePipeline(DiffusionPipeline):
    CONDITIONING = ("embeds", "mask")

    def encode(self, request: ResolvedRequest) -> dict[str, torch.Tensor]:
        """Branches encoded apart as diffusers does, then padded; an edit's prompts read with its input images."""

        def rows(prompts: list[str]) -> list[torch.Tensor]:
            embeds, mask = self.prompt_encoder.encode(prompts, self.dtype)
            return [row[keep] for row, keep in zip(embeds, mask)]

        def edit_rows(prompts: list[str]) -> list[torch.Tensor]:
            texts = [EDIT_TEMPLATE.format(markers + prompt) for prompt in prompts]
            return [row[EDIT_PREFIX_TOKENS:] for row in self.prompt_encoder.encode(texts, images, self.dtype)]

        edit: EditInputs | None = self.spec.details
        if edit is None:
            return self.encode_rows(request, rows)
        processor = VaeImageProcessor(vae_scale_factor=pixel_granularity(self.spec.vae))
        images = [processor.resize(image, *edit.condition_size(image)) for image in request.images]
        markers = "".join(f"Picture {i + 1}: {IMAGE_MARKER}" for i in range(len(images))) if edit.plus else IMAGE_MARKER
        return self.encode_rows(request, edit_rows)

    def initial_latents(self, request: ResolvedRequest) -> tuple[torch.Tensor, QwenLayout]:
        granularity = pixel_granularity(self.spec.vae)
        rows, cols = request.height // granularity, request.width // granularity
        channels = self.transformer.config.in_channels // 4
        noise = seeded_noise((request.batch, 1, channels, 2 * rows, 2 * cols), request.seed, self.dtype, self.device)
        layout = QwenLayout(rows, cols)
        if self.spec.details is not None and request.mask is not None:
            # Edit's inpainting conditions on the latents its start draws first (``ImageToImage``), drawn here alike.
            drawn = self.image_latents(request, torch.Generator("cpu").manual_seed(request.seed))
            layout = QwenLayout(rows, cols, self.pack_drawn(drawn, request), ((rows, cols),))
        elif self.spec.details is not None:
            layout = QwenLayout(rows, cols, *self.encode_inputs(request))
        return self.pack_drawn(noise, request), layout

    @torch.inference_mode()
    def encode_inputs(self, request: ResolvedRequest) -> tuple[torch.Tensor, tuple[tuple[int, int], ...]]:
        """An edit's input images' latent modes normalised (divided by the std, as diffusers does), packed; grids."""
        granularity = pixel_granularity(self.spec.vae)
        tokens, grids = [], []
        for image in request.images:
            height, width = self.spec.details.input_size(image)
            latents = self.latent_distribution(image, height, width).mode()
            mean, _ = latent_statistics(self.vae.config, latents)
            std = torch.tensor(self.vae.config.latents_std).view(mean.shape).to(latents)
            tokens.append(self.pack_drawn(((latents - mean) / std).transpose(1, 2), request))
            grids.append((height // granularity, width // granularity))
        return torch.cat(tokens, dim=1), tuple(grids)

    def latent_distribution(self, image, height: int, width: int):
        processor = VaeImageProcessor(vae_scale_factor=pixel_granularity(self.spec.vae))
        pixels = processor.preprocess(image, height=height, width=width).unsqueeze(2)
        return self.vae_encode(pixels.to(self.device, self.vae.dtype))

    def pack_drawn(self, latents: torch.Tensor, request: ResolvedRequest) -> torch.Tensor:
        """(batch, 1, channels, 2 * rows, 2 * cols) packed 2x2 into (batch, rows * cols, 4 * channels)."""
        batch, _, channels, height, width = latents.shape
        packed = latents.reshape(batch, channels, height // 2, 2, width // 2, 2).permute(0, 2, 4, 1, 3, 5)
        return packed.reshape(batch, height // 2 * (width // 2), channels * 4)

    @torch.inference_mode()
    def image_latents(self, request: ResolvedRequest, generator: torch.Generator) -> torch.Tensor:
        sample = self.latent_distribution(request.images[0], request.height, request.width).sample(generator)
        mean, inverse_std = latent_statistics(self.vae.config, sample)
        return ((sample - mean) * inverse_std).transpose(1, 2)

    def make_scheduler(self, request: ResolvedRequest, latents: torch.Tensor):
        sigmas = np.linspace(1.0, 1 / request.steps, request.steps)
        mu = dynamic_shift(latents.shape[1], self.spec.scheduler)
        return self.scheduled(FlowMatchEulerDiscreteScheduler, sigmas=sigmas, mu=mu)

    def model_call(self, request: ResolvedRequest, conditioning: dict[str, torch.Tensor], layout: QwenLayout):
        """An edit's input tokens follow the target's in the image stream; only the target's rows are predicted."""
        embeds, mask, inputs = conditioning["embeds"], conditioning["mask"], layout.inputs

        def call(transformer, x: torch.Tensor, timestep: torch.Tensor, latents: torch.Tensor) -> torch.Tensor:
            if inputs is None:
                return transformer(x, embeds, timestep, layout.rows, layout.cols, mask)
            joined = torch.cat([x, inputs.to(x.dtype).expand(x.shape[0], -1, -1)], dim=1)
            out = transformer(joined, embeds, timestep, layout.rows, layout.cols, mask, layout.input_grids)
            return out[:, : x.shape[1]]

        return call

    def guide(self, cond: torch.Tensor, uncond: torch.Tensor, scale: float) -> torch.Tensor:
        """Qwen-Image keeps each token's guided prediction at the conditional branch's norm."""
        guided = uncond + scale * (cond - uncond)
        return guided * (cond.norm(dim=-1, keepdim=True) / guided.norm(dim=-1, keepdim=True))

    @torch.inference_mode()
    def decode(self, latents: torch.Tensor, layout: QwenLayout) -> torch.Tensor:
        rows, cols = layout.rows, layout.cols
        batch, channels = latents.shape[0], latents.shape[2] // 4
        latents = latents.view(batch, rows, cols, channels, 2, 2).permute(0, 3, 1, 4, 2, 5)
        latents = latents.reshape(batch, channels, 1, 2 * rows, 2 * cols).to(self.vae.dtype)
        mean, inverse_std = latent_statistics(self.vae.config, latents)
        return self.vae_decode(latents / inverse_std + mean)[:, :, 0]
