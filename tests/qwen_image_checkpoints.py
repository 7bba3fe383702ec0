"""Tiny random Qwen-Image checkpoints in the real diffusers folder layout, written by diffusers'/transformers' own
``save_pretrained`` (transformer sharded, with its index), with a tokenizer built offline."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from diffusers import (
    AutoencoderKLQwenImage,
    FlowMatchEulerDiscreteScheduler,
    QwenImageEditPipeline,
    QwenImageEditPlusPipeline,
    QwenImagePipeline,
)
from diffusers import QwenImageTransformer2DModel as ReferenceTransformer
from transformers import (
    AutoTokenizer,
    Qwen2_5_VLConfig,
    Qwen2_5_VLForConditionalGeneration,
    Qwen2VLImageProcessorPil,
    Qwen2VLProcessor,
)

from paradit.families.qwen_image.presets import QWEN_IMAGE_SCHEDULER
from paradit.offline_tokenizer import build_offline_tokenizer
from tests.checkpoints import randomize

TEXT_HIDDEN = 24


def tiny_transformer_config(heads: int = 3, zero_cond_t: bool = False) -> dict:
    """Head dim 16 split 4/6/6 over (frame, row, column); 2 blocks."""
    return {
        "patch_size": 2,
        "in_channels": 64,
        "out_channels": 16,
        "num_layers": 2,
        "attention_head_dim": 16,
        "num_attention_heads": heads,
        "joint_attention_dim": TEXT_HIDDEN,
        "axes_dims_rope": [4, 6, 6],
        "zero_cond_t": zero_cond_t,
    }


def tiny_transformer(seed: int = 0, heads: int = 3, zero_cond_t: bool = False) -> ReferenceTransformer:
    torch.manual_seed(seed)
    transformer = ReferenceTransformer(**tiny_transformer_config(heads, zero_cond_t))
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
    """Qwen2.5-VL with a 2-layer, 24-wide language model and a one-block vision tower (which only edits use)."""
    config = Qwen2_5_VLConfig(
        text_config={
            "vocab_size": 320,
            "hidden_size": TEXT_HIDDEN,
            "intermediate_size": 48,
            "num_hidden_layers": 2,
            "num_attention_heads": 2,
            "num_key_value_heads": 1,
            "max_position_embeddings": 2048,
            "rope_scaling": {"type": "mrope", "mrope_section": [2, 2, 2]},
            "bos_token_id": 1,
            "eos_token_id": 2,
            "pad_token_id": 0,
        },
        vision_config={
            "depth": 1,
            "hidden_size": 16,
            "intermediate_size": 32,
            "num_heads": 2,
            "out_hidden_size": TEXT_HIDDEN,
            "fullatt_block_indexes": [0],
        },
        # The offline tokenizer's image markers.
        image_token_id=263,
        video_token_id=264,
        vision_start_token_id=261,
        vision_end_token_id=262,
    )
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


class ImagesOnlyProcessor(Qwen2VLProcessor):
    """Qwen2VLProcessor without its video processor, which needs torchvision (not installed here): what diffusers'
    edit pipelines call to read images with the prompt."""

    def check_argument_for_proper_class(self, name, argument):
        return None if argument is None else super().check_argument_for_proper_class(name, argument)


def edit_processor(folder: Path) -> ImagesOnlyProcessor:
    """The edit checkpoint's processor, for diffusers' pipeline."""
    processor = folder / "processor"
    return ImagesOnlyProcessor(
        image_processor=Qwen2VLImageProcessorPil.from_pretrained(processor),
        tokenizer=AutoTokenizer.from_pretrained(processor),
        video_processor=None,
    )


def build_qwen_image_edit_checkpoint(folder: Path, plus: bool) -> Path:
    """Qwen-Image-Edit (one image) or Edit-Plus (several; with 2511's zero_cond_t), saved by diffusers' pipeline;
    the ``processor`` folder (tokenizer and image processor) as the published checkpoints hold it."""
    pipeline_class = QwenImageEditPlusPipeline if plus else QwenImageEditPipeline
    torch.manual_seed(1)
    pipe = pipeline_class(
        scheduler=FlowMatchEulerDiscreteScheduler(**QWEN_IMAGE_SCHEDULER),
        vae=tiny_vae(),
        text_encoder=tiny_text_encoder(),
        tokenizer=build_offline_tokenizer(),
        processor=None,
        transformer=tiny_transformer(0, heads=4, zero_cond_t=plus),
    )
    pipe.save_pretrained(folder, max_shard_size="100KB")
    build_offline_tokenizer().save_pretrained(folder / "processor")
    Qwen2VLImageProcessorPil().save_pretrained(folder / "processor")
    index = json.loads((folder / "model_index.json").read_text())
    index["processor"] = ["transformers", "Qwen2VLProcessor"]
    (folder / "model_index.json").write_text(json.dumps(index, indent=2))
    return folder
