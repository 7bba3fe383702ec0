"""Z-Image text-to-image: prompt encoding, seeded latents, denoising, VAE decoding.

Reproduces diffusers' ``ZImagePipeline`` (Turbo and the non-distilled base model) so that the same checkpoint and
seed give the same image. Differences that only make it faster: under CFG parallelism the unconditional branch runs
on the other half of the group, and the text encoder stops at the layer it is read at (its last layer never runs).
"""

from __future__ import annotations

from pathlib import Path

import torch
from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler
from torch import nn

from paradit.errors import InvalidRequest
from paradit.families.zimage.model import ZImageConfig, ZImageTransformer, unpatchify
from paradit.families.zimage.presets import TURBO_SCHEDULER, text_encoder_spec
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
from paradit.text_encoder import PromptEncoder, warn_if_truncated
from paradit.weights import component_dir, read_json

# diffusers' ZImagePipeline defaults; a checkpoint scheduled like the published Turbo gets Turbo's instead.
DEFAULT_STEPS, DEFAULT_GUIDANCE, DEFAULT_SIZE = 50, 5.0, 1024
TURBO_STEPS = 8


def is_turbo_scheduler(scheduler: dict) -> bool:
    """The model_index of Turbo and of the base model are identical; their schedulers are not (shift 3.0 vs 6.0)."""
    return all(scheduler.get(key) == value for key, value in TURBO_SCHEDULER.items())


def spec_from_folder(folder: Path, index: dict) -> ModelSpec:
    """The ModelSpec of a diffusers Z-Image checkpoint: architecture from its configs, defaults from its pipeline."""
    transformer = read_json(component_dir(folder, "transformer") / "config.json")
    encoder = read_json(component_dir(folder, "text_encoder") / "config.json")
    scheduler = read_json(component_dir(folder, "scheduler") / "scheduler_config.json")
    turbo = is_turbo_scheduler(scheduler)
    return ModelSpec(
        name=str(folder),
        family="zimage",
        description=f"ZImagePipeline checkpoint ({'Turbo, step-distilled' if turbo else 'true CFG'})",
        transformer=transformer,
        text_encoder=text_encoder_spec(encoder, encoder["num_hidden_layers"]),
        vae=read_json(component_dir(folder, "vae") / "config.json"),
        scheduler=scheduler,
        guidance_mode="cfg",
        steps=TURBO_STEPS if turbo else DEFAULT_STEPS,
        guidance=0.0 if turbo else DEFAULT_GUIDANCE,
        height=DEFAULT_SIZE,
        width=DEFAULT_SIZE,
        weights=CheckpointFolder(folder),
        extra={"text_encoder_class": index.get("text_encoder", [None, None])[1]},
    )


def pixel_granularity(vae_config: dict) -> int:
    """Pixels per latent token side: the VAE's stride (one per down block after the first), times the 2x2 patch."""
    return 2 ** (len(vae_config["block_out_channels"]) - 1) * 2


def resolve_request(spec: ModelSpec, request: GenerationRequest) -> ResolvedRequest:
    """The request with defaults filled in, or an InvalidRequest naming what is wrong and what is allowed."""
    g = pixel_granularity(spec.vae)
    # Rotary positions are looked up in tables of axes_lens rows; a latent grid past them has no position.
    _, max_rows, max_cols = spec.transformer["axes_lens"]
    for name, value, limit in (("height", request.height, max_rows * g), ("width", request.width, max_cols * g)):
        if value is not None and value > limit:
            raise InvalidRequest(
                f"{name} {value} is not allowed; this model takes multiples of {g} from {g} to {limit}"
            )
    return resolve_common(spec, request, g, largest=(max_rows * g, max_cols * g))


def timestep_shift_mu(image_tokens: int, scheduler_config: dict) -> float:
    """The shift exponent for schedulers with dynamic shifting: linear in the image token count between the
    scheduler's base and max sequence lengths (unused by the published checkpoints' fixed-shift schedulers)."""
    base_len = scheduler_config.get("base_image_seq_len", 256)
    max_len = scheduler_config.get("max_image_seq_len", 4096)
    base_shift = scheduler_config.get("base_shift", 0.5)
    max_shift = scheduler_config.get("max_shift", 1.15)
    slope = (max_shift - base_shift) / (max_len - base_len)
    return image_tokens * slope + (base_shift - slope * base_len)


class CaptionEncoder(PromptEncoder):
    """Qwen3 read at one hidden layer, with the Qwen chat template (thinking left on, so no empty think block is
    appended) and the padding dropped: one (tokens, hidden) tensor per prompt."""

    def tokenize(self, prompts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
        texts = [
            self.tokenizer.apply_chat_template(
                [{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True, enable_thinking=True
            )
            for prompt in prompts
        ]
        warn_if_truncated(self.tokenizer, texts, self.spec.max_length)
        inputs = self.tokenizer(
            texts, padding="max_length", max_length=self.spec.max_length, truncation=True, return_tensors="pt"
        )
        return inputs["input_ids"], inputs["attention_mask"].bool()

    @torch.no_grad()
    def encode(self, prompts: list[str], dtype: torch.dtype) -> list[torch.Tensor]:
        input_ids, attention_mask = self.tokenize(prompts)
        attention_mask = attention_mask.to(self.device)
        output = self.decoder(
            input_ids=input_ids.to(self.device),
            attention_mask=attention_mask,
            output_hidden_states=True,
            use_cache=False,
        )
        (layer,) = self.spec.layers
        hidden = output.hidden_states[layer].to(dtype)
        return [row[keep] for row, keep in zip(hidden, attention_mask)]


def pad_captions(captions: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-pad to the longest caption: (B, T, hidden) and the (B, T) mask of real tokens."""
    lengths = torch.tensor([c.shape[0] for c in captions], device=captions[0].device)
    padded = nn.utils.rnn.pad_sequence(captions, batch_first=True)
    return padded, torch.arange(padded.shape[1], device=padded.device) < lengths[:, None]


class ZImagePipeline(DiffusionPipeline):
    DIFFUSERS_PIPELINES = ("ZImagePipeline",)
    VAE = AutoencoderKL
    spec_from_folder = staticmethod(spec_from_folder)
    resolve_request = staticmethod(resolve_request)
    CONDITIONING = ("embeds", "mask")

    @classmethod
    def build_transformer(cls, spec: ModelSpec) -> ZImageTransformer:
        return ZImageTransformer(ZImageConfig.from_dict(spec.transformer))

    @classmethod
    def load_prompt_encoder(
        cls, spec: ModelSpec, device: torch.device, dtype: torch.dtype, dummy: bool, placement: str = "gpu"
    ) -> CaptionEncoder:
        if dummy:
            return CaptionEncoder.dummy(spec.text_encoder, device, dtype, placement)
        encoder_class = spec.extra["text_encoder_class"]
        return CaptionEncoder.from_folder(spec.folder, encoder_class, spec.text_encoder, device, dtype, placement)

    @staticmethod
    def uses_cfg(spec: ModelSpec, request: ResolvedRequest) -> bool:
        # The reference guides whenever the scale is above 0 (its formula adds scale * (cond - uncond) to cond), the
        # step-distilled Turbo too: its default of 0 turns guidance off, a request may turn it on.
        return request.guidance > 0

    def encode_prompts(self, prompts: list[str], images_per_prompt: int) -> list[torch.Tensor]:
        captions = self.prompt_encoder.encode(prompts, self.dtype)
        return [caption.to(self.device) for caption in captions for _ in range(images_per_prompt)]

    def encode(self, request: ResolvedRequest) -> dict[str, torch.Tensor]:
        """[conditional; unconditional] caption features padded to a common length, and the mask of real tokens."""
        captions = self.encode_prompts(request.prompts, request.images_per_prompt)
        if self.uses_cfg(self.spec, request):
            negatives = request.negative_prompts or [""] * len(request.prompts)
            captions += self.encode_prompts(negatives, request.images_per_prompt)
        embeds, mask = pad_captions(captions)
        return {"embeds": embeds, "mask": mask}

    def initial_latents(self, request: ResolvedRequest) -> tuple[torch.Tensor, None]:
        """Seeded noise, float32 whatever the model dtype (the scheduler steps in float32)."""
        stride = pixel_granularity(self.spec.vae) // self.transformer.config.patch_size
        shape = (request.batch, self.transformer.config.in_channels, request.height // stride, request.width // stride)
        return seeded_noise(shape, request.seed, torch.float32, self.device), None

    def make_scheduler(self, request: ResolvedRequest, latents: torch.Tensor):
        scheduler = FlowMatchEulerDiscreteScheduler.from_config(self.spec.scheduler)
        # Sigmas as the reference makes them: a float32 linspace, handed over as Python floats.
        sigmas = torch.linspace(1.0, 1 / request.steps, request.steps).tolist()
        patch = self.transformer.config.patch_size
        image_tokens = latents.shape[2] // patch * (latents.shape[3] // patch)
        scheduler.set_timesteps(
            sigmas=sigmas, device=self.device, mu=timestep_shift_mu(image_tokens, self.spec.scheduler)
        )
        scheduler.set_begin_index(0)
        return scheduler, scheduler.timesteps

    def band_mask(self, latents: torch.Tensor, start: int, stop: int) -> torch.Tensor:
        return patch_grid_band_mask(latents, self.transformer.config.patch_size, start, stop)

    def predictor(
        self, request: ResolvedRequest, conditioning: dict[str, torch.Tensor], layout: None
    ) -> NoisePredictor:
        """The conditioning holds [conditional; unconditional] rows under CFG; the branches object decides which of
        them this rank computes (all of them on one GPU, one half under CFG parallelism). The mask becomes None when
        every caption has the same length (every rank holds the same mask: same decision)."""
        cfg = self.uses_cfg(self.spec, request)
        branches = self.branches(cfg)
        embeds, mask = branches.local(conditioning["embeds"]), conditioning["mask"]
        mask = None if bool(mask.all()) else branches.local(mask)
        scale, patch = request.guidance, self.transformer.config.patch_size

        def predict(latents: torch.Tensor, t: torch.Tensor, transformer) -> torch.Tensor:
            # The transformer is conditioned on 1 - sigma, which the reference derives from the scheduler's t.
            timestep = (1000 - t.expand(latents.shape[0])) / 1000
            model_input, timestep = cfg_step_inputs(branches, cfg, latents.to(self.dtype), timestep)
            with torch.inference_mode():
                tokens = transformer(model_input, timestep, embeds, mask)
            rows, cols = (side // patch for side in latents.shape[2:])
            prediction = unpatchify(tokens, rows, cols, patch).float()
            if cfg:
                cond, uncond = branches.combine(prediction).chunk(2)
                prediction = cond + scale * (cond - uncond)
            # The model predicts the velocity towards the image; the scheduler steps along noise minus image.
            return -prediction

        return predict

    @torch.inference_mode()
    def decode(self, latents: torch.Tensor, layout: None) -> torch.Tensor:
        latents = latents.to(self.vae.dtype)
        latents = latents / self.vae.config.scaling_factor + self.vae.config.shift_factor
        image = self.vae_decode(latents)
        return (image * 0.5 + 0.5).clamp(0, 1)
