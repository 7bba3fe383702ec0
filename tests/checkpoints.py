"""Tiny random FLUX.2 checkpoints in the real diffusers folder layout, written by diffusers'/transformers' own
``save_pretrained`` (transformer sharded, with its index), with a tokenizer built offline."""

from __future__ import annotations

from pathlib import Path

import torch
from diffusers import (
    AutoencoderKLFlux2,
    FlowMatchEulerDiscreteScheduler,
    Flux2KleinPipeline,
    Flux2Pipeline,
    Flux2Transformer2DModel,
)
from transformers import Mistral3Config, Mistral3ForConditionalGeneration, Qwen3Config, Qwen3ForCausalLM

from paradit.families.flux2.presets import FLUX2_SCHEDULER
from paradit.offline_tokenizer import build_offline_tokenizer
from paradit.weights import CheckpointTensors, ModelNames, materialize

TEXT_HIDDEN = 16


def load_module_weights(module: torch.nn.Module, files: list[Path], device: torch.device, dtype: torch.dtype) -> None:
    with CheckpointTensors(files, device, dtype) as source:
        materialize(module, ModelNames(module), source)


def relative_l2(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / ||b||, computed in float64."""
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def tiny_transformer_config(guidance_embeds: bool, heads: int = 3) -> dict:
    return {
        "patch_size": 1,
        "in_channels": 16,
        "num_layers": 2,
        "num_single_layers": 2,
        "attention_head_dim": 16,
        "num_attention_heads": heads,
        "joint_attention_dim": 3 * TEXT_HIDDEN,
        "timestep_guidance_channels": 32,
        "axes_dims_rope": [4, 4, 4, 4],
        "guidance_embeds": guidance_embeds,
    }


def randomize(module: torch.nn.Module, std: float = 0.2) -> None:
    """Non-default values everywhere (norm weights included), so a mis-wired parameter cannot go unnoticed."""
    with torch.no_grad():
        for param in module.parameters():
            if param.ndim >= 2:
                param.normal_(0, std)
            else:
                param.copy_(1 + 0.1 * torch.randn_like(param))


def tiny_vae() -> AutoencoderKLFlux2:
    vae = AutoencoderKLFlux2(block_out_channels=[8, 8, 8, 8], norm_num_groups=4, layers_per_block=1, latent_channels=4)
    with torch.no_grad():
        vae.bn.running_mean.normal_(0, 0.5)
        vae.bn.running_var.uniform_(0.5, 1.5)
    return vae


def qwen3_encoder() -> Qwen3ForCausalLM:
    config = Qwen3Config(
        vocab_size=320,
        hidden_size=TEXT_HIDDEN,
        intermediate_size=32,
        num_hidden_layers=28,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=8,
        max_position_embeddings=1024,
    )
    return Qwen3ForCausalLM(config).eval()


def mistral3_encoder() -> Mistral3ForConditionalGeneration:
    config = Mistral3Config(
        text_config={
            "model_type": "mistral",
            "vocab_size": 320,
            "hidden_size": TEXT_HIDDEN,
            "intermediate_size": 32,
            "num_hidden_layers": 32,
            "num_attention_heads": 2,
            "num_key_value_heads": 1,
            "head_dim": 8,
            "max_position_embeddings": 1024,
        },
        vision_config={
            "model_type": "pixtral",
            "hidden_size": 16,
            "intermediate_size": 32,
            "num_hidden_layers": 1,
            "num_attention_heads": 2,
            "head_dim": 8,
            "image_size": 28,
            "patch_size": 14,
        },
        image_token_index=5,
    )
    return Mistral3ForConditionalGeneration(config).eval()


def build_klein_checkpoint(folder: Path, seed: int = 0, distilled: bool = False, heads: int = 3) -> Path:
    torch.manual_seed(seed)
    transformer = Flux2Transformer2DModel(**tiny_transformer_config(guidance_embeds=False, heads=heads))
    randomize(transformer)
    pipe = Flux2KleinPipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(**FLUX2_SCHEDULER),
        vae=tiny_vae(),
        text_encoder=qwen3_encoder(),
        tokenizer=build_offline_tokenizer(),
        transformer=transformer,
        is_distilled=distilled,
    )
    pipe.save_pretrained(folder, max_shard_size="100KB")
    return folder


def build_dev_checkpoint(folder: Path, seed: int = 0) -> Path:
    torch.manual_seed(seed)
    transformer = Flux2Transformer2DModel(**tiny_transformer_config(guidance_embeds=True))
    randomize(transformer)
    pipe = Flux2Pipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(**FLUX2_SCHEDULER),
        vae=tiny_vae(),
        text_encoder=mistral3_encoder(),
        tokenizer=build_offline_tokenizer(),
        transformer=transformer,
    )
    pipe.save_pretrained(folder, max_shard_size="100KB")
    return folder
