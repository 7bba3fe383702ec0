"""One Qwen-Image transformer step on one GPU: paradit against diffusers' QwenImageTransformer2DModel, same weights.

Full-size architecture with random weights (dummy load). The diffusers model is built on the meta device and handed
paradit's tensors (identical parameter names), so both run on the very same weights with one copy in memory.
Prints ms/step, TFLOP/s and MFU against the bf16 matmul rate measured in the same run, and the relative L2 between
the two outputs. One CFG branch, unpadded text (no attention mask), as a single prompt runs.

    python benchmarks/qwen_image_step.py --out-dir $OUT
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import ModelPair, init_dummy_weights, step_benchmark_main  # noqa: E402
from paradit.families import PRESETS  # noqa: E402
from paradit.families.qwen_image.model import QwenImageConfig, QwenImageTransformer  # noqa: E402

# Exact FLOPs of one forward at 1024x1024 (4096 image + 256 text tokens), counted with FlopCounterMode over the
# diffusers model on the meta device (shared/models/configs.json).
TFLOP_PER_STEP_1024 = {"qwen-image": 73.128218198016}
REFERENCE_TEXT_LEN = 256


def step_inputs(config: QwenImageConfig, height: int, width: int, text_len: int, device: torch.device) -> dict:
    """Packed latents of a (height / 16) x (width / 16) token grid, text embeddings and a mid-schedule sigma."""
    rows, cols = height // 16, width // 16
    gen = torch.Generator(device).manual_seed(0)
    return dict(
        hidden_states=torch.randn(1, rows * cols, config.in_channels, device=device, generator=gen).bfloat16(),
        encoder_hidden_states=torch.randn(
            1, text_len, config.joint_attention_dim, device=device, generator=gen
        ).bfloat16(),
        timestep=torch.full((1,), 0.5, device=device, dtype=torch.bfloat16),
        rows=rows,
        cols=cols,
    )


def model_pair(name: str, args, device: torch.device) -> ModelPair:
    from diffusers import QwenImageTransformer2DModel
    from diffusers.models.transformers.transformer_qwenimage import QwenEmbedRope

    config = QwenImageConfig.from_dict(PRESETS[name].transformer)
    with torch.device("meta"):
        ours = QwenImageTransformer(config)
    init_dummy_weights(ours, device, torch.bfloat16)
    ours.eval()
    with torch.device("meta"):
        reference = QwenImageTransformer2DModel(**PRESETS[name].transformer)
    reference.load_state_dict(ours.state_dict(), assign=True, strict=True)
    # The reference keeps its rotary tables as plain attributes (no buffers), made in __init__: rebuild them off meta.
    reference.pos_embed = QwenEmbedRope(theta=10000, axes_dim=list(config.axes_dims_rope), scale_rope=True)
    reference.eval()

    inputs = step_inputs(config, args.height, args.width, args.text_len, device)
    rows, cols = inputs.pop("rows"), inputs.pop("cols")

    def step_ours(model, latents: torch.Tensor, sigma: float) -> torch.Tensor:
        timestep = torch.full_like(inputs["timestep"], sigma)
        return model(**{**inputs, "hidden_states": latents, "timestep": timestep}, rows=rows, cols=cols)

    at_reference_size = (args.height, args.width, args.text_len) == (1024, 1024, REFERENCE_TEXT_LEN)
    return ModelPair(
        name,
        ours,
        reference,
        run_reference=lambda: reference(**inputs, img_shapes=[[(1, rows, cols)]], return_dict=False)[0],
        step_ours=step_ours,
        latents=inputs["hidden_states"],
        tokens=rows * cols + args.text_len,
        tflop=TFLOP_PER_STEP_1024.get(name) if at_reference_size else None,
    )


def main() -> None:
    step_benchmark_main(
        __doc__.splitlines()[0], model_pair, list(TFLOP_PER_STEP_1024), REFERENCE_TEXT_LEN, "qwen_image_step.json"
    )


if __name__ == "__main__":
    main()
