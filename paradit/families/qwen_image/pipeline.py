"""Qwen-Image text-to-image: prompt encoding, seeded latents, denoising with true CFG, VAE decoding.

Reproduces diffusers' ``QwenImagePipeline`` so that the same checkpoint, request and seed give the same image:

- prompts are wrapped in Qwen-Image's chat template and read from the last hidden state (after the final norm) of
  the Qwen2.5-VL language model; the template's leading tokens are dropped, and prompts of different lengths are
  padded and masked;
- classifier-free guidance runs only when a negative prompt is given and the guidance (diffusers'
  ``true_cfg_scale``) is above 1, and the guided prediction is rescaled to the conditional prediction's norm per
  token, as diffusers does;
- the scheduler's shift ``mu`` is linear in the image token count, from the scheduler config.

Differences that only make it faster: the unconditional branch runs in the same batch as the conditional one (or
on the other half of the group under CFG parallelism), padded to a common text length with the padding masked; the
text encoder's vision tower and LM head are never run (a text-only prompt never reaches them).

One deliberate difference in outcome: with several prompts of different lengths and several images per prompt,
each image keeps its own prompt's text mask. diffusers' ``encode_prompt`` repeats the embeddings image by image but
tiles the mask prompt by prompt, so there images are masked with another prompt's padding.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
import transformers
from diffusers import AutoencoderKLQwenImage, FlowMatchEulerDiscreteScheduler
from torch import nn

from paradit.families.qwen_image.model import QwenImageConfig, QwenImageTransformer
from paradit.offline_tokenizer import build_offline_tokenizer
from paradit.pipelines.base import (
    DiffusionPipeline,
    NoisePredictor,
    ResolvedRequest,
    cfg_step_inputs,
    resolve_common,
    seeded_noise,
)
from paradit.request import GenerationRequest
from paradit.spec import CheckpointFolder, ModelSpec
from paradit.text_encoder import place, random_encoder, warn_if_truncated, weights_device
from paradit.weights import component_dir, read_json

PROMPT_TEMPLATE = (
    "<|im_start|>system\nDescribe the image by detailing the color, shape, size, texture, quantity, text, spatial "
    "relationships of the objects and background:<|im_end|>\n<|im_start|>user\n{}<|im_end|>\n"
    "<|im_start|>assistant\n"
)
# Hidden states dropped from the front of every encoded prompt: the system turn and "<|im_start|>user\n", 34 tokens
# in Qwen2.5-VL's tokenizer. diffusers drops this count whatever the tokenizer, and so does paradit.
TEMPLATE_PREFIX_TOKENS = 34
# The tokenizer truncates at this many prompt tokens after the prefix, and the embeddings are cut to
# MAX_SEQUENCE_LENGTH (diffusers' default ``max_sequence_length``).
TOKENIZER_MAX_LENGTH = 1024
MAX_SEQUENCE_LENGTH = 512


def calculate_mu(image_tokens: int, scheduler_config: dict) -> float:
    """The timestep shift: linear in the image token count between the scheduler's base and max points."""
    base_len = scheduler_config.get("base_image_seq_len", 256)
    max_len = scheduler_config.get("max_image_seq_len", 4096)
    base_shift = scheduler_config.get("base_shift", 0.5)
    max_shift = scheduler_config.get("max_shift", 1.15)
    slope = (max_shift - base_shift) / (max_len - base_len)
    return image_tokens * slope + base_shift - slope * base_len


def pixel_granularity(vae_config: dict) -> int:
    """Pixels per latent token side: the VAE's spatial stride, doubled by the 2x2 packing."""
    return 2 ** len(vae_config.get("temperal_downsample", [False, True, True])) * 2


def spec_from_folder(folder: Path, index: dict) -> ModelSpec:
    """The ModelSpec of a diffusers Qwen-Image checkpoint: architecture from its configs, diffusers' defaults."""
    transformer = read_json(component_dir(folder, "transformer") / "config.json")
    QwenImageConfig.from_dict(transformer)  # refuses the variants this pipeline does not serve, before loading
    return ModelSpec(
        name=str(folder),
        family="qwen_image",
        description=f"{index['_class_name']} checkpoint",
        transformer=transformer,
        text_encoder=read_json(component_dir(folder, "text_encoder") / "config.json"),
        vae=read_json(component_dir(folder, "vae") / "config.json"),
        scheduler=read_json(component_dir(folder, "scheduler") / "scheduler_config.json"),
        guidance_mode="cfg",
        steps=50,
        guidance=4.0,
        height=1024,
        width=1024,
        weights=CheckpointFolder(folder),
    )


def resolve_request(spec: ModelSpec, request: GenerationRequest) -> ResolvedRequest:
    """The request with defaults filled in, or an InvalidRequest naming what is wrong and what is allowed.

    ``guidance`` is diffusers' ``true_cfg_scale``; as there, it takes effect only with a negative prompt (any
    string, even " ", which is what Qwen-Image's authors pass when they have nothing to exclude)."""
    return resolve_common(spec, request, pixel_granularity(spec.vae))


def uses_cfg(spec: ModelSpec, request: ResolvedRequest) -> bool:
    """diffusers' rule: true CFG needs both a negative prompt and a guidance above 1."""
    return request.negative_prompts is not None and request.guidance > 1.0


class QwenPromptEncoder:
    """Tokenizer + the Qwen2.5-VL language model running on ``device``; ``encode`` gives each prompt's last hidden
    states past the template prefix, padded to the longest in the batch, with the mask of real tokens."""

    def __init__(self, language_model: nn.Module, tokenizer, device: torch.device) -> None:
        self.language_model = language_model
        self.tokenizer = tokenizer
        self.device = device

    @classmethod
    def from_folder(
        cls, folder: Path, device: torch.device, dtype: torch.dtype, placement: str = "gpu"
    ) -> QwenPromptEncoder:
        model = transformers.Qwen2_5_VLForConditionalGeneration.from_pretrained(
            component_dir(folder, "text_encoder"), dtype=dtype, device_map=weights_device(placement, device)
        )
        tokenizer = transformers.AutoTokenizer.from_pretrained(component_dir(folder, "tokenizer"))
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
        inputs = self.tokenizer(
            texts,
            max_length=TOKENIZER_MAX_LENGTH + TEMPLATE_PREFIX_TOKENS,
            padding=True,
            truncation=True,
            return_tensors="pt",
        )
        attention_mask = inputs["attention_mask"].to(self.device)
        hidden = self.language_model(input_ids=inputs["input_ids"].to(self.device), attention_mask=attention_mask)
        hidden = hidden.last_hidden_state
        # Real tokens wherever the padding put them, then the template prefix off the front of each prompt.
        prompts_hidden = [
            h[m.bool()][TEMPLATE_PREFIX_TOKENS:][:MAX_SEQUENCE_LENGTH] for h, m in zip(hidden, attention_mask)
        ]
        return pad_and_mask(prompts_hidden, dtype)


def pad_and_mask(sequences: list[torch.Tensor], dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(tokens_i, hidden) sequences -> zero-padded (batch, max tokens, hidden) and the bool mask of real rows."""
    longest = max(s.shape[0] for s in sequences)
    padded = torch.stack([nn.functional.pad(s, (0, 0, 0, longest - s.shape[0])) for s in sequences]).to(dtype)
    mask = torch.zeros(padded.shape[:2], dtype=torch.bool, device=padded.device)
    for row, s in enumerate(sequences):
        mask[row, : s.shape[0]] = True
    return padded, mask


def pad_text(embeds: torch.Tensor, mask: torch.Tensor, length: int) -> tuple[torch.Tensor, torch.Tensor]:
    extra = length - embeds.shape[1]
    return nn.functional.pad(embeds, (0, 0, 0, extra)), nn.functional.pad(mask, (0, extra), value=False)


class QwenImagePipeline(DiffusionPipeline):
    DIFFUSERS_PIPELINES = ("QwenImagePipeline",)
    VAE = AutoencoderKLQwenImage
    spec_from_folder = staticmethod(spec_from_folder)
    resolve_request = staticmethod(resolve_request)
    uses_cfg = staticmethod(uses_cfg)
    CONDITIONING = ("embeds", "mask")

    @classmethod
    def build_transformer(cls, spec: ModelSpec) -> QwenImageTransformer:
        return QwenImageTransformer(QwenImageConfig.from_dict(spec.transformer))

    @classmethod
    def load_prompt_encoder(
        cls, spec: ModelSpec, device: torch.device, dtype: torch.dtype, dummy: bool, placement: str = "gpu"
    ) -> QwenPromptEncoder:
        if dummy:
            return QwenPromptEncoder.dummy(spec.text_encoder, device, dtype, placement)
        return QwenPromptEncoder.from_folder(spec.folder, device, dtype, placement)

    def encode_prompts(self, prompts: list[str], images_per_prompt: int) -> tuple[torch.Tensor, torch.Tensor]:
        embeds, mask = self.prompt_encoder.encode(prompts, self.dtype)
        return (
            embeds.to(self.device).repeat_interleave(images_per_prompt, dim=0),
            mask.to(self.device).repeat_interleave(images_per_prompt, dim=0),
        )

    def encode(self, request: ResolvedRequest) -> dict[str, torch.Tensor]:
        """[conditional; unconditional] prompt embeddings and their text mask. The two branches are encoded
        separately, as diffusers does, then padded to one length."""
        embeds, mask = self.encode_prompts(request.prompts, request.images_per_prompt)
        if uses_cfg(self.spec, request):
            negative, negative_mask = self.encode_prompts(request.negative_prompts, request.images_per_prompt)
            length = max(embeds.shape[1], negative.shape[1])
            embeds, mask = pad_text(embeds, mask, length)
            negative, negative_mask = pad_text(negative, negative_mask, length)
            embeds, mask = torch.cat([embeds, negative]), torch.cat([mask, negative_mask])
        return {"embeds": embeds, "mask": mask}

    def initial_latents(self, request: ResolvedRequest) -> tuple[torch.Tensor, tuple[int, int]]:
        """Noise drawn as diffusers draws it (in the unpacked (batch, 1, channels, 2 * rows, 2 * cols) layout),
        packed 2x2 into (batch, rows * cols, 4 * channels); returns it with the token grid's rows and columns."""
        granularity = pixel_granularity(self.spec.vae)
        rows, cols = request.height // granularity, request.width // granularity
        channels = self.transformer.config.in_channels // 4
        noise = seeded_noise((request.batch, 1, channels, 2 * rows, 2 * cols), request.seed, self.dtype, self.device)
        packed = noise.view(request.batch, channels, rows, 2, cols, 2).permute(0, 2, 4, 1, 3, 5)
        return packed.reshape(request.batch, rows * cols, channels * 4), (rows, cols)

    def make_scheduler(self, request: ResolvedRequest, latents: torch.Tensor):
        scheduler = FlowMatchEulerDiscreteScheduler.from_config(self.spec.scheduler)
        sigmas = np.linspace(1.0, 1 / request.steps, request.steps)
        mu = calculate_mu(latents.shape[1], self.spec.scheduler)
        scheduler.set_timesteps(sigmas=sigmas, device=self.device, mu=mu)
        scheduler.set_begin_index(0)
        return scheduler, scheduler.timesteps

    def predictor(
        self, request: ResolvedRequest, conditioning: dict[str, torch.Tensor], layout: tuple[int, int]
    ) -> NoisePredictor:
        """The conditioning holds [conditional; unconditional] rows under CFG; the branches object decides which of
        them this rank computes (all of them on one GPU, one half under CFG parallelism). The mask becomes None
        when no token is padding, so attention runs unmasked (every rank holds the same mask: same decision)."""
        cfg = uses_cfg(self.spec, request)
        branches = self.branches(cfg)
        embeds, mask = branches.local(conditioning["embeds"]), conditioning["mask"]
        mask = None if bool(mask.all()) else branches.local(mask)
        rows, cols = layout
        scale = request.guidance

        def predict(latents: torch.Tensor, t: torch.Tensor, transformer) -> torch.Tensor:
            # The reference casts t to the latent dtype before dividing; matching it keeps bf16 runs bit-faithful.
            timestep = t.expand(latents.shape[0]).to(latents.dtype) / 1000
            model_input, timestep = cfg_step_inputs(branches, cfg, latents, timestep)
            with torch.inference_mode():
                noise = transformer(model_input.to(self.dtype), embeds, timestep, rows, cols, mask)
            if not cfg:
                return noise
            cond, uncond = branches.combine(noise).chunk(2)
            guided = uncond + scale * (cond - uncond)
            # Qwen-Image keeps each token's prediction at the conditional branch's norm.
            return guided * (cond.norm(dim=-1, keepdim=True) / guided.norm(dim=-1, keepdim=True))

        return predict

    @torch.inference_mode()
    def decode(self, latents: torch.Tensor, layout: tuple[int, int]) -> torch.Tensor:
        rows, cols = layout
        batch, _, packed_channels = latents.shape
        channels = packed_channels // 4
        latents = latents.view(batch, rows, cols, channels, 2, 2).permute(0, 3, 1, 4, 2, 5)
        latents = latents.reshape(batch, channels, 1, 2 * rows, 2 * cols).to(self.vae.dtype)
        config = self.vae.config
        mean = torch.tensor(config.latents_mean).view(1, -1, 1, 1, 1).to(latents.device, latents.dtype)
        # The reference divides by the reciprocal of std, in the latent dtype; the same rounding keeps it exact.
        inverse_std = 1.0 / torch.tensor(config.latents_std).view(1, -1, 1, 1, 1).to(latents.device, latents.dtype)
        image = self.vae_decode(latents / inverse_std + mean)[:, :, 0]
        return (image / 2 + 0.5).clamp(0, 1)
