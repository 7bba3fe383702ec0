"""What a plan holds on rank 0 (weights counted on the meta device, working memory as measured), and that it fits."""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from paradit.compile import model_blocks
from paradit.errors import InvalidRequest
from paradit.families import FAMILIES, measured_preset
from paradit.family import TEXT_TOKENS
from paradit.layers.prefix_attention import PrefixCaching
from paradit.layers.semantic_permutation import KMEANS_ELEMENTS, SVG2_KEY_CLUSTERS, SVG2_QUERY_CLUSTERS
from paradit.options import PLACEMENTS
from paradit.parallel.config import ParallelConfig
from paradit.quantize import converts_to_fp8, quantizable
from paradit.spec import ModelSpec

VIDEO_FRAMES_MEASURED = 81
# Over measured working memory: the allocator's extra (0.3 to 2.5 GiB on one H100) and sizes' variation (issue 48).
WORKING_MARGIN = 1.2
# Held past the counted weights and working sets (untied encoder copies, kernel workspaces): up to 0.58 GiB (SD3.5).
RUNTIME_BYTES = 3 * 2**28
_PLACEMENT_NOTES = {"gpu": "resident", "fp8": "resident in FP8", "offload": "streamed from CPU memory"}
_UNITS = {
    "b": 1,
    **{prefix + "b": 1000 ** (power + 1) for power, prefix in enumerate("kmgt")},
    **{prefix + "ib": 1024 ** (power + 1) for power, prefix in enumerate("kmgt")},
}


def gib(size: int) -> str:
    """One decimal, or three significant digits below 1 GiB, so that tiny models' megabytes show."""
    return f"{size / 2**30:.1f}" if size >= 2**30 else f"{size / 2**30:.3g}"


def parse_size(text: str | int) -> int:
    """'32GiB', '30GB', '512MiB' (a bare 32 could be bytes or GiB: refused) or a byte count (int)."""
    if isinstance(text, int):
        return text
    match = re.fullmatch(r"\s*([0-9.]+)\s*([a-zA-Z]*)\s*", text)
    if match and not match.group(2):
        raise InvalidRequest(f"memory size {text!r} has no unit; write it with one, e.g. {match.group(1)}GiB")
    if not match or match.group(2).lower() not in _UNITS:
        raise InvalidRequest(
            f"memory size {text!r} is not understood; write a number and a unit: B, KB, MB, GB, TB (powers of 1000) "
            "or KiB, MiB, GiB, TiB (powers of 1024), e.g. 32GiB"
        )
    return int(float(match.group(1)) * _UNITS[match.group(2).lower()])


def check_placement(placement: str, fp8: bool) -> None:
    if placement == "fp8" and not fp8:
        raise InvalidRequest("text encoder placement fp8 needs FP8 execution (--quantize fp8); choose gpu or offload")


def _bytes(modules: list[nn.Module], dtype: torch.dtype) -> int:
    return sum(p.numel() for module in modules for p in module.parameters()) * dtype.itemsize


def _fp8_saved(linear: nn.Linear, dtype: torch.dtype) -> int:
    """What a linear saves in FP8: a byte a weight, but a float32 scale a row."""
    return linear.weight.numel() * (dtype.itemsize - 1) - linear.out_features * 4


def _fp8_bytes(encoders: list[nn.Module], dtype: torch.dtype) -> int:
    converted = [m for encoder in encoders for name, m in encoder.named_modules() if converts_to_fp8(encoder, name, m)]
    return _bytes(encoders, dtype) - sum(_fp8_saved(linear, dtype) for linear in converted)


def _streamed_bytes(encoders: list[nn.Module], dtype: torch.dtype) -> int:
    """What offloaded encoders keep on the GPU: the buffers, and the largest module's own parameters (one hook's)."""
    largest = max(sum(p.numel() for p in m.parameters(recurse=False)) for e in encoders for m in e.modules())
    buffers = sum(b.numel() * b.element_size() for encoder in encoders for b in encoder.buffers())
    return largest * dtype.itemsize + buffers


@dataclass(frozen=True)
class MemoryPlan:
    """Bytes rank 0 needs: the transformer's share, the prompt encoders (as placed), the VAE, and working memory."""

    transformer: int
    text_encoders: int
    vae: int
    activations: int
    text_encoder_placement: str = "gpu"
    vae_tiled: bool = False  # the decode runs tile by tile

    @property
    def total(self) -> int:
        """Streamed encoders come and go before the denoise; resident ones stay."""
        streamed = self.text_encoder_placement == "offload"
        working = max(self.activations, self.text_encoders) if streamed else self.activations + self.text_encoders
        return self.transformer + self.vae + working + RUNTIME_BYTES

    def describe(self) -> str:
        return (
            f"{gib(self.total)} GiB on rank 0 (transformer weights {gib(self.transformer)}, text encoders "
            f"{gib(self.text_encoders)} {_PLACEMENT_NOTES[self.text_encoder_placement]}, VAE {gib(self.vae)}, "
            f"activations ~{gib(self.activations)}{', VAE decoded in tiles' if self.vae_tiled else ''}, runtime "
            f"{gib(RUNTIME_BYTES)})"
        )


def working_units(spec: ModelSpec, table: str, compiled: bool, fp8: bool) -> float:
    """The measured ``table`` coefficient of ``spec``'s preset; a missing one takes the largest there is (errs high)."""
    tables = {name: getattr(family.measured, table) for name, family in FAMILIES.items()}
    measured = tables[spec.family]
    preset = measured_preset(spec, measured)
    entries = [measured[preset]] if preset else list(measured.values())
    entries = entries or [entry for other in tables.values() for entry in other.values()]
    if table == "vae_decode":
        return max(entries)
    mode, precision = "compiled" if compiled else "eager", "fp8" if fp8 else "bf16"
    return max(e.get(mode, {}).get(precision) or max(x for m in e.values() for x in m.values()) for e in entries)


def _transformer_bytes(
    model: nn.Module, kept: list[nn.Module], dtype: torch.dtype, fp8: bool, keep: tuple[str, ...], tensor: int
) -> tuple[int, list[int]]:
    """Rank 0's share of a transformer: the bytes outside the blocks, and of each ``kept`` block."""
    names = {id(module): name for name, module in model.named_modules()}
    outside, blocks = 0, [0] * len(kept)
    prefixes = tuple(names[id(block)] + "." for block in model_blocks(model))
    kept_names = [names[id(block)] + "." for block in kept]
    for name, module in model.named_modules():
        size = sum(p.numel() for p in module.parameters(recurse=False)) * dtype.itemsize
        if fp8 and quantizable(name, module, keep):
            size -= _fp8_saved(module, dtype)
        if not name.startswith(prefixes):
            outside += size
        elif (index := next((i for i, prefix in enumerate(kept_names) if name.startswith(prefix)), None)) is not None:
            blocks[index] += size // tensor
    return outside, blocks


def _resident_bytes(shares: list[tuple[int, list[int]]], swap_experts: bool, shard: int) -> int:
    """All the ``shares``, or swapped the largest; sharded, 1/N of each and the active one's gathered blocks on top."""
    totals = [outside + sum(blocks) for outside, blocks in shares]
    if not shard:
        return max(totals) if swap_experts else sum(totals)
    gathered = max(outside + 2 * max(blocks, default=0) for outside, blocks in shares)
    return sum(-(-total // shard) for total in totals) + gathered


# Architectures whose meta-device models are kept (every preset's together: about 100 MiB of module objects).
BUILT_KEPT = 32
_BUILT: dict[str, MetaModels] = {}


@dataclass(frozen=True)
class MetaModels:
    transformers: list[nn.Module]
    encoder: Any
    vae: nn.Module

    @classmethod
    def build(cls, spec: ModelSpec, dtype: torch.dtype) -> MetaModels:
        """Built once per architecture and dtype: ``settle`` and the planner estimate the same model many times."""
        key = repr((spec.family, spec.transformer, spec.experts, spec.text_encoder, spec.vae, spec.details, dtype))
        if key not in _BUILT:
            # The encoders and the VAE are diffusers' and transformers' classes, imported for a GPU run's estimate.
            from paradit.pipelines.base import load_vae
            from paradit.text_encoder import load_prompt_encoder

            if len(_BUILT) >= BUILT_KEPT:
                del _BUILT[next(iter(_BUILT))]
            family = FAMILIES[spec.family]
            with torch.device("meta"):
                configs = [spec.transformer, *spec.experts.values()]
                models = [family.build_transformer(dataclasses.replace(spec, transformer=c)) for c in configs]
            encoder = load_prompt_encoder(family, spec, torch.device("meta"), dtype, True)
            _BUILT[key] = cls(models, encoder, load_vae(family, spec, torch.device("meta"), dtype, dummy=True))
        return _BUILT[key]


def estimates(
    spec: ModelSpec,
    parallel: ParallelConfig,
    dtype: torch.dtype,
    fp8: bool,
    swap_experts: bool = False,
    vae_tiled: bool = False,
    compiled: bool = False,
    built: MetaModels | None = None,
    adapter_bytes: int = 0,
    extra_tokens: int = 0,
    fp8_attention: bool = False,
    sparse_attention: str | None = None,
) -> dict[str, MemoryPlan]:
    """Rank 0's plan for each prompt encoder placement; ``extra_tokens``: what a request's inputs add to a sample."""
    from paradit.parallel.pipefusion import stage_range  # the parallel runtime, imported for a GPU run's estimate

    family = FAMILIES[spec.family]
    built = built or MetaModels.build(spec, dtype)
    models, encoder, vae = built.transformers, built.encoder, built.vae
    transformer = models[0]

    def rank0_blocks(model: nn.Module) -> list[nn.Module]:
        """PipeFusion's first stage (without it, every block)."""
        blocks = model_blocks(model)
        return [blocks[i] for i in stage_range(len(blocks), parallel.pipefusion, 0)]

    shares = [
        _transformer_bytes(model, rank0_blocks(model), dtype, fp8, family.keep_high_precision, parallel.tensor)
        for model in models
    ]
    transformer_bytes = _resident_bytes(shares, swap_experts, parallel.shard_weights) + adapter_bytes
    # Every family's blocks attend at the model width; a family without a tensor plan states it in its config.
    plan = family.tensor_plan
    width = plan.widths(transformer)["attention"] if plan else transformer.config.inner_dim
    batch = 2 if spec.guidance_mode == "cfg" and parallel.cfg == 1 else 1
    local_tokens = -(-(family.sequence_tokens(spec) + extra_tokens) // parallel.sequence_degree)
    element = dtype.itemsize
    units = working_units(spec, "activations", compiled, fp8)
    block_activations = units * batch * local_tokens * width * element / parallel.tensor
    # A video decode's working set grows with its frames past the 81 it was measured at, not below (its causal cache).
    frames = max(1.0, (spec.frames or 1) / VIDEO_FRAMES_MEASURED) if family.video else 1.0
    height, width_px = spec.height, spec.width
    if vae_tiled:  # every rank decodes the whole latent, one tile at a time (its side as diffusers' VAE sets it)
        tile = getattr(vae, "tile_sample_min_size", None) or vae.tile_sample_min_height
        height, width_px = min(height, tile), min(width_px, tile)
    vae_activations = working_units(spec, "vae_decode", compiled, fp8) * frames * height * width_px * element
    if not vae_tiled:
        vae_activations /= parallel.world_size  # a band per rank
    if fp8_attention:  # K and V in 8 bits beside their bf16 originals while the kernel runs
        block_activations += 2 * batch * local_tokens * width / parallel.tensor
    if sparse_attention == "svg2":  # Q, K, V permuted and the output unpermuted, and one group's k-means distances
        block_activations += 4 * batch * local_tokens * width * element / parallel.tensor + 4 * KMEANS_ELEMENTS
        # Every block's centroids, kept from step to step (float32, each head's, this rank's heads).
        clusters = SVG2_QUERY_CLUSTERS + SVG2_KEY_CLUSTERS
        transformer_bytes += 4 * batch * clusters * width / parallel.sequence_degree * len(model_blocks(transformer))
    # A cached prefix (Qwen-Image 2.1's prompt and condition images) keeps each layer's keys and values through the
    # whole denoise, one per guidance branch, beside the step's working set: with 3 references of 1024², 6.7 GiB a
    # branch, which a per-token working coefficient measured without references does not hold. Each rank keeps its
    # heads' and tokens' share.
    caching_layers = sum(isinstance(m, PrefixCaching) for block in rank0_blocks(transformer) for m in block.modules())
    prefix_tokens = TEXT_TOKENS + extra_tokens
    block_activations += (
        caching_layers * 2 * batch * prefix_tokens * width * element / parallel.tensor / parallel.sequence_degree
    )
    activations = max(block_activations, vae_activations)
    if parallel.pipefusion > 1:  # each kept block holds K and V for every token (its heads' share), stale or fresh
        activations += len(rank0_blocks(transformer)) * 2 * batch * local_tokens * width * element / parallel.tensor
    activations = int(activations * WORKING_MARGIN)
    encoders, vae_bytes = encoder.modules(), _bytes([vae], dtype)
    placed = {"gpu": _bytes, "fp8": _fp8_bytes, "offload": _streamed_bytes}  # the encoders' bytes on the GPU
    return {
        placement: MemoryPlan(transformer_bytes, on_gpu(encoders, dtype), vae_bytes, activations, placement, vae_tiled)
        for placement, on_gpu in placed.items()
    }


def check_fits(
    spec: ModelSpec,
    parallel: ParallelConfig,
    dtype: torch.dtype,
    fp8: bool,
    cap: int,
    placement: str = "auto",
    swap_experts: bool = False,
    limit: str | None = None,
    **sizing: Any,
) -> MemoryPlan:
    """The first plan under ``cap`` (``limit``: in words): encoders as asked or resident, FP8, offloaded; then tiled."""
    check_placement(placement, fp8)
    candidates = [p for p in PLACEMENTS if p != "fp8" or fp8] if placement == "auto" else [placement]
    tried = []
    for vae_tiled in (False, True):
        plans = estimates(spec, parallel, dtype, fp8, swap_experts, vae_tiled, **sizing)
        for plan in [plans[p] for p in candidates]:
            if plan.total <= cap:
                return plan
            tried.append(plan)
    smallest = min(tried, key=lambda plan: plan.total)
    advice = lowering_options(spec, parallel, fp8, smallest.text_encoder_placement, swap_experts)
    advice.append("or raise the cap" if limit is None else "or free memory on it")
    raise InvalidRequest(
        f"{spec.name} with {parallel.describe()} does not fit under {limit or cap_words(cap)}: "
        f"its smallest plan needs {smallest.describe()}; {', '.join(advice)}"
    )


def cap_words(cap: int) -> str:
    return f"--max-gpu-memory {gib(cap)} GiB"


def lowering_options(
    spec: ModelSpec, parallel: ParallelConfig, fp8: bool, placement: str, swap_experts: bool
) -> list[str]:
    advice = ["give more GPUs to the plan (--shard-weights or --tensor shards the weights)"]
    advice += [] if fp8 else ["use --quantize fp8"]
    advice += [] if placement == "offload" else ["--text-encoder-placement offload"]
    advice += [] if swap_experts or not spec.experts or parallel.shard_weights else ["--swap-experts"]
    return advice
