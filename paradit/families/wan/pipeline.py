"""Wan 2.2 text- and image-to-video: umT5 prompt encoding, seeded video latents, the first frame encoded by the VAE,
denoising with one or two experts, VAE decoding.

Reproduces diffusers' ``WanPipeline`` for the T2V-A14B layout (``transformer`` for the high-noise steps,
``transformer_2`` for the low-noise ones, switched at ``boundary_ratio * num_train_timesteps``, each with its own
guidance scale) and the TI2V-5B layout (one transformer, per-token timesteps, the 2.2 VAE), and
``WanImageToVideoPipeline`` for the I2V-A14B layout (the image's latents and a first-frame mask as extra input
channels) and TI2V-5B with an image (its latent frame in place of the first noisy one, that frame's tokens at
timestep 0), so that the same checkpoint, image and seed give the same frames. The second expert is loaded beside the
first by the loader (``expert_configs``) and reaches the pipeline as ``self.experts``. Differences that only make it
faster: the two guidance branches run as one batch (or on the two halves of the group under CFG parallelism), and a
group encodes the image together.
"""

from __future__ import annotations

import html
from dataclasses import dataclass
from pathlib import Path

import diffusers
import regex
import torch
from diffusers import AutoencoderKLWan
from diffusers.video_processor import VideoProcessor
from PIL import Image
from transformers import AutoTokenizer, UMT5Config, UMT5EncoderModel

from paradit.errors import CheckpointError, InvalidRequest
from paradit.families.sd3.pipeline import offline_t5_tokenizer
from paradit.families.wan.model import WanConfig, WanTransformer, unpatchify
from paradit.families.wan.presets import WanTextEncoder, expert_extra
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

# diffusers' WanPipeline.__call__ defaults, for a checkpoint folder.
DEFAULT_STEPS, DEFAULT_GUIDANCE, DEFAULT_HEIGHT, DEFAULT_WIDTH, DEFAULT_FRAMES, DEFAULT_FPS = 50, 5.0, 480, 832, 81, 16
MAX_FRAMES = 1024
MAX_FPS = 240

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


def spec_from_folder(folder: Path, index: dict) -> ModelSpec:
    """The ModelSpec of a diffusers ``WanPipeline`` or ``WanImageToVideoPipeline`` checkpoint: one or two experts,
    the boundary and per-token timesteps from ``model_index.json``, defaults from diffusers' pipeline."""
    present = {name: isinstance(index.get(name), list) and index[name][0] is not None for name in
               ("transformer", "transformer_2", "image_encoder")}  # fmt: skip
    if not present["transformer"]:
        raise CheckpointError(f"{folder} has no transformer/ (a low-noise expert alone is not served)")
    if present["image_encoder"]:
        raise CheckpointError(
            f"{folder} is a Wan 2.1 image-to-video checkpoint (a CLIP image encoder), which paradit does not run; "
            "its Wan 2.2 checkpoints (I2V-A14B, TI2V-5B) encode the image with the VAE alone and do run"
        )
    transformer = read_json(component_dir(folder, "transformer") / "config.json")
    transformer_2 = None
    boundary = index.get("boundary_ratio")
    if present["transformer_2"] and boundary is not None:
        transformer_2 = read_json(component_dir(folder, "transformer_2") / "config.json")
    scheduler = read_json(component_dir(folder, "scheduler") / "scheduler_config.json")
    experts = "two experts" if transformer_2 else "one transformer"
    experts += ", per-token timesteps" if index.get("expand_timesteps") else ""
    return ModelSpec(
        name=str(folder),
        family="wan",
        description=f"{index.get('_class_name', 'WanPipeline')} checkpoint ({experts})",
        transformer=transformer,
        text_encoder=WanTextEncoder(read_json(component_dir(folder, "text_encoder") / "config.json")),
        vae=read_json(component_dir(folder, "vae") / "config.json"),
        scheduler=scheduler,
        guidance_mode="cfg",
        steps=DEFAULT_STEPS,
        guidance=DEFAULT_GUIDANCE,
        height=DEFAULT_HEIGHT,
        width=DEFAULT_WIDTH,
        weights=CheckpointFolder(folder),
        extra=expert_extra(
            boundary if transformer_2 else None,
            transformer_2,
            bool(index.get("expand_timesteps")),
            DEFAULT_FRAMES,
            DEFAULT_FPS,
            None,
        ),  # fmt: skip
    )


def vae_factors(vae_config: dict) -> tuple[int, int]:
    """(temporal, spatial) compression of the VAE, with diffusers' defaults (the 2.1 VAE's 4 and 8)."""
    return vae_config.get("scale_factor_temporal") or 4, vae_config.get("scale_factor_spatial") or 8


def image_input(spec: ModelSpec) -> str | None:
    """How the model takes an image: ``"first_frame"`` (TI2V-5B: the image's latent replaces the first latent frame;
    optional), ``"channels"`` (I2V-A14B: a first-frame mask and the image's latents beside the noise, in the input
    channels; required), or None (text only)."""
    if spec.extra.get("expand_timesteps"):
        return "first_frame"
    if spec.transformer["in_channels"] > spec.vae.get("z_dim", 16):
        return "channels"
    return None


def resolve_request(spec: ModelSpec, request: GenerationRequest) -> ResolvedRequest:
    """Defaults filled in, or an InvalidRequest naming what is allowed: sides in multiples of the VAE stride times
    the patch, frames one more than a multiple of the VAE's temporal stride, a low-noise guidance only where there
    is a low-noise expert, an image where the model takes one (and always for image-to-video)."""
    temporal, spatial = vae_factors(spec.vae)
    granularity = spatial * spec.transformer["patch_size"][1]
    resolved = resolve_common(spec, request, granularity)
    frames = spec.extra["frames"] if request.frames is None else int(request.frames)
    if frames < 1 or frames % temporal != 1 % temporal or frames > MAX_FRAMES:
        raise InvalidRequest(
            f"frames {frames} is not allowed; this model takes {temporal}k+1 frames (1, {temporal + 1}, "
            f"{2 * temporal + 1}, ...) up to {MAX_FRAMES}"
        )
    guidance_2 = request.guidance_2
    if guidance_2 is not None and spec.extra["transformer_2"] is None:
        raise InvalidRequest("guidance_2 is for models with a low-noise expert; this one has one transformer")
    if spec.extra["transformer_2"] is not None and guidance_2 is None:
        # diffusers' rule: the low-noise scale is the high-noise one unless given; a preset's own default otherwise.
        guidance_2 = resolved.guidance if request.guidance is not None else spec.extra["guidance_2"]
        guidance_2 = resolved.guidance if guidance_2 is None else guidance_2
    if guidance_2 is not None and not 0 <= guidance_2 < float("inf"):
        raise InvalidRequest(f"guidance_2 {guidance_2} is not allowed; give a finite value >= 0")
    resolved.frames, resolved.guidance_2 = frames, guidance_2
    resolved.image = resolve_image(spec, request.image)
    resolved.fps = spec.extra["fps"] if request.fps is None else request.fps
    if not isinstance(resolved.fps, int) or not 1 <= resolved.fps <= MAX_FPS:
        raise InvalidRequest(f"fps {resolved.fps} is not allowed; give a whole number from 1 to {MAX_FPS}")
    return resolved


def resolve_image(spec: ModelSpec, image) -> Image.Image | None:
    mode = image_input(spec)
    if image is None:
        if mode == "channels":
            raise InvalidRequest(f"{spec.name} animates an image; give the first frame (--image PATH)")
        return None
    if mode is None:
        raise InvalidRequest(
            f"{spec.name} is text-to-video and takes no image; the image-to-video models are wan2.2-i2v-a14b and "
            "wan2.2-ti2v-5b"
        )
    if not isinstance(image, Image.Image):
        raise InvalidRequest(f"image must be a PIL image, not {type(image).__name__}")
    # diffusers' load_image hands its pipeline RGB; an alpha channel or a palette would give the VAE wrong channels.
    return image if image.mode == "RGB" else image.convert("RGB")


@dataclass
class ImageCondition:
    """What an image adds to the latents: ``latents`` the VAE's normalised latents of the conditioning video (with
    the first-frame mask in front, for ``channels``), float32; ``keep`` (``first_frame`` only) 1 where the noisy
    latents are kept, 0 on the image's latent frame."""

    latents: torch.Tensor
    keep: torch.Tensor | None

    def model_latents(self, latents: torch.Tensor) -> torch.Tensor:
        if self.keep is None:
            return torch.cat([latents, self.latents], dim=1)
        return (1 - self.keep) * self.latents + self.keep * latents


class UMT5PromptEncoder:
    """umT5's encoder and its tokenizer, loaded on ``weights_device(placement, device)`` and run on ``device``."""

    def __init__(self, encoder, tokenizer, max_length: int, device: torch.device, placement: str = "gpu") -> None:
        self.encoder = place(encoder.eval().requires_grad_(False), placement, device)
        self.tokenizer = tokenizer
        self.max_length = max_length
        self.device = device

    @classmethod
    def from_folder(cls, folder: Path, spec: WanTextEncoder, device: torch.device, dtype: torch.dtype,
                    placement: str = "gpu") -> UMT5PromptEncoder:  # fmt: skip
        encoder = UMT5EncoderModel.from_pretrained(
            component_dir(folder, "text_encoder"), dtype=dtype, device_map=weights_device(placement, device)
        )
        tokenizer = AutoTokenizer.from_pretrained(component_dir(folder, "tokenizer"))
        return cls(encoder, tokenizer, spec.max_length, device, placement)

    @classmethod
    def dummy(cls, spec: WanTextEncoder, device: torch.device, dtype: torch.dtype,
              placement: str = "gpu") -> UMT5PromptEncoder:  # fmt: skip
        config = UMT5Config.from_dict({k: v for k, v in spec.config.items() if k != "model_type"})
        encoder = random_encoder(lambda: UMT5EncoderModel._from_config(config, dtype=dtype), placement, device, dtype)
        return cls(encoder, offline_t5_tokenizer(), spec.max_length, device, placement)

    @torch.no_grad()
    def encode(self, prompts: list[str], dtype: torch.dtype) -> torch.Tensor:
        """(batch, max_length, width): each prompt's features, zero past its length, as diffusers makes them."""
        prompts = [prompt_clean(p) for p in prompts]
        warn_if_truncated(self.tokenizer, prompts, self.max_length, "umT5")
        inputs = self.tokenizer(
            prompts, padding="max_length", max_length=self.max_length, truncation=True, add_special_tokens=True,
            return_attention_mask=True, return_tensors="pt",
        )  # fmt: skip
        mask = inputs.attention_mask.to(self.device)
        hidden = self.encoder(inputs.input_ids.to(self.device), mask).last_hidden_state.to(dtype)
        # The padding's features are not what the model was trained on: zeroed, as the reference zeroes them.
        return hidden * mask.gt(0)[..., None].to(dtype)


class WanPipeline(DiffusionPipeline):
    DIFFUSERS_PIPELINES = ("WanPipeline", "WanImageToVideoPipeline")
    VAE = AutoencoderKLWan
    spec_from_folder = staticmethod(spec_from_folder)
    resolve_request = staticmethod(resolve_request)
    CONDITIONING = ("embeds",)
    VIDEO = True

    @classmethod
    def build_transformer(cls, spec: ModelSpec) -> WanTransformer:
        return WanTransformer(WanConfig.from_dict(spec.transformer))

    @classmethod
    def sequence_tokens(cls, spec: ModelSpec) -> int:
        """The video's patches at ``spec``'s size and its ``extra["frames"]`` (the text is cross-attended apart)."""
        temporal, spatial = vae_factors(spec.vae)
        patch = spec.transformer["patch_size"]
        frames = (spec.extra["frames"] - 1) // temporal + 1
        return frames // patch[0] * (spec.height // spatial // patch[1]) * (spec.width // spatial // patch[2])

    @classmethod
    def expert_configs(cls, spec: ModelSpec) -> dict[str, dict]:
        """The low-noise expert, when the checkpoint has one and a boundary to switch at."""
        transformer_2 = spec.extra.get("transformer_2")
        return {} if transformer_2 is None else {"transformer_2": transformer_2}

    @classmethod
    def load_prompt_encoder(cls, spec: ModelSpec, device: torch.device, dtype: torch.dtype, dummy: bool,
                            placement: str = "gpu") -> UMT5PromptEncoder:  # fmt: skip
        if dummy:
            return UMT5PromptEncoder.dummy(spec.text_encoder, device, dtype, placement)
        return UMT5PromptEncoder.from_folder(spec.folder, spec.text_encoder, device, dtype, placement)

    @staticmethod
    def uses_cfg(spec: ModelSpec, request: ResolvedRequest) -> bool:
        # diffusers guides when the (high-noise) scale is above 1; the low-noise scale then applies even if it is 1.
        return request.guidance > 1

    def encode_prompts(self, prompts: list[str], per_prompt: int) -> torch.Tensor:
        embeds = self.prompt_encoder.encode(prompts, self.dtype).to(self.device)
        return embeds.repeat_interleave(per_prompt, dim=0)

    def encode(self, request: ResolvedRequest) -> dict[str, torch.Tensor]:
        """[conditional; unconditional] umT5 features (the negative prompts "" unless given)."""
        embeds = self.encode_prompts(request.prompts, request.images_per_prompt)
        if self.uses_cfg(self.spec, request):
            negatives = request.negative_prompts or [""] * len(request.prompts)
            embeds = torch.cat([embeds, self.encode_prompts(negatives, request.images_per_prompt)])
        return {"embeds": embeds}

    def initial_latents(self, request: ResolvedRequest) -> tuple[torch.Tensor, ImageCondition | None]:
        """Seeded noise (batch, VAE channels, latent frames, rows, cols), float32 as the reference draws it, and the
        request's image encoded (by the whole group, when there is one) into what it adds to them."""
        temporal, spatial = vae_factors(self.spec.vae)
        shape = (request.batch, self.vae.config.z_dim, (request.frames - 1) // temporal + 1,
                 request.height // spatial, request.width // spatial)  # fmt: skip
        noise = seeded_noise(shape, request.seed, torch.float32, self.device)
        return noise, None if request.image is None else self.image_condition(request, noise)

    @torch.inference_mode()
    def image_condition(self, request: ResolvedRequest, noise: torch.Tensor) -> ImageCondition:
        """The reference's conditioning: the image resized to the request's size by diffusers' video processor, as
        a one-frame video (``first_frame``) or followed by black frames to the full length (``channels``), encoded to
        its latent mean, normalised by the VAE's statistics; for ``channels``, a mask that is 1 on the first frame's
        ``temporal`` slots and 0 elsewhere, in front."""
        temporal, spatial = vae_factors(self.spec.vae)
        pixels = VideoProcessor(vae_scale_factor=spatial).preprocess(
            request.image, height=request.height, width=request.width
        ).unsqueeze(2)  # fmt: skip
        mode = image_input(self.spec)
        if mode == "channels":
            pixels = torch.cat([pixels, pixels.new_zeros(*pixels.shape[:2], request.frames - 1, *pixels.shape[3:])], 2)
        encoded = self.vae_encode(pixels.to(self.device, self.vae.dtype)).mode().float()
        shape = (1, self.vae.config.z_dim, 1, 1, 1)
        mean = torch.tensor(self.vae.config.latents_mean).view(shape).to(self.device)
        inverse_std = 1.0 / torch.tensor(self.vae.config.latents_std).view(shape).to(self.device)
        latents = ((encoded - mean) * inverse_std).repeat(noise.shape[0], 1, 1, 1, 1)
        if mode == "first_frame":
            keep = torch.ones(1, 1, *noise.shape[2:], device=self.device)
            keep[:, :, 0] = 0
            return ImageCondition(latents, keep)
        frames = torch.zeros(noise.shape[0], 1, request.frames, *noise.shape[3:], device=self.device)
        frames[:, :, 0] = 1
        # The first frame's latent stands for ``temporal`` pixel frames; each gets its own mask channel.
        mask = torch.cat([frames[:, :, :1].repeat_interleave(temporal, dim=2), frames[:, :, 1:]], dim=2)
        mask = mask.view(noise.shape[0], -1, temporal, *noise.shape[3:]).transpose(1, 2)
        return ImageCondition(torch.cat([mask, latents], dim=1), None)

    def make_scheduler(self, request: ResolvedRequest, latents: torch.Tensor):
        config = self.spec.scheduler
        scheduler = getattr(diffusers, config.get("_class_name", "UniPCMultistepScheduler")).from_config(config)
        scheduler.set_timesteps(request.steps, device=self.device)
        scheduler.set_begin_index(0)
        return scheduler, scheduler.timesteps

    def band_mask(self, latents: torch.Tensor, start: int, stop: int) -> torch.Tensor:
        """Tokens in raster order (frame, row, column), each a ``patch_size`` box of the latents."""
        patch = self.transformer.config.patch_size
        grid = self.transformer.config.token_grid(*latents.shape[2:])
        tokens = torch.arange(grid[0] * grid[1] * grid[2], device=latents.device)
        mask = ((tokens >= start) & (tokens < stop)).view(grid)
        for axis, size in enumerate(patch):
            mask = mask.repeat_interleave(size, axis)
        return mask.view(1, 1, *mask.shape)

    def predictor(
        self, request: ResolvedRequest, conditioning: dict[str, torch.Tensor], layout: ImageCondition | None
    ) -> NoisePredictor:
        """The high-noise expert (the loop's ``transformer``) for t >= the boundary, the low-noise one below it, each
        with its own guidance scale; TI2V-5B's timestep is given per token, as the reference gives it (0 on the
        image's frame); an image's condition joins the latents the model sees."""
        cfg = self.uses_cfg(self.spec, request)
        branches = self.branches(cfg)
        embeds = branches.local(conditioning["embeds"])
        config = self.transformer.config
        ratio = self.spec.extra.get("boundary_ratio")
        low_noise = self.experts.get("transformer_2")
        boundary = None
        if ratio is not None and low_noise is not None:
            boundary = ratio * self.spec.scheduler.get("num_train_timesteps", 1000)
        per_token = self.spec.extra.get("expand_timesteps", False)

        def predict(latents: torch.Tensor, t: torch.Tensor, transformer) -> torch.Tensor:
            scale, expert = request.guidance, "transformer"
            if boundary is not None and float(t) < boundary:
                transformer, scale, expert = low_noise.forward, request.guidance_2, "transformer_2"
            if self.expert_swap is not None:
                self.expert_swap.activate(expert)
            grid = config.token_grid(*latents.shape[2:])
            if per_token and layout is not None:  # the reference's mask, one value per token, times t (float32)
                keep = layout.keep[0, 0, :: config.patch_size[0], :: config.patch_size[1], :: config.patch_size[2]]
                timestep = (keep * t).flatten().expand(latents.shape[0], -1)
            elif per_token:  # every token at t
                timestep = torch.full((latents.shape[0], grid[0] * grid[1] * grid[2]), float(t), device=latents.device)
            else:
                timestep = t.expand(latents.shape[0])
            model_latents = latents if layout is None else layout.model_latents(latents)
            model_input, timestep = cfg_step_inputs(branches, cfg, model_latents.to(self.dtype), timestep)
            with torch.inference_mode():
                tokens = transformer(model_input, timestep, embeds)
            prediction = unpatchify(tokens, grid, config.patch_size).float()
            if cfg:
                cond, uncond = branches.combine(prediction).chunk(2)
                prediction = uncond + scale * (cond - uncond)
            return prediction

        return predict

    @torch.inference_mode()
    def decode(self, latents: torch.Tensor, layout: ImageCondition | None) -> torch.Tensor:
        """Frames (batch, frames, 3, H, W) in [0, 1]: the latents (with TI2V's image frame put back, as the reference
        does) un-normalised by the VAE's per-channel mean and std (divided by 1 / std, as the reference computes
        it), decoded, mapped from [-1, 1]."""
        if layout is not None and layout.keep is not None:
            latents = layout.model_latents(latents)
        vae_config = self.vae.config
        latents = latents.to(self.vae.dtype)
        shape = (1, vae_config.z_dim, 1, 1, 1)
        mean = torch.tensor(vae_config.latents_mean).view(shape).to(latents.device, latents.dtype)
        inverse_std = 1.0 / torch.tensor(vae_config.latents_std).view(shape).to(latents.device, latents.dtype)
        video = self.vae_decode(latents / inverse_std + mean)
        return (video * 0.5 + 0.5).clamp(0, 1).transpose(1, 2)
