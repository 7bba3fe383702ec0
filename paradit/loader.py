"""Builds a rank's pipeline, the same way for one process, spawned workers and torchrun."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
from safetensors import SafetensorError
from torch import nn

from paradit.checkpoint import safetensors_files
from paradit.compile import model_blocks
from paradit.device_memory import MemoryBudget, configure_allocator, hold_to_cap, reporting_out_of_memory
from paradit.errors import CheckpointError
from paradit.expert_swap import ExpertSwap
from paradit.families import FAMILIES
from paradit.family import Family
from paradit.layers.attention import use_fp8_attention
from paradit.layers.fp8 import fp8_dtype
from paradit.lora import LoraSet
from paradit.lora.apply import FusedLoraTensors, add_side_paths, read_updates
from paradit.lora.refs import adapter_key
from paradit.lora.variants import adapter_chooser
from paradit.optimize import apply_execution_options
from paradit.options import ExecutionOptions
from paradit.parallel.config import ParallelConfig
from paradit.parallel.mesh import ParallelContext, init_process_group
from paradit.parallel.parallelize import Parallelized, parallelize, plain_vae_decode, plain_vae_encode
from paradit.parallel.shard import shard_module, shard_root
from paradit.pipelines.base import DiffusionPipeline, load_vae
from paradit.quantize import fp8_load
from paradit.request import GenerationResult, ResolvedRequest
from paradit.spec import CheckpointFolder, Fp8PresetFolder, ModelSpec
from paradit.text_encoder import load_prompt_encoder
from paradit.weights import CheckpointTensors, DummyTensors, Fp8Load, ModelNames, TensorSource, materialize


@dataclass(frozen=True)
class WorkerPlan:
    """Everything a rank needs to build its part of the pipeline (picklable, sent to each spawned process)."""

    spec: ModelSpec
    device_type: str
    dtype: torch.dtype
    parallel: ParallelConfig
    options: ExecutionOptions
    memory_cap: int | None
    init_method: str = "env://"
    text_encoder_placement: str = "gpu"
    vae_tiled: bool = False  # the memory plan's last resort: every rank decodes the whole latent tile by tile
    budget: MemoryBudget = MemoryBudget()  # what rank 0 was planned to hold, for an out-of-memory error's line


def load_transformer(
    family: Family,
    spec: ModelSpec,
    device: torch.device,
    dtype: torch.dtype,
    parallel: ParallelContext | None = None,
    quantize: str = "none",
    component: str = "transformer",
    lora: LoraSet | None = None,
    options: ExecutionOptions | None = None,
) -> Parallelized:
    """This rank's transformer, parallelized: built and parallelized on the meta device, then only the tensors the
    rank kept are read from ``spec``'s transformer folder or drawn at random. ``quantize="fp8"`` converts the
    quantizable linears as they load; an FP8 checkpoint's linears load as FP8 whatever ``quantize`` says. No check
    that FP8 can run here: converting on the CPU is allowed (``ExecutionOptions.validate`` guards execution).
    ``component``: another transformer of the checkpoint (``spec.experts``; ``spec.transformer`` is its config).
    ``lora``: adapters fused into the weights as they are read, or side paths added beside the linears.
    ``options``: its attention kernel, chosen before parallelism wraps the attention."""
    with torch.device("meta"):
        plain = family.build_transformer(spec).eval()
    names = ModelNames(plain)
    refs = lora.of(component) if lora else ()
    updates = read_updates(family.lora_loader, refs, plain, component) if refs else {}  # the whole model's names
    fp8_attention = None
    if options is not None and options.attention == "fp8":
        fp8_attention = use_fp8_attention(plain, options.attention_bf16_steps)
    parallelized = parallelize(plain, family.tensor_plan, parallel)
    parallelized.attention = fp8_attention
    fp8 = fp8_load(plain, names, spec.transformer, quantize, fp8_dtype(device), family.keep_high_precision)
    if updates and not lora.fused:  # a server's named adapters start unchosen; a run's all apply at their scales
        scales = {} if lora.switchable else {adapter_key(ref, index): 1.0 for index, ref in enumerate(refs)}
        add_side_paths(plain, names, updates, parallelized.slices, device, dtype, scales, lora.switchable)

    def adapted(source: TensorSource) -> TensorSource:
        return FusedLoraTensors(source, updates) if updates and lora.fused else source

    # A preset's FP8 folder holds its transformer alone; a checkpoint folder holds each component (None: random).
    fp8_preset = isinstance(spec.weights, Fp8PresetFolder) and component == "transformer"
    folder = spec.weights.transformer if fp8_preset else spec.folder and spec.folder / component
    if folder is None:
        buffers = {name for name, _ in plain.named_buffers()}
        # Each component its own random weights (two experts drawn alike would hide a swapped expert).
        seed = 0 if component == "transformer" else sum(component.encode())
        _fill(plain, names, adapted(DummyTensors(device, dtype, buffers, seed)), parallelized, fp8, parallel)
        if family.after_dummy_init is not None:
            family.after_dummy_init(plain)
    else:
        allow_pickle = isinstance(spec.weights, CheckpointFolder) and spec.weights.allow_pickle
        with CheckpointTensors(safetensors_files(folder, allow_pickle), device, dtype) as source:
            _fill(plain, names, adapted(source), parallelized, fp8, parallel)
    if updates and lora.switchable:
        parallelized.choose_adapters = adapter_chooser(plain, lora.cache)
    if parallel is not None and parallel.config.shard_weights:
        parallelized.forward = shard_root(parallelized.forward, plain, parallel)
    return parallelized


def _fill(
    plain: nn.Module,
    names: ModelNames,
    source: TensorSource,
    parallelized: Parallelized,
    fp8: Fp8Load | None,
    context: ParallelContext | None,
) -> None:
    """Every tensor this rank keeps, read from ``source``; with sharded weights, each block sharded as soon as it has
    loaded, so that no more than one block is ever whole."""
    if context is not None and context.config.shard_weights:
        for block in model_blocks(plain):
            materialize(block, names, source, parallelized.slices, fp8)
            shard_module(block, context)
    materialize(plain, names, source, parallelized.slices, fp8)


def load_pipeline(
    spec: ModelSpec,
    device: torch.device,
    dtype: torch.dtype,
    context: ParallelContext | None = None,
    options: ExecutionOptions | None = None,
    placement: str = "gpu",
    vae_tiled: bool = False,
) -> DiffusionPipeline:
    """This rank's pipeline in ``context``'s group (None: one process): its share of the transformer, with the
    execution options applied; the prompt encoders (placed as ``placement`` says) on rank 0 alone; the VAE, decoding
    with the group (or, ``vae_tiled``, alone and tile by tile: diffusers' tiling, which blends the tiles' seams and so
    differs slightly from the whole decode; tests/test_memory.py measures it)."""
    options = options or ExecutionOptions()
    family = FAMILIES[spec.family]
    # The transformer and the further ones (a low-noise expert; check_plan refused PipeFusion for those), each
    # parallelized alike. Swapped experts load one at a time on the device and leave for host memory, the resident one
    # last: the device never holds two (and random weights and FP8 conversion run at the device's speed).
    experts = {}
    swap = ExpertSwap(device) if options.swap_experts and spec.experts else None
    for component, config in {**spec.experts, "transformer": spec.transformer}.items():
        component_spec = dataclasses.replace(spec, transformer=config)
        loaded = load_transformer(
            family, component_spec, device, dtype, context, options.quantize, component, options.lora, options
        )
        loaded.forward = apply_execution_options(loaded, options, device)
        experts[component] = loaded
        if swap is not None:
            swap.add(component, loaded.model, resident=component == "transformer")
    transformer = experts.pop("transformer")
    if vae_tiled:
        transformer = dataclasses.replace(transformer, vae_decode=plain_vae_decode, vae_encode=plain_vae_encode)
    dummy, prompt_encoder = spec.folder is None, None
    try:
        if context is None or context.is_leader:
            prompt_encoder = load_prompt_encoder(family, spec, device, dtype, dummy, placement)
        vae = load_vae(family, spec, device, dtype, dummy).to(device).eval().requires_grad_(False)
        if vae_tiled:
            vae.enable_tiling()
    except (OSError, ValueError, SafetensorError) as exc:  # transformers' and diffusers' words for a bad folder
        raise CheckpointError(f"{spec.folder}: its prompt encoders or VAE did not load: {exc}") from None
    return family.pipeline(family, spec, transformer, prompt_encoder, vae, device, dtype, context, experts, swap)


def build_pipeline(plan: WorkerPlan, rank: int = 0, local_rank: int = 0) -> DiffusionPipeline:
    """Rank ``rank``'s pipeline: sets up its device's allocator and holds it to the memory cap, joins the group (when
    there is one), loads; running out of device memory while loading is ``OutOfMemory``'s one line."""
    device = torch.device("cuda", local_rank) if plan.device_type == "cuda" else torch.device("cpu")
    configure_allocator(device)
    hold_to_cap(device, plan.memory_cap)
    context = None
    if plan.parallel.world_size > 1 or plan.parallel.shard_weights:  # sharding over one GPU: a group of one
        init_process_group(device, rank, plan.parallel.world_size, plan.init_method)
        context = ParallelContext.build(plan.parallel, device)

    def load() -> DiffusionPipeline:
        return load_pipeline(
            plan.spec, device, plan.dtype, context, plan.options, plan.text_encoder_placement, plan.vae_tiled
        )

    return reporting_out_of_memory(load, lambda: "while loading the model", device, plan.budget)


def run_requests(
    pipeline: DiffusionPipeline, plan: WorkerPlan, requests: list[ResolvedRequest], progress: bool = False, on_step=None
) -> list[GenerationResult] | None:
    """``pipeline.generate``, running out of device memory reported as ``OutOfMemory``'s one line, naming the stage
    the pipeline was in (``DiffusionPipeline.stage``), and the memory given back for the next request."""

    def generate() -> list[GenerationResult] | None:
        return pipeline.generate(requests, progress=progress, on_step=on_step)

    return reporting_out_of_memory(generate, lambda: pipeline.stage, pipeline.device, plan.budget)
