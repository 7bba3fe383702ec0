"""Execution options applied to a transformer from outside: FP8 linears (converted as read by ``load_transformer``:
the high-precision model never exists whole), regional compilation, CUDA graphs. Must not import torch.distributed."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from paradit.errors import InvalidRequest
from paradit.layers.attention import ATTENTIONS
from paradit.layers.fp8 import check_fp8_supported
from paradit.lora import MODES, LoraSet

QUANTIZATIONS = ("none", "fp8")


@dataclass(frozen=True)
class ExecutionOptions:
    """``quantize``: "none" or "fp8"; ``compile``: regional torch.compile of the repeated blocks (None: on GPUs);
    ``cuda_graphs``: replay each step's kernels from a CUDA graph (CUDA/ROCm only); ``swap_experts``: a model with
    several experts keeps one on the device and the others in pinned host memory, swapped at the boundary;
    ``lora``: the adapters applied to the transformers as they load; ``attention``: "sdpa" or "fp8" (self-attention
    through the FP8 kernel), ``attention_bf16_steps`` the steps at each end of a request that FP8 attention leaves
    exact."""

    quantize: str = "none"
    compile: bool | None = None
    cuda_graphs: bool = False
    swap_experts: bool = False
    lora: LoraSet = field(default_factory=LoraSet)
    attention: str = "sdpa"
    attention_bf16_steps: int = 0

    def validate(self, device: torch.device) -> None:
        if self.quantize not in QUANTIZATIONS:
            raise InvalidRequest(f"unknown quantization {self.quantize!r}; choose one of {', '.join(QUANTIZATIONS)}")
        if self.quantize == "fp8":
            check_fp8_supported(device)
        if self.cuda_graphs and device.type != "cuda":
            raise InvalidRequest(f"CUDA graphs need a GPU, not {device.type}; run without --cuda-graphs")
        if self.lora.mode not in MODES:
            raise InvalidRequest(f"unknown LoRA mode {self.lora.mode!r}; choose one of {', '.join(MODES)}")
        if self.cuda_graphs and self.swap_experts:  # a graph replays the addresses it captured; a swap moves them
            raise InvalidRequest("CUDA graphs do not combine with swapped experts; drop one of the two options")
        if self.attention not in ATTENTIONS:
            raise InvalidRequest(
                f"unknown attention {self.attention!r}; choose one of {', '.join(ATTENTIONS)}", param="attention"
            )
        if self.attention_bf16_steps < 0 or (self.attention_bf16_steps and self.attention != "fp8"):
            raise InvalidRequest(
                f"--attention-bf16-steps {self.attention_bf16_steps}: give 0 or more steps, with --attention fp8",
                param="attention_bf16_steps",
            )
        if self.attention == "fp8":
            from paradit.layers.fp8_attention import check_fp8_attention  # imports Triton: only runs that use it

            check_fp8_attention(device)
            if self.cuda_graphs:  # a replay would keep the kernels, and each step's choice, of its capture
                raise InvalidRequest(
                    "FP8 attention does not combine with CUDA graphs yet; drop --cuda-graphs or give --attention sdpa",
                    param="attention",
                )
        if self.lora.cache < 0:
            raise InvalidRequest(f"--lora-cache {self.lora.cache}: give 0 (side paths) or more fused choices")
        if self.cuda_graphs and self.lora.switchable and not self.lora.cache:
            # A graph replays the side paths it captured; fused choices copy into the captured weights instead.
            raise InvalidRequest(
                "CUDA graphs replay one choice of adapters; give --lora-cache 1 or more (choices "
                "fused into the weights), or drop --cuda-graphs"
            )
        if self.swap_experts and self.lora.cache:  # fused choices would pin each expert's copies on the device
            raise InvalidRequest(
                "--lora-cache does not combine with swapped experts; give --lora-cache 0 (side "
                "paths) or drop --swap-experts"
            )

    def compiles(self, device: torch.device) -> bool:
        return device.type == "cuda" if self.compile is None else self.compile
