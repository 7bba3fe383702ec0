"""Tiny random Qwen-Image checkpoints in the real diffusers folder layout, written by diffusers'/transformers' own
``save_pretrained`` (transformer sharded, with its index), with a tokenizer built offline."""

from __future__ import annotations

from pathlib import Path

import torch
from diffusers import AutoencoderKLQwenImage, FlowMatchEulerDiscreteScheduler, QwenImagePipeline
from diffusers import QwenImageTransformer2DModel as ReferenceTransformer
from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

from paradit.families.qwen_image.presets import QWEN_IMAGE_SCHEDULER
from paradit.offline_tokenizer import build_offline_tokenizer
from tests.checkpoints import randomize

TEXT_HIDDEN = 24


def tiny_transformer_config(heads: int = 3) -> dict:
    """Head dim 16 split 4/6/6 over (frame, row, column); 2 blocks."""
    return {
        "patch_size": 2, "in_channels": 64, "out_channels": 16, "num_layers": 2, "attention_head_dim": 16,
        "num_attention_heads": heads, "joint_attention_dim": TEXT_HIDDEN, "axes_dims_rope": [4, 6, 6],
    }  # fmt: skip


def tiny_transformer(seed: int = 0, heads: int = 3) -> ReferenceTransformer:
    torch.manual_seed(seed)
    transformer = ReferenceTransformer(**tiny_transformer_config(heads))
    randomize(transformer)
    return transformer.eval()


def tiny_vae() -> AutoencoderKLQwenImage:
    """16 latent channels (the transformer packs them 2x2 into 64), 8x spatial stride, non-trivial latent
    statistics so that a wrong mean/std shows in the image."""
    gen = torch.Generator().manual_seed(5)
    mean = (torch.randn(16, generator=gen) * 0.5).tolist()
    std = (torch.rand(16, generator=gen) + 0.5).tolist()
    return AutoencoderKLQwenImage(
        base_dim=8, dim_mult=[1, 2, 2, 2], num_res_blocks=1, latents_mean=mean, latents_std=std
    ).eval()


def tiny_text_encoder() -> Qwen2_5_VLForConditionalGeneration:
    """Qwen2.5-VL with a 2-layer, 24-wide language model and a one-block vision tower (never shown an image)."""
    config = Qwen2_5_VLConfig(
        text_config={
            "vocab_size": 320, "hidden_size": TEXT_HIDDEN, "intermediate_size": 48, "num_hidden_layers": 2,
            "num_attention_heads": 2, "num_key_value_heads": 1, "max_position_embeddings": 2048,
            "rope_scaling": {"type": "mrope", "mrope_section": [2, 2, 2]}, "bos_token_id": 1, "eos_token_id": 2,
            "pad_token_id": 0,
        },
        vision_config={
            "depth": 1, "hidden_size": 16, "intermediate_size": 32, "num_heads": 2, "out_hidden_size": TEXT_HIDDEN,
            "fullatt_block_indexes": [0],
        },
        image_token_id=300, video_token_id=301, vision_start_token_id=302, vision_end_token_id=303,
    )  # fmt: skip
    return Qwen2_5_VLForConditionalGeneration(config).eval()


def build_qwen_image_checkpoint(folder: Path, seed: int = 0, heads: int = 3) -> Path:
    transformer = tiny_transformer(seed, heads)
    torch.manual_seed(seed + 1)
    pipe = QwenImagePipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(**QWEN_IMAGE_SCHEDULER),
        vae=tiny_vae(),
        text_encoder=tiny_text_encoder(),
        tokenizer=build_offline_tokenizer(),
        transformer=transformer,
    )
    pipe.save_pretrained(folder, max_shard_size="100KB")
    return folder
