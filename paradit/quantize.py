"""Swap a model's linear layers for FP8 ones, from outside the model (its file never knows).

Which layers stay in bf16 is a measured choice, not a guess: the embedders, the timestep/guidance MLPs, the
modulation projections and the output projection are a small share of the FLOPs but feed every block (modulation)
or the final prediction directly, so their error is not averaged away; the benchmark reports the resulting error.

Must not import torch.distributed.
"""

from __future__ import annotations

import torch
from torch import nn

from paradit.layers.fp8 import Fp8Linear, check_fp8_supported, fp8_dtype

# Name fragments of linear layers that stay in the model dtype (see module docstring), across the families:
# embedders (FLUX.2 x_/context_embedder, Qwen-Image img_in/txt_in, Z-Image all_x_embedder/cap_embedder), timestep and
# guidance MLPs, modulation projections (FLUX.2 *_modulation, Qwen-Image img_mod/txt_mod, Z-Image adaLN_modulation,
# SD3 norm1.linear: AdaLN layers live under "norm" names) and output layers (proj_out, Z-Image all_final_layer).
KEEP_HIGH_PRECISION = (
    "embed", "img_in", "txt_in", "time_", "guidance", "modulation", "_mod.", "adaLN", "norm", "proj_out", "final_layer",
)  # fmt: skip


def quantizable(name: str, module: nn.Module) -> bool:
    """Linear layers inside the repeated blocks, whose dimensions the FP8 GEMM accepts (multiples of 16)."""
    return (
        isinstance(module, nn.Linear)
        and not any(fragment in name for fragment in KEEP_HIGH_PRECISION)
        and module.in_features % 16 == 0
        and module.out_features % 16 == 0
    )


@torch.no_grad()
def quantize_fp8(model: nn.Module, device: torch.device) -> list[str]:
    """Replace the quantizable linears of ``model`` (already on ``device``) one at a time, so that at most one
    layer's bf16 weight exists beside the FP8 copies; returns the names replaced."""
    check_fp8_supported(device)
    dtype = fp8_dtype(device)
    replaced = []
    for name, module in list(model.named_modules()):
        if quantizable(name, module):
            owner_name, _, leaf = name.rpartition(".")
            owner = model.get_submodule(owner_name) if owner_name else model
            setattr(owner, leaf, Fp8Linear.from_linear(module, dtype))
            replaced.append(name)
    return replaced
