"""Builds a rank's pipeline, the same way for one process, spawned workers and torchrun."""

from __future__ import annotations

import dataclasses
import functools

import torch
from safetensors import SafetensorError

from paradit.device_memory import configure_allocator, hold_to_cap, reporting_out_of_memory
from paradit.errors import CheckpointError
from paradit.expert_swap import ExpertSwap
from paradit.families import FAMILIES, PRESETS
from paradit.options import ExecutionOptions
from paradit.parallel.mesh import ParallelContext, init_process_group
from paradit.parallel.parallelize import plain_vae_decode, plain_vae_encode
from paradit.pipelines.base import DiffusionPipeline, load_vae
from paradit.request import GenerationResult, ResolvedRequest
from paradit.runtime import load_transformer
from paradit.settings import WorkerPlan
from paradit.spec import ModelSpec
from paradit.text_encoder import load_prompt_encoder


def import_family_classes() -> None:
    """Every family's pipeline, prompt encoder and VAE classes, which the records import only when asked."""
    for spec in PRESETS.values():
        family = FAMILIES[spec.family]
        family.pipeline(spec), family.prompt_encoder(spec), family.vae_class


# With the loader, which the forkserver preloads: its workers start with every family's classes imported.
import_family_classes()


def load_pipeline(
    spec: ModelSpec,
    device: torch.device,
    dtype: torch.dtype,
    context: ParallelContext | None = None,
    options: ExecutionOptions | None = None,
    placement: str = "gpu",
    vae_tiled: bool = False,
) -> DiffusionPipeline:
    """This rank's pipeline: its share of the transformers, the prompt encoders on rank 0 alone, the VAE."""
    options = options or ExecutionOptions()
    family = FAMILIES[spec.family]
    # Swapped experts load one at a time on the device and leave for host memory, the resident one last.
    experts = {}
    swap = ExpertSwap(device) if options.swap_experts and spec.experts else None
    for component, config in {**spec.experts, "transformer": spec.transformer}.items():
        component_spec = dataclasses.replace(spec, transformer=config)
        loaded = load_transformer(family, component_spec, device, dtype, context, options, component)
        experts[component] = loaded
        if swap is not None:
            swap.add(component, loaded.model, resident=component == "transformer")
    transformer = experts.pop("transformer")
    if vae_tiled:
        alone = dataclasses.replace(transformer.parallel, vae_decode=plain_vae_decode, vae_encode=plain_vae_encode)
        transformer = dataclasses.replace(transformer, parallel=alone)
    dummy, prompt_encoder = spec.folder is None, None
    try:
        if context is None or context.is_leader:
            prompt_encoder = load_prompt_encoder(family, spec, device, dtype, dummy, placement)
        vae = load_vae(family, spec, device, dtype, dummy).to(device).eval().requires_grad_(False)
        if vae_tiled:
            vae.enable_tiling()
    except (OSError, ValueError, SafetensorError) as exc:  # transformers' and diffusers' words for a bad folder
        raise CheckpointError(f"{spec.folder}: its prompt encoders or VAE did not load: {exc}") from None
    pipeline = family.pipeline(spec)
    return pipeline(family, spec, transformer, prompt_encoder, vae, device, dtype, context, experts, swap)


def build_pipeline(plan: WorkerPlan, rank: int = 0, local_rank: int = 0) -> DiffusionPipeline:
    device = torch.device("cuda", local_rank) if plan.device_type == "cuda" else torch.device("cpu")
    configure_allocator(device)
    hold_to_cap(device, plan.memory_cap)
    context = None
    if plan.parallel.world_size > 1 or plan.parallel.shard_weights:  # sharding over one GPU: a group of one
        init_process_group(device, rank, plan.parallel.world_size, plan.init_method)
        context = ParallelContext.build(plan.parallel, device)
    load = functools.partial(
        load_pipeline, plan.spec, device, plan.dtype, context, plan.options, plan.text_encoder_placement, plan.vae_tiled
    )
    return reporting_out_of_memory(load, lambda: "while loading the model", device, plan.budget)


def run_requests(
    pipeline: DiffusionPipeline, plan: WorkerPlan, requests: list[ResolvedRequest], progress: bool = False, on_step=None
) -> list[GenerationResult] | None:
    generate = functools.partial(pipeline.generate, requests, progress=progress, on_step=on_step)
    return reporting_out_of_memory(generate, lambda: pipeline.stage, pipeline.device, plan.budget)
