"""Tiny random Stable Diffusion 3.5 checkpoints in the real diffusers folder layout, written by diffusers'/transformers'
own ``save_pretrained`` (transformer sharded, with its index), with CLIP and T5 tokenizers built offline."""

from __future__ import annotations

from pathlib import Path

import torch
from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, SD3Transformer2DModel, StableDiffusion3Pipeline
from transformers import CLIPTextConfig, CLIPTextModelWithProjection, T5Config, T5EncoderModel

from paradit.families.sd3.pipeline import offline_clip_tokenizer
from paradit.families.sd3.presets import SD3_SCHEDULER
from paradit.offline_tokenizer import offline_t5_tokenizer
from tests.checkpoints import randomize

# Widths chosen so that a swapped or mis-padded component changes a shape or a value: CLIP-L and bigG hidden widths
# differ (16 + 24 = 40, zero-padded to T5's 48) and so do their projections (12 + 20 = 32 pooled).
CLIP_L_HIDDEN, CLIP_L_PROJECTION = 16, 12
CLIP_G_HIDDEN, CLIP_G_PROJECTION = 24, 20
T5_WIDTH = 48


def tiny_transformer_config(heads: int = 3, head_dim: int = 8, dual_attention_layers=(0,), qk_norm="rms_norm") -> dict:
    """Three joint blocks: a dual-attention one (when listed), a plain one, and the context-pre-only last one."""
    return {
        "sample_size": 8,
        "patch_size": 2,
        "in_channels": 16,
        "num_layers": 3,
        "attention_head_dim": head_dim,
        "num_attention_heads": heads,
        "joint_attention_dim": T5_WIDTH,
        "caption_projection_dim": heads * head_dim,
        "pooled_projection_dim": CLIP_L_PROJECTION + CLIP_G_PROJECTION,
        "out_channels": 16,
        "pos_embed_max_size": 12,
        "dual_attention_layers": list(dual_attention_layers),
        "qk_norm": qk_norm,
    }


def clip_encoder(hidden: int, projection: int, act: str) -> CLIPTextModelWithProjection:
    tokenizer = offline_clip_tokenizer("!")
    config = CLIPTextConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=3,
        num_attention_heads=2,
        projection_dim=projection,
        hidden_act=act,
        max_position_embeddings=77,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=1,
    )
    return CLIPTextModelWithProjection(config).eval()


def t5_encoder() -> T5EncoderModel:
    config = T5Config(
        vocab_size=len(offline_t5_tokenizer()),
        d_model=T5_WIDTH,
        d_ff=64,
        d_kv=12,
        num_heads=4,
        num_layers=2,
        feed_forward_proj="gated-gelu",
        relative_attention_num_buckets=8,
        relative_attention_max_distance=32,
    )
    return T5EncoderModel(config).eval()


def tiny_vae() -> AutoencoderKL:
    """The published layout (stride 8, 16 latent channels, no quant convs, scaling and shift) at a tiny width."""
    return AutoencoderKL(
        block_out_channels=[8, 8, 8, 8],
        down_block_types=["DownEncoderBlock2D"] * 4,
        up_block_types=["UpDecoderBlock2D"] * 4,
        layers_per_block=1,
        norm_num_groups=4,
        latent_channels=16,
        scaling_factor=1.5305,
        shift_factor=0.0609,
        use_quant_conv=False,
        use_post_quant_conv=False,
    )


def tiny_transformer(seed: int, **config) -> SD3Transformer2DModel:
    torch.manual_seed(seed)
    transformer = SD3Transformer2DModel(**tiny_transformer_config(**config))
    randomize(transformer, std=0.1)
    return transformer.eval()


def build_sd3_checkpoint(folder: Path, seed: int = 0) -> Path:
    transformer = tiny_transformer(seed)
    pipe = StableDiffusion3Pipeline(
        transformer=transformer,
        scheduler=FlowMatchEulerDiscreteScheduler(**SD3_SCHEDULER),
        vae=tiny_vae(),
        text_encoder=clip_encoder(CLIP_L_HIDDEN, CLIP_L_PROJECTION, "quick_gelu"),
        tokenizer=offline_clip_tokenizer("<|endoftext|>"),
        text_encoder_2=clip_encoder(CLIP_G_HIDDEN, CLIP_G_PROJECTION, "gelu"),
        # The published bigG tokenizer pads with "!" rather than its end token; the padding reaches the embeddings.
        tokenizer_2=offline_clip_tokenizer("!"),
        text_encoder_3=t5_encoder(),
        tokenizer_3=offline_t5_tokenizer(),
    )
    pipe.save_pretrained(folder, max_shard_size="100KB")
    return folder
