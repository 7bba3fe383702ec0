"""The transformer a rank runs, built in one fixed order of steps on the plain model (the reasons at each step)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import nn

from paradit.checkpoint import safetensors_files
from paradit.compile import compile_blocks, model_blocks
from paradit.cuda_graphs import GraphedModule
from paradit.family import Family
from paradit.layers.attention import apply_fp8_attention
from paradit.layers.fp8 import fp8_dtype
from paradit.layers.sparse_attention import SparseSettings, apply_sparse_attention
from paradit.lora.apply import FusedLoraTensors, add_side_paths, fold_side_paths, read_updates
from paradit.lora.refs import adapter_key
from paradit.lora.variants import AdapterChoice
from paradit.options import ExecutionOptions
from paradit.parallel.mesh import ParallelContext
from paradit.parallel.parallelize import Parallelized, parallelize
from paradit.parallel.shard import shard_module, shard_root
from paradit.quantize import fp8_load
from paradit.request_hooks import RequestHook
from paradit.spec import CheckpointFolder, Fp8PresetFolder, ModelSpec
from paradit.weights import CheckpointTensors, DummyTensors, ModelNames, TensorSource, materialize


@dataclass(frozen=True)
class Runtime:
    """``forward`` is called in the model's place; ``adapters``: those every request runs with, in words."""

    parallel: Parallelized
    forward: nn.Module
    hooks: tuple[RequestHook, ...] = ()
    adapters: tuple[str, ...] = ()

    @property
    def model(self) -> nn.Module:
        return self.parallel.model


def load_transformer(
    family: Family,
    spec: ModelSpec,
    device: torch.device,
    dtype: torch.dtype,
    context: ParallelContext | None = None,
    options: ExecutionOptions | None = None,
    component: str = "transformer",
) -> Runtime:
    """This rank's transformer from ``spec``'s ``component``; FP8 support is not checked (the CPU may convert)."""
    options = options or ExecutionOptions()
    with torch.device("meta"):
        model = family.build_transformer(spec).eval()
    names = ModelNames(model)
    lora, refs = options.lora, options.lora.of(component)
    updates = read_updates(family.lora_loader, refs, model, component) if refs else {}  # the whole model's names
    shard = context if context is not None and context.config.shard_weights else None
    hooks: list[RequestHook] = []

    if options.attention == "fp8":  # before parallelism wraps each module's kernel
        hooks.append(apply_fp8_attention(model, options.attention_bf16_steps))
    # A video's self-attention wrapped whether or not the run asked, so that each request may ask for its own;
    # around the kernel FP8 attention chose, before parallelism wraps it. Dense requests call that kernel alone.
    settings = None
    if options.sparse_attention:
        blocks = len(model_blocks(model))
        settings = SparseSettings.of(options.sparse_attention, blocks, **options.sparse_parameters())
    if (sparse := apply_sparse_attention(model, settings)) is not None:
        hooks.append(sparse)
    parallel = parallelize(model, family.tensor_plan, context)  # on meta: only the kept tensors are ever read
    # While each linear is still the plain model's. A server's named adapters start unchosen; a run's all apply.
    if updates and not lora.fused:
        scales = {} if lora.switchable else {adapter_key(ref, index): 1.0 for index, ref in enumerate(refs)}
        add_side_paths(model, names, updates, parallel.slices, device, dtype, scales, lora.switchable)
    # An FP8 checkpoint's linears load as FP8 whatever ``quantize`` says; fused adapters are added as weights load.
    fp8 = fp8_load(model, names, spec.transformer, options.quantize, fp8_dtype(device), family.keep_high_precision)
    with component_tensors(family, spec, component, model, device, dtype) as source:
        source = FusedLoraTensors(source, updates) if updates and lora.fused else source
        if shard is not None:  # each block sharded as soon as it has loaded: no more than one is ever whole
            for block in model_blocks(model):
                materialize(block, names, source, parallel.slices, fp8)
                shard_module(block, shard)
        materialize(model, names, source, parallel.slices, fp8)
    if updates and not lora.fused and shard is None:  # a sharded weight is not this process's to widen
        fold_side_paths(model)
    if updates and lora.switchable:
        hooks.append(AdapterChoice(model, lora.cache))
    forward = parallel.forward if shard is None else shard_root(parallel.forward, model, shard)
    if options.compiles(device):
        compile_blocks(model)
    if options.cuda_graphs:  # last: a graph wraps whatever the steps before made the forward
        forward = GraphedModule(forward)
    applied = () if lora.switchable else tuple(f"{ref.source} at scale {ref.scale:g}" for ref in refs)
    return Runtime(parallel, forward, tuple(hooks), applied)


@contextlib.contextmanager
def component_tensors(
    family: Family, spec: ModelSpec, component: str, model: nn.Module, device: torch.device, dtype: torch.dtype
) -> Iterator[TensorSource]:
    """The tensors of ``spec``'s ``component``: its folder's, or random ones drawn for ``model``."""
    # A preset's FP8 folder holds its transformer alone; a checkpoint folder holds each component (None: random).
    fp8_preset = isinstance(spec.weights, Fp8PresetFolder) and component == "transformer"
    folder = spec.weights.transformer if fp8_preset else spec.folder and spec.folder / component
    if folder is not None:
        allow_pickle = isinstance(spec.weights, CheckpointFolder) and spec.weights.allow_pickle
        with CheckpointTensors(safetensors_files(folder, allow_pickle), device, dtype) as source:
            yield source
        return
    buffers = {name for name, _ in model.named_buffers()}
    # Each component its own random weights (two experts drawn alike would hide a swapped expert).
    yield DummyTensors(device, dtype, buffers, 0 if component == "transformer" else sum(component.encode()))
    if family.after_dummy_init is not None:
        family.after_dummy_init(model)
