"""``parallelize``: the one place that applies parallelism to a plain model, every strategy in a fixed order, on the
meta device before loading (as torchtitan's ``parallelize_*``); pipelines use what it returns and name no strategy."""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from tqdm import tqdm

from paradit.parallel.cfg import BatchedBranches, SplitBranches
from paradit.parallel.mesh import ParallelContext
from paradit.parallel.patch_loop import BandMask, denoise_by_patches
from paradit.parallel.pipefusion import PipeFusion
from paradit.parallel.sequence import SequenceParallel
from paradit.parallel.tensor import parallelize_tensor
from paradit.parallel.tensor_plan import TensorPlan
from paradit.parallel.vae import parallel_decode, parallel_encode
from paradit.weights import TensorSlice

# predict(latents, t, transformer) -> the (guided) noise prediction, calling ``transformer`` like the model.
NoisePredictor = Callable[[torch.Tensor, torch.Tensor, Callable[..., torch.Tensor]], torch.Tensor]


class DenoiseLoop:
    """The scheduler run over the timesteps, one whole prediction per step."""

    def begin_request(self) -> None:
        """Called first by ``run``."""

    def run(
        self,
        predict: NoisePredictor,
        transformer,
        scheduler,
        latents: torch.Tensor,
        timesteps: torch.Tensor,
        band_mask: BandMask,
        mark_step: Callable[[], None],
        progress: bool,
    ) -> torch.Tensor:
        """``mark_step`` is called at the start and after each step."""
        self.begin_request()
        mark_step()
        for t in tqdm(timesteps, desc="denoise", unit="step", disable=not progress, file=sys.stderr, leave=False):
            latents = scheduler.step(predict(latents, t, transformer), t, latents, return_dict=False)[0]
            mark_step()
        return latents


class PipeFusionLoop(DenoiseLoop):
    """Each request starts with warm-up steps; with patches, the latents advance patch by patch (``patch_loop``)."""

    def __init__(self, pipefusion: PipeFusion) -> None:
        self.pipefusion = pipefusion

    def begin_request(self) -> None:
        self.pipefusion.begin_request()

    def run(self, predict, transformer, scheduler, latents, timesteps, band_mask, mark_step, progress):
        if self.pipefusion.patches == 1:
            return super().run(predict, transformer, scheduler, latents, timesteps, band_mask, mark_step, progress)
        self.begin_request()
        # A step ends while later patches are in flight between the stages: stopping there would leave their transfers
        # unmatched. What ``mark_step`` raises (a cancellation) is raised once the loop has drained.
        raised = []

        def mark_step_deferring() -> None:
            try:
                mark_step()
            except Exception as exc:  # noqa: BLE001 - re-raised below, whatever it is
                raised.append(exc)

        latents = denoise_by_patches(
            predict, scheduler, latents, timesteps, self.pipefusion, band_mask, mark_step_deferring, progress
        )
        if raised:
            raise raised[0]
        return latents


def plain_vae_decode(vae: nn.Module, latents: torch.Tensor) -> torch.Tensor:
    return vae.decode(latents, return_dict=False)[0]


def plain_vae_encode(vae: nn.Module, images: torch.Tensor):
    return vae.encode(images).latent_dist


@dataclass(frozen=True)
class Parallelized:
    """``model``: the plain model, parallelized in place (what FP8 and compilation act on); ``forward``: what to call
    in its place; ``slices``: the part of each sharded tensor this rank loads."""

    model: nn.Module
    forward: nn.Module
    slices: dict[str, TensorSlice] = field(default_factory=dict)
    branches: BatchedBranches | SplitBranches = field(default_factory=BatchedBranches)
    loop: DenoiseLoop = field(default_factory=DenoiseLoop)
    vae_decode: Callable[[nn.Module, torch.Tensor], torch.Tensor] = plain_vae_decode
    vae_encode: Callable[[nn.Module, torch.Tensor], Any] = plain_vae_encode


def parallelize(model: nn.Module, tensor_plan: TensorPlan | None, context: ParallelContext | None) -> Parallelized:
    """Tensor parallelism goes first, so that its slices reach the loader; PipeFusion's stale-K/V attention wraps the
    sequence group's."""
    if context is None:
        return Parallelized(model, model)
    config = context.config
    # parallelize_tensor's ``tensor_slices`` checks the plan.
    slices = parallelize_tensor(model, tensor_plan, context) if config.tensor > 1 else {}
    sequence = SequenceParallel(model, context) if config.sequence_degree > 1 else None
    forward, loop = sequence or model, DenoiseLoop()
    if config.pipefusion > 1:
        forward = PipeFusion(model, context, sequence)
        loop = PipeFusionLoop(forward)
    branches = SplitBranches(context) if config.cfg == 2 else BatchedBranches()
    # Every rank ends the loop with the same latents (and has the request's images): the group decodes them together.
    return Parallelized(model, forward, slices, branches, loop, parallel_decode, parallel_encode)
