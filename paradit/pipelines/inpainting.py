"""Image-to-image and inpainting as diffusers' flow-matching pipelines run them."""

from __future__ import annotations

import torch
from diffusers.image_processor import VaeImageProcessor
from torch.nn import functional as F

from paradit.pipelines.requests import first_step
from paradit.request_hooks import Denoise, RequestHook


def latent_mask(request, like: torch.Tensor, mode: str = "nearest") -> torch.Tensor:
    """``request.mask`` as diffusers' mask processor makes it (white, repainted, 1), resized by ``mode`` to the last two
    axes of ``like`` (the image's latents in their drawn layout) and spread over its others."""
    processor = VaeImageProcessor(do_normalize=False, do_binarize=True, do_convert_grayscale=True)
    mask = processor.preprocess(request.mask, height=request.height, width=request.width)
    mask = F.interpolate(mask, size=like.shape[-2:], mode=mode)
    return mask.view((1,) * (like.ndim - 2) + mask.shape[-2:]).expand(like.shape).to(like.device, like.dtype)


class KeepUnmasked:
    """A scheduler whose steps keep ``image`` where ``mask`` is 0, noised to the next step's level: diffusers' blend as
    its pipelines write it, so a soft mask's edges mix alike. PipeFusion copies it per band, each counting its steps."""

    def __init__(self, scheduler, image: torch.Tensor, noise: torch.Tensor, mask: torch.Tensor) -> None:
        self.scheduler, self.image, self.noise, self.mask = scheduler, image, noise, mask

    def step(self, prediction: torch.Tensor, t: torch.Tensor, latents: torch.Tensor, return_dict: bool = False):
        stepped = self.scheduler.step(prediction, t, latents, return_dict=False)[0]
        kept, upcoming = self.image, self.scheduler.step_index  # the step index has moved on to the next step's
        if upcoming < len(self.scheduler.timesteps):
            # scale_noise reads the level at the scheduler's step index; the timestep passed only sets the batch.
            kept = self.scheduler.scale_noise(self.image, self.scheduler.timesteps[upcoming:][:1], self.noise)
        return ((1 - self.mask) * kept + self.mask * stepped,)


class ImageToImage(RequestHook):
    """diffusers' image-to-image start: the steps from ``first_step`` on, the image's latents noised to the first."""

    def __init__(self, pipeline) -> None:  # the DiffusionPipeline, which imports this module
        self.pipeline = pipeline

    def begin_denoise(self, denoise: Denoise) -> None:
        request, pipeline, scheduler, noise = denoise.request, self.pipeline, denoise.scheduler, denoise.latents
        if request.strength is None:
            return
        start = first_step(request)
        timesteps = denoise.timesteps[start:]
        scheduler.set_begin_index(start)
        generator = torch.Generator("cpu").manual_seed(request.seed)
        image = pipeline.image_latents(request, generator)
        shape = (noise.shape[0], *image.shape[1:])
        fresh = torch.randn(shape, generator=generator, dtype=image.dtype).to(pipeline.device)
        image = image.expand(shape)
        latents = pipeline.pack_drawn(scheduler.scale_noise(image, timesteps[:1].expand(shape[0]), fresh), request)
        if request.mask is not None:
            image, fresh, mask = (
                pipeline.pack_drawn(x, request).to(noise.dtype)
                for x in (image, fresh, pipeline.latent_mask(request, image))
            )
            scheduler = KeepUnmasked(scheduler, image, fresh, mask)
        denoise.latents, denoise.scheduler, denoise.timesteps = latents.to(noise.dtype), scheduler, timesteps
