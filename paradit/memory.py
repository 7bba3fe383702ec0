"""Per-GPU memory: a cap each worker holds itself to, and the check that a plan fits under it before anything loads.

The estimate is built from the model itself, not a table: the transformer and the prompt encoders and VAE are
built on the meta device (no memory, milliseconds) and their parameters counted in the run dtype; activations are
estimated from the tokens each rank holds. Rank 0 carries the prompt encoders and the VAE, so it is the rank that
must fit.

Must not import torch.distributed.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch
from torch import nn

from paradit.errors import InvalidRequest
from paradit.parallel.config import ParallelConfig
from paradit.spec import ModelSpec

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "kib": 2**10, "mib": 2**20, "gib": 2**30}


def parse_size(text: str | int) -> int:
    """'32GiB', '30GB', '512MiB' or a byte count -> bytes."""
    if isinstance(text, int):
        return text
    match = re.fullmatch(r"\s*([0-9.]+)\s*([a-zA-Z]*)\s*", text)
    if not match or match.group(2).lower() not in _UNITS:
        raise InvalidRequest(f"memory size {text!r} is not understood; write e.g. 32GiB, 30GB or 512MiB")
    return int(float(match.group(1)) * _UNITS[match.group(2).lower()])


def _modules(holder) -> list[nn.Module]:
    """The nn.Modules a prompt encoder object holds, directly or in lists (families keep them differently)."""
    if isinstance(holder, nn.Module):
        return [holder]
    found = []
    for value in vars(holder).values():
        if isinstance(value, nn.Module):
            found.append(value)
        elif isinstance(value, list | tuple):
            found.extend(item for item in value if isinstance(item, nn.Module))
    return found


def _bytes(modules: list[nn.Module], dtype: torch.dtype) -> int:
    size = torch.finfo(dtype).bits // 8
    return sum(p.numel() for module in modules for p in module.parameters()) * size


@dataclass(frozen=True)
class MemoryPlan:
    """Bytes rank 0 needs: the transformer's share, the prompt encoders, the VAE, and working memory."""

    transformer: int
    text_encoders: int
    vae: int
    activations: int

    @property
    def total(self) -> int:
        return self.transformer + self.text_encoders + self.vae + self.activations

    def describe(self) -> str:
        gib = 2**30
        return (
            f"{self.total / gib:.1f} GiB on rank 0 (transformer weights {self.transformer / gib:.1f}, text encoders "
            f"{self.text_encoders / gib:.1f}, VAE {self.vae / gib:.1f}, activations ~{self.activations / gib:.1f})"
        )


def estimate(spec: ModelSpec, parallel: ParallelConfig, dtype: torch.dtype, fp8: bool) -> MemoryPlan:
    from paradit.pipelines import FAMILIES

    pipeline = FAMILIES[spec.family].pipeline
    with torch.device("meta"):
        transformer = pipeline.build_transformer(spec)
    # Tensor parallelism divides the repeated blocks; FP8 halves their linears (one byte a weight, scales aside).
    blocks = [m for m in transformer.modules() if isinstance(m, nn.ModuleList) and len(m) > 1]
    block_bytes = _bytes(blocks, dtype)
    if fp8:
        block_bytes //= 2
    transformer_bytes = (_bytes([transformer], dtype) - _bytes(blocks, dtype)) + block_bytes // parallel.tensor
    encoder, vae = pipeline.load_conditioners(spec, torch.device("meta"), dtype, dummy=True)
    config = spec.transformer
    width = config.get("dim") or spec.attention_heads * config["attention_head_dim"]
    tokens = spec.height * spec.width // 256 + 512
    batch = 2 if spec.guidance_mode == "cfg" and parallel.cfg == 1 else 1
    local_tokens = -(-tokens // parallel.sequence_degree)
    # A block's working set: ~24 activations of the model width per token (Q, K, V, attention output, the MLP's
    # widened hidden state, residuals), the last layer's output kept; the VAE decoder at full resolution works on
    # ~16 feature maps of 128 channels.
    element = torch.finfo(dtype).bits // 8
    block_activations = 24 * batch * local_tokens * width * element // parallel.tensor
    vae_activations = 16 * spec.height * spec.width * 128 * element
    return MemoryPlan(transformer_bytes, _bytes(_modules(encoder), dtype), _bytes([vae], dtype),
                      max(block_activations, vae_activations))  # fmt: skip


def check_fits(spec: ModelSpec, parallel: ParallelConfig, dtype: torch.dtype, fp8: bool, cap: int) -> MemoryPlan:
    """The plan's estimate, or an InvalidRequest with the numbers when rank 0 would not fit under ``cap``."""
    plan = estimate(spec, parallel, dtype, fp8)
    if plan.total > cap:
        raise InvalidRequest(
            f"{spec.name} with {parallel.describe()} does not fit under --max-gpu-memory {cap / 2**30:.1f} GiB: it "
            f"needs {plan.describe()}; give more GPUs to the plan (--tensor shards the weights), use --quantize fp8, "
            "or raise the cap"
        )
    return plan


def hold_to_cap(device: torch.device, cap: int) -> None:
    """Make the CUDA caching allocator refuse to grow past ``cap`` on this device (CPU processes rely on the
    up-front check alone)."""
    if device.type == "cuda":
        total = torch.cuda.get_device_properties(device).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, cap / total), device)
