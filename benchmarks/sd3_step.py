"""One SD3.5 transformer step on one GPU: paradit against diffusers' SD3Transformer2DModel, same weights, same run.

Full-size architectures with random weights (dummy load). The diffusers model is built on the meta device and
handed paradit's tensors (identical parameter and buffer names), so both run on the very same weights with one copy in
memory. Prints ms/step, TFLOP/s and MFU against the bf16 matmul rate measured in the same run, and the relative L2
between the two outputs. One step is one CFG branch (batch 1), as the FLOP counts in shared/models/configs.json are.

    python benchmarks/sd3_step.py --out-dir $OUT
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import ModelPair, init_dummy_weights, step_benchmark_main  # noqa: E402
from paradit.families import PRESETS  # noqa: E402
from paradit.families.sd3.model import SD3Config, SD3Transformer, unpatchify  # noqa: E402

# Exact FLOPs of one forward at 1024x1024 (4096 image + 77 CLIP + 256 T5 = 333 text tokens), counted with
# FlopCounterMode over the diffusers model on the meta device (shared/models/configs.json).
TFLOP_PER_STEP_1024 = {
    "sd3.5-large": 31.121114907648,
    "sd3.5-medium": 11.249573707776,
}
VAE_STRIDE = 8


def step_inputs(config: SD3Config, height: int, width: int, text_len: int, device: torch.device) -> dict:
    gen = torch.Generator(device).manual_seed(0)
    latent_shape = (1, config.in_channels, height // VAE_STRIDE, width // VAE_STRIDE)
    return dict(
        hidden_states=torch.randn(latent_shape, device=device, generator=gen).bfloat16(),
        encoder_hidden_states=torch.randn(
            1, text_len, config.joint_attention_dim, device=device, generator=gen
        ).bfloat16(),
        pooled_projections=torch.randn(1, config.pooled_projection_dim, device=device, generator=gen).bfloat16(),
        timestep=torch.full((1,), 500.0, device=device),
    )


def model_pair(name: str, args, device: torch.device) -> ModelPair:
    from diffusers import SD3Transformer2DModel

    config = SD3Config.from_dict(PRESETS[name].transformer)
    with torch.device("meta"):
        ours = SD3Transformer(config)
    init_dummy_weights(ours, device, torch.bfloat16)
    ours.pos_embed.fill_position_table()
    ours.eval()
    with torch.device("meta"):
        reference = SD3Transformer2DModel(**PRESETS[name].transformer)
    reference.load_state_dict(ours.state_dict(), assign=True, strict=True)
    reference.eval()

    inputs = step_inputs(config, args.height, args.width, args.text_len, device)
    latent_size = inputs["hidden_states"].shape[-2:]

    def step_ours(model, latents: torch.Tensor, sigma: float) -> torch.Tensor:
        # The prediction in the latent layout, as the pipeline uses it: unpatchify is part of the step.
        timestep = torch.full_like(inputs["timestep"], sigma * 1000)
        out = model(**{**inputs, "hidden_states": latents, "timestep": timestep})
        return unpatchify(out, config.patch_size, *latent_size)

    workload = (args.height, args.width, args.text_len)
    return ModelPair(
        name,
        ours,
        reference,
        run_reference=lambda: reference(**inputs, return_dict=False)[0],
        step_ours=step_ours,
        latents=inputs["hidden_states"],
        tokens=args.height * args.width // (VAE_STRIDE * config.patch_size) ** 2 + args.text_len,
        tflop=TFLOP_PER_STEP_1024.get(name) if workload == (1024, 1024, 333) else None,
    )


def main() -> None:
    step_benchmark_main(__doc__.splitlines()[0], model_pair, list(TFLOP_PER_STEP_1024), 333, "sd3_step.json")


if __name__ == "__main__":
    main()
