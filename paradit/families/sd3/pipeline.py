"""Stable Diffusion 3 / 3.5 text-to-image: three prompt encoders, seeded latents, denoising with CFG, VAE decoding.

Reproduces diffusers' ``StableDiffusion3Pipeline`` so that the same checkpoint and seed give the same image: CLIP-L
and OpenCLIP bigG give their penultimate hidden states (concatenated on channels, zero-padded to T5's width) and their
pooled projections (concatenated); T5 gives its last hidden state, appended on the sequence; no attention mask is
used anywhere. Differences that only make it faster: the conditional and unconditional branches run in one batch (or
on the two halves of the group under CFG parallelism), and only rank 0 holds the encoders and the VAE.
"""

from __future__ import annotations

import string
from pathlib import Path

import torch
import transformers
from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler
from tokenizers import pre_tokenizers
from torch import nn
from transformers import CLIPTextConfig, CLIPTextModelWithProjection, T5Config, T5EncoderModel

from paradit.errors import CheckpointError
from paradit.families.sd3.model import SD3Config, SD3Transformer, unpatchify
from paradit.families.sd3.presets import SD3_PRESETS, SD3TextEncoders
from paradit.pipelines.base import (
    DiffusionPipeline,
    NoisePredictor,
    ResolvedRequest,
    cfg_step_inputs,
    patch_grid_band_mask,
    resolve_common,
    seeded_noise,
)
from paradit.request import GenerationRequest
from paradit.spec import CheckpointFolder, ModelSpec
from paradit.text_encoder import place, random_encoder, warn_if_truncated, weights_device
from paradit.weights import component_dir, read_json

# diffusers' StableDiffusion3Pipeline.__call__ defaults, for checkpoints that are not a published SD3.5.
PIPELINE_DEFAULT_STEPS, PIPELINE_DEFAULT_GUIDANCE = 28, 7.0
CLIP_LENGTH = 77


def vae_scale_factor(vae_config: dict) -> int:
    return 2 ** (len(vae_config["block_out_channels"]) - 1)


def pixel_granularity(spec: ModelSpec) -> int:
    """Pixels per image token side: the VAE's stride times the transformer's patch size."""
    return vae_scale_factor(spec.vae) * spec.transformer["patch_size"]


def published_defaults(transformer: dict) -> tuple[int, float]:
    """Steps and guidance of the model card when the transformer is a published SD3.5 one (a preset's hub id
    resolves to its checkpoint folder, and its defaults must survive that); else the diffusers pipeline's."""
    for preset in SD3_PRESETS:
        if preset.hub_id and all(transformer.get(key) == value for key, value in preset.transformer.items()):
            return preset.steps, preset.guidance
    return PIPELINE_DEFAULT_STEPS, PIPELINE_DEFAULT_GUIDANCE


def spec_from_folder(folder: Path, index: dict) -> ModelSpec:
    """The ModelSpec of a diffusers SD3 checkpoint: architecture and encoders from its configs."""
    transformer = read_json(component_dir(folder, "transformer") / "config.json")
    scheduler = read_json(component_dir(folder, "scheduler") / "scheduler_config.json")
    if scheduler.get("use_dynamic_shifting"):
        raise CheckpointError(
            f"{folder}: a scheduler with use_dynamic_shifting is not supported; SD3.5 uses a fixed shift"
        )
    encoders = SD3TextEncoders(
        clip_l=read_json(component_dir(folder, "text_encoder") / "config.json"),
        clip_g=read_json(component_dir(folder, "text_encoder_2") / "config.json"),
        t5=read_json(component_dir(folder, "text_encoder_3") / "config.json"),
    )
    vae = read_json(component_dir(folder, "vae") / "config.json")
    steps, guidance = published_defaults(transformer)
    size = transformer.get("sample_size", 128) * vae_scale_factor(vae)
    return ModelSpec(
        name=str(folder),
        family="sd3",
        description=f"{index['_class_name']} checkpoint",
        transformer=transformer,
        text_encoder=encoders,
        vae=vae,
        scheduler=scheduler,
        guidance_mode="cfg",
        steps=steps,
        guidance=guidance,
        height=size,
        width=size,
        weights=CheckpointFolder(folder),
    )


def resolve_request(spec: ModelSpec, request: GenerationRequest) -> ResolvedRequest:
    """The request with defaults filled in (negative prompt ""), or an InvalidRequest naming what is allowed; the
    largest size is what the positional-embedding table covers."""
    granularity = pixel_granularity(spec)
    largest = spec.transformer["pos_embed_max_size"] * granularity
    return resolve_common(spec, request, granularity, largest=(largest, largest), default_negative="")


def offline_clip_tokenizer(pad_token: str) -> transformers.CLIPTokenizer:
    """A CLIP tokenizer built in memory for random-weight runs: byte-level, no merges (every byte a token, with and
    without CLIP's end-of-word suffix), CLIP's start and end tokens last so the end token has the highest id."""
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    symbols = [*alphabet, *(symbol + "</w>" for symbol in alphabet), "<|startoftext|>", "<|endoftext|>"]
    vocab = {symbol: i for i, symbol in enumerate(symbols)}
    return transformers.CLIPTokenizer(vocab=vocab, merges=[], pad_token=pad_token, model_max_length=CLIP_LENGTH)


def offline_t5_tokenizer() -> transformers.T5Tokenizer:
    """A T5 (unigram) tokenizer built in memory for random-weight runs: printable ASCII characters, with and without
    the word-start marker; T5's pad, end and unknown tokens take ids 0, 1 and 2 as in the published vocabulary."""
    characters = string.ascii_letters + string.digits + string.punctuation
    pieces = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("▁", -2.0)]
    pieces += [("▁" + c, -3.0) for c in characters] + [(c, -4.0) for c in characters]
    return transformers.T5Tokenizer(vocab=pieces, extra_ids=0)


class SD3PromptEncoder:
    """CLIP-L, OpenCLIP bigG and T5 with their tokenizers, loaded on ``weights_device(placement, device)`` and run on
    ``device``; ``encode`` gives diffusers' ``prompt_embeds`` and ``pooled_prompt_embeds``."""

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

    @classmethod
    def from_folder(
        cls, folder: Path, spec: SD3TextEncoders, device: torch.device, dtype: torch.dtype, placement: str = "gpu"
    ) -> SD3PromptEncoder:
        index = read_json(folder / "model_index.json")
        load = {"dtype": dtype, "device_map": weights_device(placement, device)}
        clip_encoders = [
            CLIPTextModelWithProjection.from_pretrained(component_dir(folder, name), **load)
            for name in ("text_encoder", "text_encoder_2")
        ]
        t5 = T5EncoderModel.from_pretrained(component_dir(folder, "text_encoder_3"), **load)
        tokenizers = [
            getattr(transformers, index[name][1]).from_pretrained(component_dir(folder, name))
            for name in ("tokenizer", "tokenizer_2", "tokenizer_3")
        ]
        return cls(clip_encoders, t5, tokenizers, spec.max_sequence_length, device, placement)

    @classmethod
    def dummy(
        cls, spec: SD3TextEncoders, device: torch.device, dtype: torch.dtype, placement: str = "gpu", seed: int = 0
    ) -> SD3PromptEncoder:
        clip_encoders = [
            random_encoder(
                lambda config=config: CLIPTextModelWithProjection._from_config(
                    CLIPTextConfig.from_dict(config), dtype=dtype
                ),
                placement, device, dtype, seed + index,
            )
            for index, config in enumerate((spec.clip_l, spec.clip_g))
        ]  # fmt: skip
        t5 = random_encoder(
            lambda: T5EncoderModel._from_config(T5Config.from_dict(spec.t5), dtype=dtype), placement, device, dtype,
            seed + 2,
        )  # fmt: skip
        # The published bigG tokenizer pads with "!", CLIP-L's with its end token.
        tokenizers = [offline_clip_tokenizer("<|endoftext|>"), offline_clip_tokenizer("!"), offline_t5_tokenizer()]
        return cls(clip_encoders, t5, tokenizers, spec.max_sequence_length, device, placement)

    def _clip(self, which: int, prompts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
        """(penultimate hidden states, pooled projection) of CLIP encoder ``which``."""
        encoder = self.clip_encoders[which]
        if which == 0:  # both CLIPs read the same 77 tokens: said once
            warn_if_truncated(self.clip_tokenizers[0], prompts, self.clip_length, "CLIP")
        ids = self.clip_tokenizers[which](
            prompts, padding="max_length", max_length=self.clip_length, truncation=True, return_tensors="pt"
        ).input_ids
        output = encoder(ids.to(self.device), output_hidden_states=True)
        return output.hidden_states[-2], output.text_embeds

    @torch.no_grad()
    def encode(self, prompts: list[str], dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """(batch, clip length + max_sequence_length, T5 width) embeddings and (batch, pooled width) vectors."""
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
    DIFFUSERS_PIPELINES = ("StableDiffusion3Pipeline",)
    VAE = AutoencoderKL
    spec_from_folder = staticmethod(spec_from_folder)
    resolve_request = staticmethod(resolve_request)
    CONDITIONING = ("embeds", "pooled")

    @classmethod
    def build_transformer(cls, spec: ModelSpec) -> SD3Transformer:
        return SD3Transformer(SD3Config.from_dict(spec.transformer))

    @classmethod
    def after_dummy_init(cls, transformer: SD3Transformer) -> None:
        transformer.pos_embed.fill_position_table()  # a fixed sin-cos buffer, not a weight

    @classmethod
    def load_prompt_encoder(
        cls, spec: ModelSpec, device: torch.device, dtype: torch.dtype, dummy: bool, placement: str = "gpu"
    ) -> SD3PromptEncoder:
        if dummy:
            return SD3PromptEncoder.dummy(spec.text_encoder, device, dtype, placement)
        return SD3PromptEncoder.from_folder(spec.folder, spec.text_encoder, device, dtype, placement)

    @staticmethod
    def uses_cfg(spec: ModelSpec, request: ResolvedRequest) -> bool:
        return request.guidance > 1.0

    def encode(self, request: ResolvedRequest) -> dict[str, torch.Tensor]:
        """Prompt embeddings and pooled vectors, [conditional; unconditional] rows under CFG, each prompt's rows
        repeated per image."""
        prompts = request.prompts + (request.negative_prompts if self.uses_cfg(self.spec, request) else [])
        embeds, pooled = self.prompt_encoder.encode(prompts, self.dtype)
        repeat = request.images_per_prompt
        return {
            "embeds": embeds.to(self.device).repeat_interleave(repeat, dim=0),
            "pooled": pooled.to(self.device).repeat_interleave(repeat, dim=0),
        }

    def initial_latents(self, request: ResolvedRequest) -> tuple[torch.Tensor, None]:
        stride = vae_scale_factor(self.spec.vae)
        shape = (request.batch, self.transformer.config.in_channels, request.height // stride, request.width // stride)
        return seeded_noise(shape, request.seed, self.dtype, self.device), None

    def make_scheduler(self, request: ResolvedRequest, latents: torch.Tensor):
        scheduler = FlowMatchEulerDiscreteScheduler.from_config(self.spec.scheduler)
        scheduler.set_timesteps(num_inference_steps=request.steps, device=self.device)
        return scheduler, scheduler.timesteps

    def band_mask(self, latents: torch.Tensor, start: int, stop: int) -> torch.Tensor:
        return patch_grid_band_mask(latents, self.transformer.config.patch_size, start, stop)

    def predictor(
        self, request: ResolvedRequest, conditioning: dict[str, torch.Tensor], layout: None
    ) -> NoisePredictor:
        """Under CFG the conditioning holds [conditional; unconditional] rows; the branches object decides which of
        them this rank computes (all of them on one GPU, one half under CFG parallelism)."""
        cfg = self.uses_cfg(self.spec, request)
        branches = self.branches(cfg)
        embeds, pooled = branches.local(conditioning["embeds"]), branches.local(conditioning["pooled"])
        scale, patch = request.guidance, self.transformer.config.patch_size

        def predict(latents: torch.Tensor, t: torch.Tensor, transformer) -> torch.Tensor:
            model_input, timestep = cfg_step_inputs(branches, cfg, latents, t.expand(latents.shape[0]))
            with torch.inference_mode():
                patches = transformer(model_input, embeds, pooled, timestep)
            noise = unpatchify(patches, patch, *latents.shape[-2:])
            if not cfg:
                return noise
            cond, uncond = branches.combine(noise).chunk(2)
            return uncond + scale * (cond - uncond)

        return predict

    @torch.inference_mode()
    def decode(self, latents: torch.Tensor, layout: None) -> torch.Tensor:
        latents = latents / self.vae.config.scaling_factor + self.vae.config.shift_factor
        image = self.vae_decode(latents.to(self.vae.dtype))
        return (image / 2 + 0.5).clamp(0, 1)
