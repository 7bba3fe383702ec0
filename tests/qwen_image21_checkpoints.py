"""Tiny random Qwen-Image 2.1 modules and checkpoint folders in diffusers' layout, written by diffusers' and
transformers' own ``save_pretrained``, with a tokenizer built offline."""

from __future__ import annotations

import torch
from diffusers import QwenImage21Transformer2DModel as ReferenceTransformer

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
