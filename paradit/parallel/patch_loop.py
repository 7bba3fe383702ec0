"""PipeFusion's denoise loop: a flow-matching update is elementwise, so each patch's rows advance as its prediction
lands and the next step's patch goes in behind it: a step costs ``patches`` patch-times, not ``patches+stages-1``."""

from __future__ import annotations

import copy
import sys
from collections.abc import Callable

import torch
from tqdm import tqdm

from paradit.parallel.pipefusion import PatchItem, PipeFusion

# (latents, first row, end row) -> a mask over the latents of what those output-stream rows become.
BandMask = Callable[[torch.Tensor, int, int], torch.Tensor]


def denoise_by_patches(
    predict: Callable[[torch.Tensor, torch.Tensor, Callable[..., torch.Tensor]], torch.Tensor],
    scheduler,
    latents: torch.Tensor,
    timesteps: torch.Tensor,
    pipefusion: PipeFusion,
    band_mask: BandMask,
    mark_step: Callable[[], None],
    progress: bool,
) -> torch.Tensor:
    """``mark_step`` is called at the start and as each step's last patch lands. ``predict``'s work after the
    transformer must not depend on row or step: a call may return an earlier step."""
    steps = len(timesteps)
    # One scheduler per band of a patched step: each advances its own step count once per step.
    band_schedulers = [copy.deepcopy(scheduler) for _ in range(pipefusion.patches)]
    masks: dict[int, torch.Tensor] = {}  # per band; the bands are fixed for the request
    landed = [0] * steps
    bar = tqdm(total=steps, desc="denoise", unit="step", disable=not progress, file=sys.stderr, leave=False)

    def call(submits: list[PatchItem], collect: int, t: torch.Tensor) -> None:
        nonlocal latents
        collected = []

        def transformer(*args, **kwargs) -> torch.Tensor:
            out, items = pipefusion.run(submits, collect, *args, **kwargs)
            collected.extend(items)
            return out

        prediction = predict(latents, t, transformer)
        for done in collected:
            item = done.item
            step_t = timesteps[item.step]
            # A whole (warm-up) step covers every band: each band's scheduler takes its own rows.
            for band in range(pipefusion.patches) if item.patches == 1 else [item.patch]:
                if band not in masks:
                    masks[band] = band_mask(latents, *pipefusion.band(band, pipefusion.patches))
                stepped = band_schedulers[band].step(prediction, step_t, latents, return_dict=False)[0]
                latents = torch.where(masks[band], stepped.to(latents.dtype), latents)
            landed[item.step] += 1
            if landed[item.step] == item.patches:
                mark_step()
                bar.update()

    mark_step()
    for step, t in enumerate(timesteps):
        patches = pipefusion.patches_at(step)
        for patch in range(patches):
            # This patch's latents need the previous step's prediction for its rows: land what precedes it.
            waiting = 0
            for earlier in pipefusion.in_flight:
                if earlier.step == step or (earlier.patches == patches and earlier.patch > patch):
                    break
                waiting += 1
            if waiting:
                call([], waiting, t)
            # Keep patches - 1 in flight: the last stage's work on them overlaps the first stage's next patches.
            call([PatchItem(step, patch, patches)], max(0, len(pipefusion.in_flight) + 1 - (patches - 1)), t)
    if pipefusion.in_flight:
        call([], len(pipefusion.in_flight), timesteps[-1])
    bar.close()
    return latents
