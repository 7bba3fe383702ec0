"""Qwen-Image 2.1 as diffusers' ``QwenImage21Pipeline`` runs it: text-to-image, and editing from up to ten condition
images that Qwen3-VL reads with the prompt and the VAE makes the prefix's image tokens of. The prefix (text and
condition images) runs once per request, before the first step; each step runs the target's tokens alone."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import transformers
from diffusers import FlowMatchEulerDiscreteScheduler
from diffusers.image_processor import VaeImageProcessor
from PIL import Image
from torch import nn

from paradit.checkpoint import component_dir
from paradit.families.qwen_image21.latents import TOKEN_PIXELS, area_size
from paradit.families.qwen_image21.model import QwenImage21Prefix
from paradit.families.qwen_image21.presets import CONFIGS, QwenImage21Inputs
from paradit.offline_tokenizer import VISION_TOKENS, build_offline_tokenizer
from paradit.pipelines.base import DiffusionPipeline, dynamic_shift, pad_rows, seeded_noise
from paradit.request import ResolvedRequest
from paradit.spec import CheckpointFolder
from paradit.text_encoder import place, random_encoder, weights_device

SYSTEM_TURN = f"<|im_start|>system\n{CONFIGS['system_prompt']}<|im_end|>\n"
PROMPT_TEMPLATE = SYSTEM_TURN + "<|im_start|>user\n{markers}{prompt}<|im_end|>\n<|im_start|>assistant\n"
IMAGE_PAD = "<|image_pad|>"
# Qwen/Qwen3-VL-8B-Instruct's preprocessor_config.json: an image's pixels between 64 and 16,384 merged 32-pixel patches.
QWEN3_VL_PIXELS = (64 * 32 * 32, 16384 * 32 * 32)


def image_markers(count: int) -> str:
    """diffusers' numbered markers, one per condition image, the second on a space apart."""
    return " ".join(f"<image{i}><|vision_start|>{IMAGE_PAD}<|vision_end|>" for i in range(1, count + 1))


def over_white(image: Image.Image) -> Image.Image:
    """What the encoder's vision tower reads of an RGBA image (its training's): composited over white."""
    white = Image.new("RGB", image.size, (255, 255, 255))
    white.paste(image, mask=image.getchannel("A"))
    return white


class Qwen3VLPromptEncoder:
    """Qwen3-VL (vision tower and language model, no LM head) read at its last layer before the final norm."""

    def __init__(self, model: nn.Module, tokenizer, image_processor, device: torch.device) -> None:
        self.model, self.tokenizer, self.image_processor, self.device = model, tokenizer, image_processor, device
        # The system turn's states are dropped, as diffusers drops them.
        self.system_tokens = len(tokenizer(SYSTEM_TURN)["input_ids"])
        self.image_token = tokenizer.convert_tokens_to_ids(IMAGE_PAD)

    def modules(self) -> list[nn.Module]:
        return [self.model]

    @staticmethod
    def without_final_norm(model: nn.Module) -> nn.Module:
        # The transformer was trained on the last layer's output before the norm (what diffusers' hook gives).
        model.language_model.norm = nn.Identity()
        return model.eval().requires_grad_(False)

    @classmethod
    def from_folder(
        cls, weights: CheckpointFolder, config: dict, device: torch.device, dtype: torch.dtype, placement: str = "gpu"
    ) -> Qwen3VLPromptEncoder:
        loaded = transformers.Qwen3VLForConditionalGeneration.from_pretrained(
            component_dir(weights.path, "text_encoder"),
            dtype=dtype,
            device_map=weights_device(placement, device),
            use_safetensors=weights.use_safetensors("text_encoder"),
        )
        model = place(cls.without_final_norm(loaded.model), placement, device)
        # The processor folder's tokenizer and image processor; Qwen3VLProcessor itself wants torchvision (videos).
        processor = component_dir(weights.path, "processor")
        tokenizer = transformers.AutoTokenizer.from_pretrained(processor)
        return cls(model, tokenizer, transformers.AutoImageProcessor.from_pretrained(processor), device)

    @classmethod
    def dummy(
        cls, config: dict, device: torch.device, dtype: torch.dtype, placement: str = "gpu", seed: int = 0
    ) -> Qwen3VLPromptEncoder:
        tokenizer = build_offline_tokenizer()
        # The image markers where the offline tokenizer has them (the published ids are past its vocabulary).
        names = ("vision_start_token_id", "vision_end_token_id", "image_token_id", "video_token_id")
        markers = dict(zip(names, tokenizer.convert_tokens_to_ids(VISION_TOKENS)))
        settings = {key: value for key, value in config.items() if key != "model_type"}
        vl_config = transformers.Qwen3VLConfig(**{**settings, **markers})
        model = random_encoder(lambda: transformers.Qwen3VLModel(vl_config), placement, device, dtype, seed)
        image_processor = published_image_processor(config["vision_config"])
        return cls(place(cls.without_final_norm(model), placement, device), tokenizer, image_processor, device)

    @torch.no_grad()
    def encode(self, prompts: list[str], images: list, dtype: torch.dtype) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Each prompt's (tokens, hidden) states after the system turn, and (tokens,) True at its image slots."""
        # Qwen has no start token: an empty prompt would leave the encoder nothing to read.
        texts = [PROMPT_TEMPLATE.format(markers=image_markers(len(images)), prompt=p or " ") for p in prompts]
        vision = {}
        if images:
            vision = self.image_processor(
                images=[over_white(image) for image in images] * len(texts), return_tensors="pt"
            )
            counts = iter((vision["image_grid_thw"].prod(-1) // self.image_processor.merge_size**2).tolist())
            texts = [widen_image_pads(text, counts) for text in texts]
        # Left padding, as the checkpoint was trained with: it decides the positions the encoder sees.
        inputs = self.tokenizer(texts, padding=True, padding_side="left", return_tensors="pt")
        ids, mask = inputs["input_ids"].to(self.device), inputs["attention_mask"].to(self.device)
        if images:
            vision = {
                "pixel_values": vision["pixel_values"].to(self.device, self.model.dtype),
                "image_grid_thw": vision["image_grid_thw"].to(self.device),
            }
        slots = ids == self.image_token
        hidden = self.model(
            input_ids=ids, attention_mask=mask, mm_token_type_ids=slots.long(), use_cache=False, **vision
        ).last_hidden_state
        kept = [row.bool() for row in mask]
        return [
            (h[keep][self.system_tokens :].to(dtype), s[keep][self.system_tokens :])
            for h, s, keep in zip(hidden, slots, kept)
        ]


def published_image_processor(vision: dict) -> transformers.Qwen2VLImageProcessorPil:
    """The image processor a published Qwen3-VL processor folder configures. Its pixel bounds matter: with
    transformers' defaults (at most 1,003,520 pixels) a 1024² condition image would be shrunk for the encoder, and its
    prompt's slots would no longer cover the VAE's grid of it."""
    return transformers.Qwen2VLImageProcessorPil(
        patch_size=vision["patch_size"],
        temporal_patch_size=vision["temporal_patch_size"],
        merge_size=vision["spatial_merge_size"],
        size={"shortest_edge": QWEN3_VL_PIXELS[0], "longest_edge": QWEN3_VL_PIXELS[1]},
    )


def widen_image_pads(text: str, counts) -> str:
    """``text`` with each image pad repeated as many times as the next image of ``counts`` has merged patches."""
    first, *rest = text.split(IMAGE_PAD)
    return first + "".join(IMAGE_PAD * next(counts) + part for part in rest)


@dataclass(frozen=True)
class QwenImage21Layout:
    """The target's token grid; the condition images' packed latents (1, tokens, 64) and token grids."""

    rows: int
    cols: int
    condition: torch.Tensor | None = None
    condition_grids: tuple[tuple[int, int], ...] = ()


class QwenImage21Pipeline(DiffusionPipeline):
    CONDITIONING = ("embeds", "mask", "slots")

    @property
    def inputs(self) -> QwenImage21Inputs:
        return self.spec.details or QwenImage21Inputs()

    def image_processor(self) -> VaeImageProcessor:
        return VaeImageProcessor(vae_scale_factor=TOKEN_PIXELS, vae_latent_channels=self.vae.config.z_dim)

    def condition_images(self, request: ResolvedRequest) -> list[tuple[Image.Image, int, int]]:
        """Each condition image as RGBA, with the (height, width) both the encoder and the VAE read it at."""
        sized = []
        for image in request.images:
            rgba = image if image.mode == "RGBA" else image.convert("RGBA")
            sized.append((rgba, *area_size(self.inputs.output_resolution, rgba)))
        return sized

    def encode(self, request: ResolvedRequest) -> dict[str, torch.Tensor]:
        """Each branch's prompts read with the condition images; rows right-padded to the longest, as diffusers."""
        processor = self.image_processor()
        images = [processor.resize(rgba, height, width) for rgba, height, width in self.condition_images(request)]
        rows = [
            row
            for prompts in self.branch_prompts(request)
            for row in self.prompt_encoder.encode(prompts, images, self.dtype)
            for _ in range(request.images_per_prompt)
        ]
        embeds, mask = pad_rows([hidden.to(self.device) for hidden, _ in rows])
        slots, _ = pad_rows([row_slots.to(self.device) for _, row_slots in rows])
        return {"embeds": embeds, "mask": mask, "slots": slots}

    def initial_latents(self, request: ResolvedRequest) -> tuple[torch.Tensor, QwenImage21Layout]:
        rows, cols = request.height // TOKEN_PIXELS, request.width // TOKEN_PIXELS
        channels = self.transformer.config.in_channels
        noise = seeded_noise((request.batch, 1, channels, rows, cols), request.seed, self.dtype, self.device)
        return self.pack_drawn(noise, request), QwenImage21Layout(rows, cols, *self.encode_conditions(request))

    @torch.inference_mode()
    def encode_conditions(self, request: ResolvedRequest) -> tuple[torch.Tensor | None, tuple[tuple[int, int], ...]]:
        """The condition images' latent modes, normalised by the VAE's statistics, packed one after another."""
        if not request.images:
            return None, ()
        processor, tokens, grids = self.image_processor(), [], []
        for rgba, height, width in self.condition_images(request):
            pixels = processor.preprocess(rgba, height=height, width=width).unsqueeze(2)
            latents = self.vae_encode(pixels.to(self.device, self.vae.dtype)).mode()
            mean = torch.tensor(self.vae.config.latents_mean).view(1, -1, 1, 1, 1).to(latents)
            std = torch.tensor(self.vae.config.latents_std).view(1, -1, 1, 1, 1).to(latents)
            tokens.append(self.pack_drawn((latents - mean) / std, request))
            grids.append((height // TOKEN_PIXELS, width // TOKEN_PIXELS))
        return torch.cat(tokens, dim=1), tuple(grids)

    def pack_drawn(self, latents: torch.Tensor, request: ResolvedRequest) -> torch.Tensor:
        """(batch, channels or 1, channels or 1, rows, cols) to (batch, rows * cols, channels): one token a pixel."""
        batch, rows, cols = latents.shape[0], latents.shape[-2], latents.shape[-1]
        return latents.reshape(batch, -1, rows * cols).transpose(1, 2)

    def make_scheduler(self, request: ResolvedRequest, latents: torch.Tensor):
        """The checkpoint's own sigmas (Turbo's) where the steps asked are theirs; else diffusers' even spacing."""
        sigmas = self.inputs.sample_sigmas
        if sigmas is None or len(sigmas) != request.steps:
            sigmas = np.linspace(1.0, 1 / request.steps, request.steps)
        mu = dynamic_shift(latents.shape[1], self.spec.scheduler)
        return self.scheduled(FlowMatchEulerDiscreteScheduler, sigmas=list(sigmas), mu=mu)

    def prefix(
        self, conditioning: dict[str, torch.Tensor | None], layout: QwenImage21Layout, rows: slice
    ) -> QwenImage21Prefix:
        """``rows``' prefix, cut to their longest prompt: each guidance branch is padded on its own, as diffusers
        encodes each apart (the target's frame position follows its branch's length)."""
        mask = conditioning["mask"]
        length = conditioning["embeds"].shape[1] if mask is None else int(mask[rows].sum(1).max())
        mask = None if mask is None else mask[rows, :length]
        condition = None if layout.condition is None else layout.condition.to(self.dtype)
        with torch.inference_mode():
            return self.runtime.forward.encode_prefix(
                conditioning["embeds"][rows, :length],
                conditioning["slots"][0, :length],
                mask,
                condition,
                layout.condition_grids,
            )

    def model_call(self, request: ResolvedRequest, conditioning: dict[str, torch.Tensor], layout: QwenImage21Layout):
        """The prefix once per request (per branch where this rank holds both), then the target's tokens each step."""
        batch = conditioning["embeds"].shape[0]
        groups = 2 if self.uses_cfg(request) and batch == 2 * request.batch else 1
        size = batch // groups
        prefixes = [self.prefix(conditioning, layout, slice(g * size, (g + 1) * size)) for g in range(groups)]

        def call(transformer, x: torch.Tensor, timestep: torch.Tensor, latents: torch.Tensor) -> torch.Tensor:
            parts = zip(x.chunk(groups), timestep.chunk(groups), prefixes)
            return torch.cat([transformer(part, t, layout.rows, layout.cols, p) for part, t, p in parts])

        return call

    @torch.inference_mode()
    def decode(self, latents: torch.Tensor, layout: QwenImage21Layout) -> torch.Tensor:
        """RGBA, as the VAE decodes it (batch, 4, H, W)."""
        batch, channels = latents.shape[0], latents.shape[2]
        latents = latents.transpose(1, 2).reshape(batch, channels, 1, layout.rows, layout.cols).to(self.vae.dtype)
        mean = torch.tensor(self.vae.config.latents_mean).view(1, -1, 1, 1, 1).to(latents)
        std = torch.tensor(self.vae.config.latents_std).view(1, -1, 1, 1, 1).to(latents)
        return self.vae_decode(latents * std + mean)[:, :, 0]
