"""FLUX.3 as diffusers' modular pipelines run it (Flux3ModularPipeline, Flux3DistilledModularPipeline), image for
image; the prompt upsampler, a separate model diffusers runs first, is not run: prompts are encoded as given."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import numpy as np
import torch
from diffusers import FlowMatchEulerDiscreteScheduler
from diffusers.modular_pipelines.flux3.image_processor import Flux3ImageProcessor
from PIL import Image

from paradit.families.flux2.latents import pixel_granularity
from paradit.families.flux2.pipeline import packed_latents, unpacked_latents
from paradit.pipelines.base import DiffusionPipeline, seeded_noise
from paradit.request import ResolvedRequest
from paradit.request_hooks import Denoise, RequestHook
from paradit.text_encoder import DecoderPromptEncoder, warn_if_truncated

# The text window is right-padded to a multiple of this many tokens: the transformer attends to the padding, so the
# window is part of the recipe (diffusers' Flux3TextEncoderStep.pad_multiple).
PAD_MULTIPLE = 80
# The model was trained with the image tokens' row and column positions scaled by this (diffusers' image_rope_scale).
IMAGE_ROPE_SCALE = 0.5


class Qwen3VLPromptEncoder(DecoderPromptEncoder):
    """Each prompt alone, as one user turn of the chat template, padded to its own multiple of ``PAD_MULTIPLE``."""

    def tokenize_one(self, prompt: str) -> tuple[torch.Tensor, torch.Tensor]:
        text = self.tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True
        )
        tokenizer = getattr(self.tokenizer, "tokenizer", self.tokenizer)  # a processor's, or the folder's own
        limit = self.spec.max_length
        warn_if_truncated(tokenizer, [text], limit)
        length = len(tokenizer(text, truncation=True, max_length=limit)["input_ids"])
        window = min(math.ceil(length / PAD_MULTIPLE) * PAD_MULTIPLE, limit)
        inputs = tokenizer(
            text, return_tensors="pt", padding="max_length", padding_side="right", truncation=True, max_length=window
        )
        return inputs["input_ids"], inputs["attention_mask"]

    @torch.no_grad()
    def encode(self, prompts: list[str], dtype: torch.dtype) -> list[torch.Tensor]:
        """One (tokens, len(layers) * hidden) row per prompt. The decoder is cut after the last layer read (32 of
        Qwen3-VL-4B's 36) and its final norm dropped: the states it gives are the whole model's there, unnormed, as
        diffusers reads them (only a model's last layer comes out normed)."""
        rows = []
        for prompt in prompts:
            input_ids, mask = (t.to(self.device) for t in self.tokenize_one(prompt))
            # The padding's position ids are 1, as in the transformers version FLUX.3 was trained with (diffusers
            # passes them explicitly: later versions number them 0).
            positions = torch.arange(mask.shape[1], device=self.device)[None].masked_fill(mask == 0, 1)
            output = self.decoder(
                input_ids=input_ids,
                attention_mask=mask,
                position_ids=positions,
                output_hidden_states=True,
                use_cache=False,
            )
            stacked = torch.stack([output.hidden_states[k] for k in self.spec.layers], dim=2)
            rows.append(stacked.flatten(2)[0].to(dtype))
        return rows


def image_ids(rows: int, cols: int, reference: int, device: torch.device) -> torch.Tensor:
    """Positions (t, h, w, l) of a token grid, rows and columns scaled by IMAGE_ROPE_SCALE; ``l`` 0 for the image
    made, -1, -2, ... for the references."""
    grid = torch.cartesian_prod(torch.arange(1), torch.arange(rows), torch.arange(cols), torch.tensor([-reference]))
    grid = grid.float()
    grid[:, 1:3] *= IMAGE_ROPE_SCALE
    return grid.to(device)


def text_ids(tokens: int, device: torch.device) -> torch.Tensor:
    one = torch.arange(1)
    return torch.cartesian_prod(one, one, one, torch.arange(tokens)).float().to(device)


def prepare_reference(vae_config, image: Image.Image, count: int) -> tuple[torch.Tensor, tuple[int, ...] | None]:
    """diffusers' preprocessing of one of ``count`` references: (1, 3, H, W) pixels in [-1, 1], and for a single one
    the box it fills of its padded canvas (several are each cropped to the token grid, their boxes None)."""
    processor = Flux3ImageProcessor(vae_scale_factor=pixel_granularity(vae_config))
    pixels, postprocessing = processor.preprocess(image, resize_mode="fill" if count == 1 else "crop")
    return pixels, postprocessing["reference_crop"]


@dataclass(frozen=True)
class Flux3Layout:
    """The target's token grid; the references' packed latents (1, tokens, channels) and ids; a flow map's
    timesteps (the schedule, each step's target the next); the (left, top, right, bottom) box of the decoded image
    kept (a single reference's, unpadded), or None."""

    rows: int
    cols: int
    references: torch.Tensor | None = None
    reference_ids: torch.Tensor | None = None
    timesteps: torch.Tensor | None = None
    crop: tuple[int, ...] | None = None


class FlowMapTargets(RequestHook):
    """A flow map is told where each step lands: the layout takes the request's schedule before the first step."""

    def begin_denoise(self, denoise: Denoise) -> None:
        denoise.layout = dataclasses.replace(denoise.layout, timesteps=denoise.timesteps)


class Flux3Pipeline(DiffusionPipeline):
    CONDITIONING = ("embeds", "mask")

    def request_hooks(self) -> list[RequestHook]:
        return [FlowMapTargets()] if self.transformer.config.flow_map else []

    def encode(self, request: ResolvedRequest) -> dict[str, torch.Tensor]:
        """Each prompt keeps its own window: rows of a batch are padded to the longest, the padding masked."""
        return self.encode_rows(request, lambda prompts: self.prompt_encoder.encode(prompts, self.dtype))

    def initial_latents(self, request: ResolvedRequest) -> tuple[torch.Tensor, Flux3Layout]:
        granularity = pixel_granularity(self.spec.vae)
        rows, cols = request.height // granularity, request.width // granularity
        shape = (request.batch, self.transformer.config.in_channels, rows, cols)
        # Drawn in float32 and then cast, as diffusers draws it.
        noise = seeded_noise(shape, request.seed, torch.float32, self.device).to(self.dtype)
        layout = Flux3Layout(rows, cols, *self.encode_references(request), crop=request.output_crop)
        return noise.flatten(2).transpose(1, 2), layout

    @torch.inference_mode()
    def encode_references(self, request: ResolvedRequest) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """The references' latent modes, patchified 2x2 and normalised, packed into one sequence; told apart on the
        ``l`` axis (-1, -2, ...), as diffusers does."""
        if not request.images:
            return None, None
        tokens, ids = [], []
        for index, image in enumerate(request.images):
            pixels, _ = prepare_reference(self.spec.vae, image, len(request.images))
            latents = packed_latents(self.vae, self.vae_encode(pixels.to(self.device, self.vae.dtype)).mode())
            tokens.append(latents.flatten(2).transpose(1, 2))
            ids.append(image_ids(*latents.shape[2:], index + 1, self.device))
        return torch.cat(tokens, dim=1), torch.cat(ids)

    def make_scheduler(self, request: ResolvedRequest, latents: torch.Tensor):
        sigmas = np.linspace(1.0, 1 / request.steps, request.steps)
        return self.scheduled(FlowMatchEulerDiscreteScheduler, sigmas=sigmas)

    def model_inputs(
        self, request: ResolvedRequest, latents: torch.Tensor, t: torch.Tensor, layout: Flux3Layout
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """A flow map's timestep is (batch, 2): the step's and its target's (the next step's, 0 after the last)."""
        model_input, timestep = super().model_inputs(request, latents, t, layout)
        if layout.timesteps is None:
            return model_input, timestep
        schedule = layout.timesteps
        index = int((schedule == t).nonzero()[0])
        target = schedule[index + 1] if index + 1 < len(schedule) else torch.zeros_like(t)
        return model_input, torch.stack([timestep, super().model_inputs(request, latents, target, layout)[1]], -1)

    def runs_prefix_once(self) -> bool:
        """Where the text and references go through their per-mode blocks once per request, not at every step: a model
        without a flow map (whose target embedding reaches them each step), on a plan that keeps those blocks whole and
        the tokens unsplit on each rank (one GPU, --tensor, --cfg-parallel). Elsewhere they run each step, as diffusers
        runs them: the same numbers."""
        if self.runtime.model.config.flow_map:
            return False
        plan = None if self.parallel is None else self.parallel.config
        return plan is None or plan.keeps_sequence_and_stack_whole

    def model_call(self, request: ResolvedRequest, conditioning: dict[str, torch.Tensor], layout: Flux3Layout):
        embeds, mask = conditioning["embeds"], conditioning.get("mask")
        img_ids = image_ids(layout.rows, layout.cols, 0, self.device)
        txt_ids = text_ids(embeds.shape[1], self.device)
        references = None if layout.references is None else layout.references.to(self.dtype)
        prefixed, image_only = self.runs_prefix_once(), self.keeps_only_output_rows(request)
        if prefixed:
            with torch.inference_mode():
                embeds, references = self.runtime.model.encode_prefix(
                    embeds.to(self.dtype), txt_ids, references, layout.reference_ids, mask
                )

        def call(transformer, x: torch.Tensor, timestep: torch.Tensor, latents: torch.Tensor) -> torch.Tensor:
            target = None
            if timestep.ndim == 2:
                timestep, target = timestep.unbind(-1)
            return transformer(
                x,
                embeds,
                timestep,
                img_ids,
                txt_ids,
                references,
                layout.reference_ids,
                target,
                encoder_attention_mask=mask,
                prefixed=prefixed,
                image_only=image_only,
            )

        return call

    @torch.inference_mode()
    def decode(self, latents: torch.Tensor, layout: Flux3Layout) -> torch.Tensor:
        pixels = self.vae_decode(unpacked_latents(self.vae, latents, layout.rows, layout.cols))
        if layout.crop is None:
            return pixels
        left, top, right, bottom = layout.crop
        return pixels[..., top:bottom, left:right]
