"""Tiny random Qwen-Image 2.1 modules and checkpoint folders in diffusers' layout, written by diffusers' and
transformers' own ``save_pretrained``, with a tokenizer built offline."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from diffusers import AutoencoderKLQwenImage21, FlowMatchEulerDiscreteScheduler, QwenImage21Pipeline
from diffusers import QwenImage21Transformer2DModel as ReferenceTransformer
from transformers import (
    AutoTokenizer,
    Qwen2VLImageProcessorPil,
    Qwen3VLConfig,
    Qwen3VLForConditionalGeneration,
    Qwen3VLProcessor,
)

from paradit.families.qwen_image21.presets import QWEN_IMAGE21_SCHEDULER
from paradit.offline_tokenizer import CHAT_TEMPLATE, build_offline_tokenizer
from tests.checkpoints import randomize

TEXT_HIDDEN = 24


def tiny_transformer_config(heads: int = 2) -> dict:
    """Head dim 16 split 4/6/6 over (frame, row, column); 2 blocks; the 64 latent channels the VAE makes."""
    return {
        "patch_size": 1,
        "in_channels": 64,
        "out_channels": 64,
        "num_layers": 2,
        "attention_head_dim": 16,
        "num_attention_heads": heads,
        "context_in_dim": TEXT_HIDDEN,
        "mlp_ratio": 3,
        "axes_dims_rope": [4, 6, 6],
        "causal_condition": True,
    }


def tiny_transformer(seed: int = 0, heads: int = 2) -> ReferenceTransformer:
    torch.manual_seed(seed)
    transformer = ReferenceTransformer(**tiny_transformer_config(heads))
    randomize(transformer)
    return transformer.eval()


def tiny_vae() -> AutoencoderKLQwenImage21:
    """64 latent channels, 16x spatial stride, RGBA; non-trivial latent statistics, so a wrong mean or std shows."""
    gen = torch.Generator().manual_seed(5)
    mean = (torch.randn(64, generator=gen) * 0.5).tolist()
    std = (torch.rand(64, generator=gen) + 0.5).tolist()
    return AutoencoderKLQwenImage21(
        base_dim=8, decoder_base_dim=8, dim_mult=[1, 1, 1, 1, 1], num_res_blocks=1, latents_mean=mean, latents_std=std
    ).eval()


def tiny_text_encoder() -> Qwen3VLForConditionalGeneration:
    """Qwen3-VL with a 2-layer, 24-wide language model and a one-block vision tower of 16-pixel patches."""
    config = Qwen3VLConfig(
        text_config={
            "vocab_size": 320,
            "hidden_size": TEXT_HIDDEN,
            "intermediate_size": 48,
            "num_hidden_layers": 2,
            "num_attention_heads": 2,
            "num_key_value_heads": 1,
            "head_dim": 12,
            "max_position_embeddings": 2048,
            "rope_parameters": {"rope_type": "default", "mrope_section": [2, 2, 2], "mrope_interleaved": True},
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
            "patch_size": 16,
            "spatial_merge_size": 2,
            "temporal_patch_size": 2,
            "deepstack_visual_indexes": [0],
        },
        # The offline tokenizer's image markers.
        image_token_id=263,
        video_token_id=264,
        vision_start_token_id=261,
        vision_end_token_id=262,
    )
    return Qwen3VLForConditionalGeneration(config).eval()


class ImagesOnlyProcessor(Qwen3VLProcessor):
    """Qwen3VLProcessor without its video processor, which needs torchvision (not installed here)."""

    def check_argument_for_proper_class(self, name, argument):
        return None if argument is None else super().check_argument_for_proper_class(name, argument)


def image_processor() -> Qwen2VLImageProcessorPil:
    """Qwen3-VL's 16-pixel patches merged 2x2; small images kept at their size (no upscaling to 256x256)."""
    return Qwen2VLImageProcessorPil(
        patch_size=16, temporal_patch_size=2, merge_size=2, size={"shortest_edge": 32 * 32, "longest_edge": 512 * 512}
    )


def processor(folder: Path | None = None) -> ImagesOnlyProcessor:
    """The checkpoint's processor (built, or read back from ``folder``), for diffusers' pipeline."""
    if folder is None:
        return ImagesOnlyProcessor(
            image_processor=image_processor(),
            tokenizer=build_offline_tokenizer(),
            video_processor=None,
            chat_template=CHAT_TEMPLATE,
        )
    return ImagesOnlyProcessor(
        image_processor=Qwen2VLImageProcessorPil.from_pretrained(folder / "processor"),
        tokenizer=AutoTokenizer.from_pretrained(folder / "processor"),
        video_processor=None,
        chat_template=CHAT_TEMPLATE,
    )


def build_qwen_image21_checkpoint(folder: Path, sample_sigmas: tuple[float, ...] | None = None) -> Path:
    """Saved by diffusers' QwenImage21Pipeline (``sample_sigmas``: a Turbo-like schedule in model_index.json)."""
    torch.manual_seed(1)
    pipe = QwenImage21Pipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(**QWEN_IMAGE21_SCHEDULER),
        vae=tiny_vae(),
        text_encoder=tiny_text_encoder(),
        processor=processor(),
        transformer=tiny_transformer(0),
        sample_sigmas=None if sample_sigmas is None else list(sample_sigmas),
    )
    # Its processor is saved apart: transformers cannot save a Qwen3VLProcessor without its video processor.
    pipe.register_modules(processor=None)
    pipe.save_pretrained(folder, max_shard_size="100KB")
    build_offline_tokenizer().save_pretrained(folder / "processor")
    image_processor().save_pretrained(folder / "processor")
    index = json.loads((folder / "model_index.json").read_text())
    index["processor"] = ["transformers", "Qwen3VLProcessor"]
    (folder / "model_index.json").write_text(json.dumps(index, indent=2))
    return folder
