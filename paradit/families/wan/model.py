"""Wan 2.1 / 2.2 video transformer: diffusers' ``WanTransformer3DModel``; only the video stream is split (every rank
holds the text). As the reference: norms and modulation in float32, rounded where it rounds; QK norms span all heads."""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import nn

from paradit.layers.attention import QKVAttention
from paradit.layers.embeddings import EmbeddingMLP, sinusoidal_embedding
from paradit.layers.feedforward import GeluFeedForward
from paradit.layers.fp8 import Fp8Linear, QuantizedRows
from paradit.layers.fp8_fused import modulated_layer_norm_fp8, normed_rotated, uses_fusion
from paradit.layers.rotary import multi_axis_rope
from paradit.layers.sparse_masks import video_grid
from paradit.layers.stages import HeadsConfig, StagedTransformer
from paradit.layers.stages import unpatchify as unpatchify  # (tokens, grid, patch), re-exported for the pipeline

ROPE_THETA = 10000.0
MODULATION_SETS = 6  # shift, scale, gate for self-attention, then for the MLP


@dataclass(frozen=True)
class WanConfig(HeadsConfig):
    patch_size: tuple[int, int, int] = (1, 2, 2)
    num_attention_heads: int = 40
    attention_head_dim: int = 128
    in_channels: int = 16
    out_channels: int | None = 16
    text_dim: int = 4096
    freq_dim: int = 256
    ffn_dim: int = 13824
    num_layers: int = 40
    cross_attn_norm: bool = True
    eps: float = 1e-6
    image_dim: int | None = None  # CLIP image features (Wan 2.1 I2V); None for every Wan 2.2 checkpoint
    added_kv_proj_dim: int | None = None
    rope_max_seq_len: int = 1024
    pos_embed_seq_len: int | None = None

    @property
    def rope_axes(self) -> tuple[int, int, int]:
        """Per-head rotary channels (frame, row, column), 128 -> 44, 42, 42: spatial axes 2 * (head_dim // 6) each."""
        spatial = 2 * (self.attention_head_dim // 6)
        return self.attention_head_dim - 2 * spatial, spatial, spatial

    def token_grid(self, frames: int, height: int, width: int) -> tuple[int, int, int]:
        p_t, p_h, p_w = self.patch_size
        return frames // p_t, height // p_h, width // p_w


class FP32LayerNorm(nn.LayerNorm):
    """LayerNorm in float32, weights too (the blocks round after the modulation, where the reference rounds)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight, bias = (None if parameter is None else parameter.float() for parameter in (self.weight, self.bias))
        return nn.functional.layer_norm(x.float(), self.normalized_shape, weight, bias, self.eps).to(x.dtype)


class WanSelfAttention(QKVAttention):
    """Self-attention over the video tokens, whose Q/K norms (over all heads) and rotary embedding run as one kernel
    where ``fp8_fused`` runs (not a tensor-parallel shard's norm, which sums its squares over the group)."""

    def __init__(self, dim: int, head_dim: int, qk_norm: Callable[[int], nn.Module]) -> None:
        super().__init__(dim, head_dim, qk_norm, across_heads=True, sequence_streams=("video",))
        self.fusions: frozenset[str] | None = None  # fp8_fused's choice (None: the measured one)

    def forward(
        self, x: torch.Tensor | QuantizedRows, rope: tuple[torch.Tensor, torch.Tensor] | None = None
    ) -> torch.Tensor:
        plain = type(self.norm_q) is nn.RMSNorm and type(self.norm_k) is nn.RMSNorm
        if rope is None or not (plain and uses_fusion(rope[0].device, "qk_norm_rope", self.fusions)):
            return super().forward(x, rope)
        q = normed_rotated(self.to_q(x), self.norm_q, rope, self.head_dim)
        k = normed_rotated(self.to_k(x), self.norm_k, rope, self.head_dim)
        v = self.project(x, self.to_v)
        return self.to_out[0](self.attend(q, k, v).flatten(2).to(q.dtype))


class WanCrossAttention(QKVAttention):
    """Attention from the video tokens to the text, plus (with ``add_k_proj``) one to image features; no rotary."""

    def __init__(
        self, dim: int, head_dim: int, qk_norm: Callable[[int], nn.Module], added_kv_proj_dim: int | None
    ) -> None:
        super().__init__(dim, head_dim, qk_norm, across_heads=True, sequence_streams=())
        self.add_k_proj = self.add_v_proj = self.norm_added_k = None
        if added_kv_proj_dim is not None:
            self.add_k_proj = nn.Linear(added_kv_proj_dim, dim)
            self.add_v_proj = nn.Linear(added_kv_proj_dim, dim)
            self.norm_added_k = qk_norm(dim)

    def forward(self, x: torch.Tensor, context: torch.Tensor, context_image: torch.Tensor | None) -> torch.Tensor:
        q, k, v = self.qkv(x, context)
        out = self.attend(q, k, v).flatten(2).to(q.dtype)
        if context_image is not None and self.add_k_proj is not None:
            k_image = self.project(context_image, self.add_k_proj, self.norm_added_k)
            v_image = self.project(context_image, self.add_v_proj)
            out = out + self.attend(q, k_image, v_image).flatten(2).to(q.dtype)
        return self.to_out[0](out)


class WanBlock(nn.Module):
    def __init__(self, config: WanConfig) -> None:
        super().__init__()
        dim, head_dim, eps = config.inner_dim, config.attention_head_dim, config.eps
        # The reference's RMS norms on Q and K span all heads at once, whatever its config's qk_norm says.
        qk_norm = functools.partial(nn.RMSNorm, eps=eps)
        self.norm1 = FP32LayerNorm(dim, eps, elementwise_affine=False)
        self.attn1 = WanSelfAttention(dim, head_dim, qk_norm)
        self.attn2 = WanCrossAttention(dim, head_dim, qk_norm, config.added_kv_proj_dim)
        self.norm2 = FP32LayerNorm(dim, eps, elementwise_affine=True) if config.cross_attn_norm else nn.Identity()
        self.ffn = GeluFeedForward(dim, config.ffn_dim, dim)
        self.norm3 = FP32LayerNorm(dim, eps, elementwise_affine=False)
        self.scale_shift_table = nn.Parameter(torch.empty(1, MODULATION_SETS, dim))
        self.fusions: frozenset[str] | None = None  # fp8_fused's choice (None: the measured one)

    def forward(
        self,
        x: torch.Tensor,
        context: torch.Tensor,
        context_image: torch.Tensor | None,
        modulation: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
    ) -> torch.Tensor:
        """``modulation``: (B, 1, 6, dim) for one timestep per sample, (B, tokens, 6, dim) for one per token."""
        # float32 whatever the parameters' dtype: the reference keeps the table in float32 and adds in float32.
        mod = self.scale_shift_table.float() + modulation.float()
        shift, scale, gate, mlp_shift, mlp_scale, mlp_gate = mod.unbind(2)
        projections = (self.attn1.to_q, self.attn1.to_k, self.attn1.to_v)
        attn = self.attn1(self.modulated(self.norm1, x, shift, scale, *projections), rope)
        x = (x.float() + attn * gate).to(x.dtype)
        x = x + self.attn2(self.norm2(x.float()).to(x.dtype), context, context_image)
        mlp = self.ffn(self.modulated(self.norm3, x, mlp_shift, mlp_scale, self.ffn.net[0].proj))
        return (x.float() + mlp.float() * mlp_gate).to(x.dtype)

    def modulated(
        self, norm: nn.Module, x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor, *linears: nn.Module
    ) -> torch.Tensor | QuantizedRows:
        """``norm(x) * (1 + scale) + shift`` in float32, rounded to x's dtype; already quantized for ``linears``
        where they are all FP8 and ``fp8_fused`` runs (the one activation read once, not once per linear)."""
        if all(isinstance(linear, Fp8Linear) for linear in linears) and uses_fusion(
            x.device, "norm_quantize", self.fusions
        ):
            return modulated_layer_norm_fp8(x, norm, shift, scale, linears[0].weight.dtype)
        return (norm(x.float()) * (1 + scale) + shift).to(x.dtype)


class ImageEmbedding(nn.Module):
    """CLIP image features (Wan 2.1 I2V/FLF2V); FLF2V's (``pos_embed``) first- and last-frame rows joined first."""

    def __init__(self, in_features: int, dim: int, pos_embed_seq_len: int | None) -> None:
        super().__init__()
        self.norm1 = FP32LayerNorm(in_features)
        self.ff = GeluFeedForward(in_features, in_features, dim, approximate="none")
        self.norm2 = FP32LayerNorm(dim)
        self.pos_embed = None
        if pos_embed_seq_len is not None:
            self.pos_embed = nn.Parameter(torch.empty(1, pos_embed_seq_len, in_features))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.pos_embed is not None:
            x = x.reshape(-1, 2 * x.shape[1], x.shape[2]) + self.pos_embed
        return self.norm2(self.ff(self.norm1(x)))


class ConditionEmbedder(nn.Module):
    """diffusers' ``WanTimeTextImageEmbedding``: the timestep, text and image features embedded."""

    def __init__(self, config: WanConfig) -> None:
        super().__init__()
        dim = config.inner_dim
        self.freq_dim = config.freq_dim
        self.time_embedder = EmbeddingMLP(config.freq_dim, dim)
        self.time_proj = nn.Linear(dim, MODULATION_SETS * dim)
        # diffusers' PixArtAlphaTextProjection
        tanh_gelu = functools.partial(nn.functional.gelu, approximate="tanh")
        self.text_embedder = EmbeddingMLP(config.text_dim, dim, activation=tanh_gelu)
        self.image_embedder = None
        if config.image_dim is not None:
            self.image_embedder = ImageEmbedding(config.image_dim, dim, config.pos_embed_seq_len)

    def time(self, timestep: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """(N,) timesteps in [0, 1000] -> temb (N, dim) and modulation (N, 6, dim), both in ``dtype``."""
        # The sinusoid goes in at the MLP's own dtype: the reference keeps time_embedder in float32 when it can.
        freqs = sinusoidal_embedding(timestep, self.freq_dim).to(self.time_embedder.linear_1.weight.dtype)
        temb = self.time_embedder(freqs).to(dtype)
        return temb, self.time_proj(nn.functional.silu(temb)).unflatten(-1, (MODULATION_SETS, -1))


@dataclass
class WanTokens:
    """Either ``temb`` and ``modulation`` (one timestep per sample) or their ``token_`` pair (per token: TI2V-5B)."""

    SEQUENCE_FIELDS: ClassVar[dict[str, tuple[str, int]]] = {
        "video": ("video", 1),
        "rope": ("video", 0),
        "token_temb": ("video", 1),
        "token_modulation": ("video", 1),
    }
    OUTPUT_STREAM: ClassVar[str] = "video"

    video: torch.Tensor  # (B, frames * rows * cols, dim), raster order (frame, row, column)
    rope: tuple[torch.Tensor, torch.Tensor]  # cos, sin float32 (video tokens, head_dim), pairs interleaved
    context: torch.Tensor  # (B, text tokens, dim): the projected text, whole on every rank
    context_image: torch.Tensor | None  # (B, image tokens, dim): projected CLIP features, or None
    temb: torch.Tensor | None  # (B, dim), one timestep per sample
    modulation: torch.Tensor | None  # (B, 6, dim)
    token_temb: torch.Tensor | None  # (B, video tokens, dim), one timestep per token
    token_modulation: torch.Tensor | None  # (B, video tokens, 6, dim)
    grid: tuple[int, int, int]  # the video's tokens (frames, rows, columns): sparse self-attention's mask reads it


class WanTransformer(StagedTransformer):
    BLOCK_LISTS: ClassVar[tuple[str, ...]] = ("blocks",)

    def __init__(self, config: WanConfig) -> None:
        super().__init__(config)
        dim, patch = config.inner_dim, config.patch_size
        if len(patch) != 3:
            raise ValueError(f"patch_size {patch} must be (frames, height, width)")
        self.patch_embedding = nn.Conv3d(config.in_channels, dim, kernel_size=patch, stride=patch)
        self.condition_embedder = ConditionEmbedder(config)
        self.blocks = nn.ModuleList(WanBlock(config) for _ in range(config.num_layers))
        self.norm_out = FP32LayerNorm(dim, config.eps, elementwise_affine=False)
        self.proj_out = nn.Linear(dim, config.output_channels * math.prod(patch))
        self.scale_shift_table = nn.Parameter(torch.empty(1, 2, dim))

    def rope(self, grid: tuple[int, int, int], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin (frames * rows * cols, head_dim): each axis rotates its ``rope_axes`` channels by its own index."""
        if max(grid) > self.config.rope_max_seq_len:
            raise ValueError(f"token grid {grid} exceeds rope_max_seq_len {self.config.rope_max_seq_len}")
        ids = torch.cartesian_prod(*(torch.arange(n, device=device) for n in grid))
        return multi_axis_rope(ids, self.config.rope_axes, ROPE_THETA)

    def embed(
        self,
        hidden_states: torch.Tensor,
        timestep: torch.Tensor,
        encoder_hidden_states: torch.Tensor,
        encoder_hidden_states_image: torch.Tensor | None = None,
    ) -> WanTokens:
        """``timestep``: (B,) in [0, 1000], or (B, video tokens); the text features zero-padded, unmasked."""
        config = self.config
        *_, frames, height, width = hidden_states.shape
        if any(n % p for n, p in zip((frames, height, width), config.patch_size)):
            raise ValueError(f"latents {(frames, height, width)} are not a multiple of the patch {config.patch_size}")
        grid = config.token_grid(frames, height, width)
        video = self.patch_embedding(hidden_states).flatten(2).transpose(1, 2).contiguous()

        embedder = self.condition_embedder
        dtype = encoder_hidden_states.dtype
        temb = modulation = token_temb = token_modulation = None
        if timestep.ndim == 2:
            # One row per token through the time MLPs, as the reference does: (B * tokens,) -> (B, tokens, ...).
            rows = embedder.time(timestep.flatten(), dtype)
            token_temb, token_modulation = (t.unflatten(0, timestep.shape) for t in rows)
        else:
            temb, modulation = embedder.time(timestep, dtype)

        context_image = None
        if encoder_hidden_states_image is not None:  # the pipeline never passes it: Wan 2.2 has no CLIP image encoder
            context_image = embedder.image_embedder(encoder_hidden_states_image)
        return WanTokens(
            video=video,
            rope=self.rope(grid, hidden_states.device),
            context=embedder.text_embedder(encoder_hidden_states),
            context_image=context_image,
            temb=temb,
            modulation=modulation,
            token_temb=token_temb,
            token_modulation=token_modulation,
            grid=grid,
        )

    def run_blocks(self, tokens: WanTokens) -> WanTokens:
        modulation = tokens.modulation[:, None] if tokens.token_modulation is None else tokens.token_modulation
        x = tokens.video
        with video_grid(tokens.grid):
            for block in self.blocks:
                x = block(x, tokens.context, tokens.context_image, modulation, tokens.rope)
        return dataclasses.replace(tokens, video=x)

    def head(self, tokens: WanTokens) -> torch.Tensor:
        """(B, video tokens, p_t * p_h * p_w * out_channels); ``unpatchify(out, grid, patch)`` gives (B, C, F, H, W)."""
        temb = tokens.temb[:, None] if tokens.token_temb is None else tokens.token_temb
        # (1, 1, 2, dim) + (B, 1 or tokens, 1, dim) in float32, as the reference's float32 table promotes it.
        shift, scale = (self.scale_shift_table.float()[None] + temb.float()[:, :, None]).unbind(2)
        x = tokens.video
        return self.proj_out((self.norm_out(x.float()) * (1 + scale) + shift).to(x.dtype))
