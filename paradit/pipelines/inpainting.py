"""Inpainting as diffusers' flow-matching inpainting pipelines run it: after every step, the latents outside the mask
are put back to the input image's, noised to the level of the step that follows (the last step's to the image
itself)."""

from __future__ import annotations

import torch
from diffusers.image_processor import VaeImageProcessor
from torch.nn import functional as F


def latent_mask(request, like: torch.Tensor, mode: str = "nearest") -> torch.Tensor:
    """``request.mask`` at the output's size, white (repainted) 1 and black 0 as diffusers' mask processor makes it,
    resized (``mode``: as the model's pipeline resizes it) to the last two (height, width) axes of ``like`` (the
    image's latents in their drawn layout), spread over its other axes, in its dtype and on its device."""
    processor = VaeImageProcessor(do_normalize=False, do_binarize=True, do_convert_grayscale=True)
    mask = processor.preprocess(request.mask, height=request.height, width=request.width)
    mask = F.interpolate(mask, size=like.shape[-2:], mode=mode)
    return mask.view((1,) * (like.ndim - 2) + mask.shape[-2:]).expand(like.shape).to(like.device, like.dtype)


class KeepUnmasked:
    """A scheduler whose every step keeps ``image`` where ``mask`` is 0: there the stepped latents are replaced by
    ``image`` noised with ``noise`` to the next step's level (diffusers' blend, written as its pipelines write it, so
    that a soft mask's edges mix alike). All in the layout the loop steps. PipeFusion copies it per band, each copy
    counting its own steps as the scheduler does."""

    def __init__(self, scheduler, image: torch.Tensor, noise: torch.Tensor, mask: torch.Tensor) -> None:
        self.scheduler, self.image, self.noise, self.mask = scheduler, image, noise, mask

    def step(self, prediction: torch.Tensor, t: torch.Tensor, latents: torch.Tensor, return_dict: bool = False):
        stepped = self.scheduler.step(prediction, t, latents, return_dict=False)[0]
        kept, upcoming = self.image, self.scheduler.step_index  # the step index has moved on to the next step's
        if upcoming < len(self.scheduler.timesteps):
            # scale_noise reads the level at the scheduler's step index; the timestep passed only sets the batch.
            kept = self.scheduler.scale_noise(self.image, self.scheduler.timesteps[upcoming:][:1], self.noise)
        return ((1 - self.mask) * kept + self.mask * stepped,)
