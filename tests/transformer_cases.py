"""Every family's tiny transformer with random weights, and the inputs the parallel tests feed it: each builder gives
``(model, {case name: inputs})`` and is deterministic, so a test process and its gloo ranks build the same model.
``SEQUENCE`` holds head counts and token counts that no sequence degree of 2, 3 or 4 divides; ``TENSOR`` holds head
counts and widths that T = 2 and 4 divide."""

from __future__ import annotations

import dataclasses
import functools

import torch

from paradit.families.flux2.model import Flux2Config, Flux2Transformer
from paradit.families.qwen_image.model import QwenImageConfig, QwenImageTransformer
from paradit.families.sd3.model import SD3Config, SD3Transformer
from paradit.families.wan.model import WanConfig, WanTransformer
from paradit.families.zimage.model import ZImageConfig, ZImageTransformer
from tests import qwen_image_checkpoints, sd3_checkpoints, zimage_checkpoints
from tests.checkpoints import randomize, tiny_transformer_config
from tests.test_flux2_reference import transformer_inputs as flux2_inputs
from tests.test_qwen_image import transformer_inputs as qwen_inputs
from tests.test_sd3 import transformer_inputs as sd3_inputs
from tests.test_wan_model import TEXT_DIM, first_frame_timesteps, tiny_config
from tests.test_zimage import caption_batch
from tests.test_zimage import transformer_inputs as zimage_inputs

ROWS, COLS, TEXT = 5, 3, 7  # 15 image + 7 text tokens: divisible by none of 2, 3, 4
WAN_LATENT = (3, 6, 10)  # 3 * 3 * 5 = 45 video tokens


def call(model, inputs):
    return model(*inputs) if isinstance(inputs, tuple) else model(**inputs)


def flux2(heads: int, guidance: bool):
    torch.manual_seed(0)
    config = tiny_transformer_config(guidance_embeds=guidance, heads=heads)
    model = Flux2Transformer(Flux2Config.from_dict(config))
    randomize(model)
    cases = {}
    for batch in (1, 2):  # batch 1 takes Ulysses' zero-copy path
        inputs = flux2_inputs(config, batch, ROWS, COLS, TEXT, seed=batch)
        cases[f"batch {batch}"] = dict(inputs, guidance=torch.full((batch,), 3.0) if guidance else None)
    return model.eval(), cases


def qwen_image(heads: int):
    torch.manual_seed(0)
    model = QwenImageTransformer(QwenImageConfig.from_dict(qwen_image_checkpoints.tiny_transformer_config(heads)))
    randomize(model)
    config = dataclasses.asdict(model.config)
    cases = {}
    for name, batch, text_lengths in (("batch 1", 1, None), ("batch 2 masked", 2, [7, 3])):
        cases[name] = dict(qwen_inputs(config, batch, ROWS, COLS, text_lengths, seed=batch), rows=ROWS, cols=COLS)
    return model.eval(), cases


def sd3(heads: int, head_dim: int, dual_attention_layers: tuple[int, ...]):
    """The listed blocks have SD3.5-medium's image-only attention (whose all-to-alls carry the image stream alone);
    the last block is context-pre-only (no to_add_out)."""
    config = sd3_checkpoints.tiny_transformer_config(heads, head_dim, dual_attention_layers)
    torch.manual_seed(0)
    model = SD3Transformer(SD3Config.from_dict(config))
    randomize(model, std=0.1)
    cases = {f"batch {batch}": sd3_inputs(config, batch, 2 * ROWS, 2 * COLS, TEXT, seed=batch) for batch in (1, 2)}
    return model.eval(), cases


def zimage(heads: int, head_dim: int, axes_dims: tuple[int, int, int]):
    """Streams are padded to multiples of 32 tokens; the second batch's caption is rounded to 32 tokens of a 64-token
    text stream, so half its keys are masked."""
    config = zimage_checkpoints.tiny_transformer_config(heads=heads, head_dim=head_dim, axes_dims=axes_dims)
    torch.manual_seed(0)
    model = ZImageTransformer(ZImageConfig.from_dict(config))
    randomize(model)
    cases = {}
    for lengths in ([7], [40, 9]):
        latents, timestep, captions = zimage_inputs(config, ROWS, COLS, lengths, seed=len(lengths))
        cases[f"captions {lengths}"] = (latents, timestep, *caption_batch(captions))
    return model.eval(), cases


def wan(heads: int):
    """Heads of 12 channels, ffn_dim 40; one timestep per sample, and TI2V's one per token."""
    torch.manual_seed(0)
    config = WanConfig.from_dict(tiny_config(16, 16, heads=heads, head_dim=12))
    model = WanTransformer(config)
    randomize(model, std=0.1)
    gen = torch.Generator().manual_seed(1)
    latents = torch.randn(2, 16, *WAN_LATENT, generator=gen)
    text = torch.randn(2, TEXT, TEXT_DIM, generator=gen)
    timesteps = torch.tensor([937.0, 281.5])
    per_token = first_frame_timesteps(config.token_grid(*WAN_LATENT), timesteps)
    return model.eval(), {"batch 2": (latents, timesteps, text), "batch 2 per token": (latents, per_token, text)}


# Each case's family in the registry (whose tensor plan shards it).
REGISTERED = {
    "FLUX.2": "flux2",
    "FLUX.2 guidance": "flux2",
    "Qwen-Image": "qwen_image",
    "SD3.5": "sd3",
    "Z-Image": "zimage",
    "Wan": "wan",
}

SEQUENCE = {
    # 5 heads over Ulysses 2, 3 and 4: shares (3, 2), (2, 2, 1), (2, 1, 1, 1).
    "FLUX.2": functools.partial(flux2, 5, guidance=False),
    "FLUX.2 guidance": functools.partial(flux2, 5, guidance=True),
    "Qwen-Image": functools.partial(qwen_image, 5),
    # 38 heads (SD3.5-large's count) of 4 channels: Ulysses 4 splits them (10, 10, 9, 9), Ulysses 3 (13, 13, 12).
    "SD3.5": functools.partial(sd3, 38, 4, (0, 1)),
    # 30 heads of 8: Ulysses 4 splits them 8/8/7/7; padded streams of 32 tokens, which 3 does not divide.
    "Z-Image": functools.partial(zimage, 30, 8, (2, 2, 4)),
    # 3 heads: Ulysses 2 shares (2, 1), Ulysses 4 leaves a rank without a head.
    "Wan": functools.partial(wan, 3),
}
TENSOR_HEADS = 4
TENSOR = {
    "FLUX.2": functools.partial(flux2, TENSOR_HEADS, guidance=False),
    "FLUX.2 guidance": functools.partial(flux2, TENSOR_HEADS, guidance=True),
    "Qwen-Image": functools.partial(qwen_image, TENSOR_HEADS),
    "SD3.5": functools.partial(sd3, TENSOR_HEADS, 8, (0,)),
    # dim 96: MLP hidden width int(96 / 3 * 8) = 256, divisible by 4.
    "Z-Image": functools.partial(zimage, TENSOR_HEADS, 24, (8, 8, 8)),
    "Wan": functools.partial(wan, TENSOR_HEADS),
}
