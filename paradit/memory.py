"""Per-GPU memory: a cap each worker holds itself to, and the check that a plan fits under it before anything loads.

The estimate is built from the model itself, not a table: the transformer and the prompt encoders and VAE are
built on the meta device (no memory, milliseconds) and their parameters counted in the run dtype; activations are
estimated from the tokens each rank holds. Rank 0 carries the prompt encoders and the VAE, so it is the rank that
must fit; the plan also places the prompt encoders (``check_fits``).

Must not import torch.distributed.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass

import torch
from torch import nn

from paradit.compile import model_blocks
from paradit.errors import InvalidRequest
from paradit.families import FAMILIES
from paradit.parallel.config import ParallelConfig
from paradit.parallel.pipefusion import stage_range
from paradit.pipelines.base import load_vae
from paradit.spec import ModelSpec
from paradit.text_encoder import PLACEMENTS, converts_to_fp8, load_prompt_encoder

TEXT_ENCODER_PLACEMENTS = ("auto", *PLACEMENTS)
_PLACEMENT_NOTES = {"gpu": "resident", "fp8": "resident in FP8", "offload": "streamed from CPU memory"}
_UNITS = {"b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "kib": 2**10, "mib": 2**20, "gib": 2**30}


def gib(size: int) -> str:
    """Bytes as GiB: one decimal, or three significant digits below 1 GiB, so that tiny models' megabytes show."""
    return f"{size / 2**30:.1f}" if size >= 2**30 else f"{size / 2**30:.3g}"


def parse_size(text: str | int) -> int:
    """'32GiB', '30GB', '512MiB' (text needs its unit: a bare 32 could be bytes or GiB) or a byte count (int)."""
    if isinstance(text, int):
        return text
    match = re.fullmatch(r"\s*([0-9.]+)\s*([a-zA-Z]*)\s*", text)
    if match and not match.group(2):
        raise InvalidRequest(f"memory size {text!r} has no unit; write it with one, e.g. {match.group(1)}GiB")
    if not match or match.group(2).lower() not in _UNITS:
        raise InvalidRequest(f"memory size {text!r} is not understood; write e.g. 32GiB, 30GB or 512MiB")
    return int(float(match.group(1)) * _UNITS[match.group(2).lower()])


def check_placement(placement: str, fp8: bool) -> None:
    """Refuse an unknown placement, or FP8 prompt encoders in a run that does not execute in FP8."""
    if placement not in TEXT_ENCODER_PLACEMENTS:
        raise InvalidRequest(
            f"text encoder placement {placement!r} is not allowed; choose one of {', '.join(TEXT_ENCODER_PLACEMENTS)}"
        )
    if placement == "fp8" and not fp8:
        raise InvalidRequest("text encoder placement fp8 needs FP8 execution (--quantize fp8); choose gpu or offload")


def _bytes(modules: list[nn.Module], dtype: torch.dtype) -> int:
    return sum(p.numel() for module in modules for p in module.parameters()) * dtype.itemsize


def _fp8_bytes(encoders: list[nn.Module], dtype: torch.dtype) -> int:
    """Resident encoders with their linears in FP8 (``converts_to_fp8``): a byte a weight, a float32 scale a row."""
    saved = sum(
        m.weight.numel() * (dtype.itemsize - 1) - m.out_features * 4
        for encoder in encoders
        for name, m in encoder.named_modules()
        if converts_to_fp8(encoder, name, m)
    )
    return _bytes(encoders, dtype) - saved


def _streamed_bytes(encoders: list[nn.Module], dtype: torch.dtype) -> int:
    """What offloaded encoders keep on the GPU: the most weights one offload hook brings over at a time (one
    submodule's own parameters), and the buffers, which stay there."""
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
    vae_tiled: bool = False  # the decode runs tile by tile (diffusers' tiling: bounded memory, blended seams)

    @property
    def total(self) -> int:
        return self.transformer + self.text_encoders + self.vae + self.activations

    def describe(self) -> str:
        return (
            f"{gib(self.total)} GiB on rank 0 (transformer weights {gib(self.transformer)}, text encoders "
            f"{gib(self.text_encoders)} {_PLACEMENT_NOTES[self.text_encoder_placement]}, VAE {gib(self.vae)}, "
            f"activations ~{gib(self.activations)}{', VAE decoded in tiles' if self.vae_tiled else ''})"
        )


def estimates(spec: ModelSpec, parallel: ParallelConfig, dtype: torch.dtype, fp8: bool,
              swap_experts: bool = False, vae_tiled: bool = False) -> dict[str, MemoryPlan]:  # fmt: skip
    """Rank 0's plan for each prompt encoder placement; ``swap_experts``: a model's experts take turns on the device
    (the largest counts), else all are resident; ``vae_tiled``: the decode works on one tile at a time."""
    family = FAMILIES[spec.family]
    configs = [spec.transformer, *spec.experts.values()]  # the further ones: a low-noise expert
    with torch.device("meta"):
        models = [family.build_transformer(dataclasses.replace(spec, transformer=c)) for c in configs]
    transformer = models[0]

    def rank0_blocks(model: nn.Module) -> list[nn.Module]:
        """PipeFusion keeps only the first stage's blocks on rank 0 (without it, the one stage is every block)."""
        blocks = model_blocks(model)
        return [blocks[i] for i in stage_range(len(blocks), parallel.pipefusion, 0)]

    # Tensor parallelism divides the kept blocks; FP8 halves their linears (one byte a weight, scales aside).
    per_model = [
        _bytes([model], dtype) - _bytes(model_blocks(model), dtype)
        + _bytes(rank0_blocks(model), dtype) // (2 if fp8 else 1) // parallel.tensor
        for model in models
    ]  # fmt: skip
    transformer_bytes = max(per_model) if swap_experts else sum(per_model)
    encoder = load_prompt_encoder(family, spec, torch.device("meta"), dtype, True)
    vae = load_vae(family, spec, torch.device("meta"), dtype, dummy=True)
    # The token width, from the attention projections (every family's blocks attend at the model width); a family
    # without a tensor plan states it in its config.
    plan = family.tensor_plan
    width = plan.widths(transformer)["attention"] if plan else transformer.config.inner_dim
    batch = 2 if spec.guidance_mode == "cfg" and parallel.cfg == 1 else 1
    local_tokens = -(-family.sequence_tokens(spec) // parallel.sequence_degree)
    # A block's working set: ~24 activations of the model width per token (Q, K, V, attention output, the MLP's
    # widened hidden state, residuals), the last layer's output kept; the VAE decoder at full resolution works on
    # ~16 feature maps of 128 channels, split across the group's ranks.
    element = dtype.itemsize
    block_activations = 24 * batch * local_tokens * width * element // parallel.tensor
    # A video decoder keeps a few frames' maps live at a time (its causal cache across the chunks): measured at ~2.7x
    # an image's on Wan's VAE (docs/benchmarks.md); four frames' worth is counted.
    frames = 4 if family.video else 1
    vae_activations = frames * 16 * spec.height * spec.width * 128 * element // parallel.world_size  # a band per rank
    if vae_tiled:  # every rank decodes the whole latent, one tile at a time (its side as diffusers' VAE sets it)
        tile = getattr(vae, "tile_sample_min_size", None) or vae.tile_sample_min_height
        vae_activations = frames * 16 * min(spec.height, tile) * min(spec.width, tile) * 128 * element
    activations = max(block_activations, vae_activations)
    if parallel.pipefusion > 1:  # each kept block holds K and V for every token (its heads' share), stale or fresh
        activations += len(rank0_blocks(transformer)) * 2 * batch * local_tokens * width * element // parallel.tensor
    encoders, vae_bytes = encoder.modules(), _bytes([vae], dtype)
    placed = {"gpu": _bytes, "fp8": _fp8_bytes, "offload": _streamed_bytes}  # the encoders' bytes on the GPU
    return {
        placement: MemoryPlan(transformer_bytes, on_gpu(encoders, dtype), vae_bytes, activations, placement, vae_tiled)
        for placement, on_gpu in placed.items()
    }


def estimate(
    spec: ModelSpec, parallel: ParallelConfig, dtype: torch.dtype, fp8: bool, placement: str = "gpu",
    swap_experts: bool = False,
) -> MemoryPlan:  # fmt: skip
    return estimates(spec, parallel, dtype, fp8, swap_experts)[placement]


def check_fits(
    spec: ModelSpec, parallel: ParallelConfig, dtype: torch.dtype, fp8: bool, cap: int, placement: str = "auto",
    swap_experts: bool = False,
) -> MemoryPlan:  # fmt: skip
    """The first plan that fits rank 0 under ``cap``, with the prompt encoders placed as asked or, for ``auto``,
    resident if that fits, else (in an FP8 run) resident in FP8, else offloaded; and only when none of those fits, the
    same with the VAE decoding tile by tile; an InvalidRequest with the numbers when none fits."""
    check_placement(placement, fp8)
    candidates = [p for p in PLACEMENTS if p != "fp8" or fp8] if placement == "auto" else [placement]
    tried = []
    for vae_tiled in (False, True):
        plans = estimates(spec, parallel, dtype, fp8, swap_experts, vae_tiled)
        for plan in [plans[p] for p in candidates]:
            if plan.total <= cap:
                return plan
            tried.append(plan)
    needs = ", or ".join(plan.describe() for plan in tried)
    raise InvalidRequest(
        f"{spec.name} with {parallel.describe()} does not fit under --max-gpu-memory {gib(cap)} GiB: it "
        f"needs {needs}; give more GPUs to the plan (--tensor shards the weights), use --quantize fp8, or raise the cap"
    )


def hold_to_cap(device: torch.device, cap: int) -> None:
    """Make the CUDA caching allocator refuse to grow past ``cap`` on this device (CPU processes rely on the
    up-front check alone)."""
    if device.type == "cuda":
        index = torch.cuda.current_device() if device.index is None else device.index  # "cuda" names no index
        total = torch.cuda.get_device_properties(index).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, cap / total), index)
