"""One FLUX.2 transformer step on one GPU: paradit against diffusers' Flux2Transformer2DModel, same weights, same run.

Full-size architectures with random weights (dummy load). The diffusers model is built on the meta device and
handed paradit's tensors (identical parameter names), so both run on the very same weights with one copy in memory.
Prints ms/step, TFLOP/s and MFU against the bf16 matmul rate measured in the same run, and the relative L2 between
the two outputs.

    python benchmarks/flux2_step.py --out-dir $OUT
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import ModelPair, init_dummy_weights, step_benchmark_main  # noqa: E402
from paradit.families import PRESETS  # noqa: E402
from paradit.families.flux2.model import Flux2Config, Flux2Transformer  # noqa: E402

# Exact FLOPs of one forward at 1024x1024 (4096 image + 512 text tokens), counted with FlopCounterMode over the
# diffusers model on the meta device (shared/models/configs.json).
TFLOP_PER_STEP_1024 = {
    "flux2-dev": 282.599551401984,
    "flux2-klein-4b": 34.820178051072,
    "flux2-klein-9b": 75.5147210752,
}


def step_inputs(config: Flux2Config, height: int, width: int, text_len: int, device: torch.device):
    rows, cols = height // 16, width // 16
    gen = torch.Generator(device).manual_seed(0)
    one = torch.arange(1, device=device)
    inputs = dict(
        hidden_states=torch.randn(1, rows * cols, config.in_channels, device=device, generator=gen).bfloat16(),
        encoder_hidden_states=torch.randn(
            1, text_len, config.joint_attention_dim, device=device, generator=gen
        ).bfloat16(),
        timestep=torch.full((1,), 0.5, device=device),
        img_ids=torch.cartesian_prod(one, torch.arange(rows, device=device), torch.arange(cols, device=device), one),
        txt_ids=torch.cartesian_prod(one, one, one, torch.arange(text_len, device=device)),
    )
    if config.guidance_embeds:
        inputs["guidance"] = torch.full((1,), 4.0, device=device)
    return inputs


def shared_weight_models(name: str, device: torch.device):
    """paradit's transformer with random weights, and diffusers' built on the meta device and handed the very same
    tensors (identical parameter names): one copy of the weights in memory. Returns (config, ours, reference)."""
    from diffusers import Flux2Transformer2DModel

    config = Flux2Config.from_dict(PRESETS[name].transformer)
    with torch.device("meta"):
        ours = Flux2Transformer(config)
    init_dummy_weights(ours, device, torch.bfloat16)
    with torch.device("meta"):
        reference = Flux2Transformer2DModel(**PRESETS[name].transformer)
    reference.load_state_dict(ours.state_dict(), assign=True, strict=True)
    return config, ours.eval(), reference.eval()


def model_pair(name: str, args, device: torch.device) -> ModelPair:
    config, ours, reference = shared_weight_models(name, device)
    inputs = step_inputs(config, args.height, args.width, args.text_len, device)
    ref_inputs = {**inputs, "img_ids": inputs["img_ids"][None], "txt_ids": inputs["txt_ids"][None]}

    def step_ours(model, latents: torch.Tensor, sigma: float) -> torch.Tensor:
        return model(**{**inputs, "hidden_states": latents, "timestep": torch.full_like(inputs["timestep"], sigma)})

    workload = (args.height, args.width, args.text_len)
    return ModelPair(
        name,
        ours,
        reference,
        run_reference=lambda: reference(**ref_inputs, return_dict=False)[0],
        step_ours=step_ours,
        latents=inputs["hidden_states"],
        tokens=args.height * args.width // 256 + args.text_len,
        tflop=TFLOP_PER_STEP_1024.get(name) if workload == (1024, 1024, 512) else None,
    )


def main() -> None:
    step_benchmark_main(__doc__.splitlines()[0], model_pair, ["flux2-dev", "flux2-klein-4b"], 512, "flux2_step.json")


if __name__ == "__main__":
    main()
