"""One Z-Image transformer step on one GPU: paradit against diffusers' ZImageTransformer2DModel, same weights, same run.

Full-size architectures with random weights (dummy load). The diffusers model is built on the meta device and
handed paradit's tensors (identical parameter names), so both run on the very same weights with one copy in memory.
Prints ms/step, TFLOP/s and MFU against the bf16 matmul rate measured in the same run, and the relative L2 between
the two outputs.

    python benchmarks/zimage_step.py --out-dir $OUT
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import ModelPair, init_dummy_weights, step_benchmark_main  # noqa: E402
from paradit.families import PRESETS  # noqa: E402
from paradit.families.zimage.model import ZImageConfig, ZImageTransformer, unpatchify  # noqa: E402

# Exact FLOPs of one forward at 1024x1024 (4096 image + 256 text tokens), counted with FlopCounterMode over the
# diffusers model on the meta device (shared/models/configs.json, "Z-Image-Turbo"); the base model has the same
# transformer.
REFERENCE_WORKLOAD = (1024, 1024, 256)
TFLOP_PER_STEP_1024 = {"z-image-turbo": 58.539107024896, "z-image": 58.539107024896}


def step_inputs(config: ZImageConfig, height: int, width: int, text_len: int, device: torch.device):
    """Latents (1, C, H/8, W/8), the timestep and one caption of ``text_len`` tokens, in bf16 as the pipeline runs."""
    gen = torch.Generator(device).manual_seed(0)
    latents = torch.randn(1, config.in_channels, height // 8, width // 8, device=device, generator=gen)
    captions = torch.randn(1, text_len, config.cap_feat_dim, device=device, generator=gen)
    return latents.bfloat16(), torch.full((1,), 0.5, device=device), captions.bfloat16()


def model_pair(name: str, args, device: torch.device) -> ModelPair:
    from diffusers import ZImageTransformer2DModel

    config = ZImageConfig.from_dict(PRESETS[name].transformer)
    with torch.device("meta"):
        ours = ZImageTransformer(config)
    init_dummy_weights(ours, device, torch.bfloat16)
    ours.eval()
    with torch.device("meta"):
        reference = ZImageTransformer2DModel(**PRESETS[name].transformer)
    reference.load_state_dict(ours.state_dict(), assign=True, strict=True)
    reference.eval()

    latents, timestep, captions = step_inputs(config, args.height, args.width, args.text_len, device)
    rows, cols = args.height // 16, args.width // 16

    def run_reference() -> torch.Tensor:
        out = reference([latents[0][:, None]], timestep, [captions[0]], return_dict=False)[0]
        return torch.stack(out)[:, :, 0]

    def step_ours(model, noisy: torch.Tensor, sigma: float) -> torch.Tensor:
        # Z-Image's pipeline feeds 1 - sigma (its time runs from 0 at noise to 1 at the image).
        prediction = model(noisy, torch.full_like(timestep, 1 - sigma), captions)
        return unpatchify(prediction, rows, cols, config.patch_size)

    workload = (args.height, args.width, args.text_len)
    return ModelPair(
        name,
        ours,
        reference,
        run_reference=run_reference,
        step_ours=step_ours,
        latents=latents,
        tokens=rows * cols + args.text_len,
        tflop=TFLOP_PER_STEP_1024.get(name) if workload == REFERENCE_WORKLOAD else None,
    )


def main() -> None:
    step_benchmark_main(__doc__.splitlines()[0], model_pair, ["z-image-turbo", "z-image"], 256, "zimage_step.json")


if __name__ == "__main__":
    main()
