"""Tiny random Z-Image checkpoints in the real diffusers folder layout, written by diffusers'/transformers' own
``save_pretrained`` (transformer sharded, with its index), with a tokenizer built offline."""

from __future__ import annotations

from pathlib import Path

import torch
from diffusers import (
    AutoencoderKL,
    FlowMatchEulerDiscreteScheduler,
    ZImageOmniPipeline,
    ZImagePipeline,
    ZImageTransformer2DModel,
)
from transformers import Qwen3Config, Qwen3Model, Siglip2ImageProcessorPil, Siglip2VisionConfig, Siglip2VisionModel

from paradit.families.zimage.presets import BASE_SCHEDULER, TURBO_SCHEDULER
from paradit.offline_tokenizer import build_offline_tokenizer
from tests.checkpoints import randomize

TEXT_HIDDEN = 16
TEXT_LAYERS = 3  # the pipeline reads hidden_states[-2], the output of layer 2

# Qwen3's template in miniature: without thinking it appends an empty think block, which the pipeline must not get.
QWEN3_STYLE_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\n' -}}"
    "{%- if enable_thinking is defined and enable_thinking is false -%}{{- '<think>\n\n</think>\n\n' -}}{%- endif -%}"
    "{%- endif -%}"
)


def tiny_transformer_config(heads: int = 3, head_dim: int = 16, axes_dims=(4, 6, 6)) -> dict:
    return {
        "all_patch_size": [2],
        "all_f_patch_size": [1],
        "in_channels": 16,
        "dim": heads * head_dim,
        "n_layers": 2,
        "n_refiner_layers": 2,
        "n_heads": heads,
        "n_kv_heads": heads,
        "cap_feat_dim": TEXT_HIDDEN,
        "axes_dims": list(axes_dims),
        "axes_lens": [1536, 512, 512],
    }


def tiny_vae() -> AutoencoderKL:
    return AutoencoderKL(
        down_block_types=["DownEncoderBlock2D"] * 4,
        up_block_types=["UpDecoderBlock2D"] * 4,
        block_out_channels=[8, 8, 8, 8],
        layers_per_block=1,
        norm_num_groups=4,
        latent_channels=16,
        scaling_factor=0.3611,
        shift_factor=0.1159,
        use_quant_conv=False,
        use_post_quant_conv=False,
    )


def qwen3_encoder() -> Qwen3Model:
    config = Qwen3Config(
        vocab_size=320,
        hidden_size=TEXT_HIDDEN,
        intermediate_size=32,
        num_hidden_layers=TEXT_LAYERS,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=8,
        max_position_embeddings=1024,
    )
    return Qwen3Model(config).eval()


def build_zimage_checkpoint(folder: Path, seed: int = 0, turbo: bool = False) -> Path:
    """``turbo``: the scheduler Turbo ships (shift 3), which makes the checkpoint a step-distilled one to paradit."""
    torch.manual_seed(seed)
    transformer = ZImageTransformer2DModel(**tiny_transformer_config())
    randomize(transformer)
    tokenizer = build_offline_tokenizer()
    tokenizer.chat_template = QWEN3_STYLE_TEMPLATE
    pipe = ZImagePipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(**(TURBO_SCHEDULER if turbo else BASE_SCHEDULER)),
        vae=tiny_vae(),
        text_encoder=qwen3_encoder(),
        tokenizer=tokenizer,
        transformer=transformer,
    )
    pipe.save_pretrained(folder, max_shard_size="100KB")
    return folder


SIGLIP_HIDDEN = 24


def tiny_siglip() -> Siglip2VisionModel:
    """Siglip2 with one 24-wide layer over 8-pixel patches, a 4x4 table of learnt positions (resized to each image's
    patch grid)."""
    config = Siglip2VisionConfig(
        hidden_size=SIGLIP_HIDDEN,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        patch_size=8,
        num_patches=16,
    )
    return Siglip2VisionModel(config).eval()


def build_zimage_omni_checkpoint(folder: Path) -> Path:
    """ZImageOmniPipeline's folder: Z-Image's components, its transformer with the SigLIP embedder and refiner, and
    the ``siglip`` vision tower with its ``siglip_processor`` (images cut to at most 24 patches of 8 pixels)."""
    torch.manual_seed(2)
    transformer = ZImageTransformer2DModel(**tiny_transformer_config(), siglip_feat_dim=SIGLIP_HIDDEN)
    randomize(transformer)
    siglip = tiny_siglip()
    randomize(siglip)
    pipe = ZImageOmniPipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(**BASE_SCHEDULER),
        vae=tiny_vae(),
        text_encoder=qwen3_encoder(),
        tokenizer=build_offline_tokenizer(),
        transformer=transformer,
        siglip=siglip,
        siglip_processor=Siglip2ImageProcessorPil(patch_size=8, max_num_patches=24),
    )
    pipe.save_pretrained(folder, max_shard_size="100KB")
    return folder
