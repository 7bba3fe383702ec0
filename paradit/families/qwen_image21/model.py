"""Qwen-Image 2.1's transformer (32 single-stream blocks, one shared modulation): diffusers'
``QwenImage21Transformer2DModel``.

Its sequence is [text | condition images | target], text and condition images interleaved as the prompt encoder
placed them. Attention is block-causal: a token sees every earlier token and, in an image, its own image whole. Text
and condition images are modulated at t = 0, so nothing of theirs depends on the step: ``encode_prefix`` runs them
once per request and keeps each block's keys and values, and the denoise steps run the target's tokens alone, which
see the whole prefix (the block-causal mask is all ones for them), as diffusers' cached mode does. What a rank keeps
of the prefix, and how its queries attend it, the parallel runtime sets on each ``PrefixAttention``
(``layers/prefix_attention.py``)."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from paradit.errors import CheckpointError
from paradit.layers.attention import QKVAttention
from paradit.layers.embeddings import TimestepEmbed
from paradit.layers.modulation import clip_fp16
from paradit.layers.prefix_attention import CachedPrefix, PrefixCaching
from paradit.layers.rotary import multi_axis_rope, rotate_qk
from paradit.layers.stages import HeadsConfig, StagedTransformer

ROPE_THETA = 10000
TIME_CHANNELS = 256
# Each of the prompt encoder's image slots stands for 2x2 latent tokens (its merged 32-pixel patch, the VAE's 16x).
TOKENS_PER_SLOT = 4

KeyValue = tuple[torch.Tensor, torch.Tensor]  # one block's prefix keys and values, (batch, prefix, heads, head_dim)


@dataclass(frozen=True)
class QwenImage21Config(HeadsConfig):
    patch_size: int = 1
    in_channels: int = 64
    out_channels: int | None = 64
    num_layers: int = 32
    attention_head_dim: int = 128
    num_attention_heads: int = 32
    context_in_dim: int = 4096
    mlp_ratio: int = 3
    axes_dims_rope: tuple[int, int, int] = (16, 56, 56)
    eps: float = 1e-6
    causal_condition: bool = True

    @classmethod
    def from_dict(cls, config: dict[str, Any]) -> QwenImage21Config:
        if not config.get("causal_condition", True):
            # Without it the prefix is modulated at each step's timestep: nothing to cache, another model to run.
            raise CheckpointError(
                "transformer config sets causal_condition false: paradit serves Qwen-Image 2.1 with its text and "
                "condition images modulated at t = 0, as published"
            )
        if config.get("patch_size", 1) != 1:
            raise CheckpointError("transformer config sets patch_size != 1: Qwen-Image 2.1 reads latents unpatched")
        return super().from_dict(config)


def centred_grid(frame: int, rows: int, cols: int) -> list[tuple[int, int, int]]:
    """Row-major (frame, row, column) positions of a rows x cols image: side n spans -(n - n // 2) .. n // 2 - 1."""
    return [
        (frame, row, col)
        for row in range(-(rows - rows // 2), rows // 2)
        for col in range(-(cols - cols // 2), cols // 2)
    ]


@dataclass(frozen=True)
class PrefixLayout:
    """Where the prefix's tokens sit: (tokens, 3) rotary positions, (tokens,) image index (-1: text), and the frame
    position the target takes after them."""

    positions: torch.Tensor
    image_index: torch.Tensor
    target_frame: int


def prefix_layout(image_slots: list[bool], grids: tuple[tuple[int, int], ...], device: torch.device) -> PrefixLayout:
    """Text advances one position on every axis; an image holds the frame axis where the text reached, lays its tokens
    on a centred grid, and moves the position on by its longer side. Images are told apart by ``grids``' token counts,
    not by runs of slots: two images may sit next to each other."""
    positions: list[tuple[int, int, int]] = []
    image_index: list[int] = []
    position, slot, image = 0, 0, 0
    while slot < len(image_slots):
        if not image_slots[slot]:
            positions.append((position, position, position))
            image_index.append(-1)
            position, slot = position + 1, slot + 1
            continue
        if image == len(grids):
            raise ValueError(f"the prompt holds more image slots than the {len(grids)} condition images fill")
        rows, cols = grids[image]
        slots = rows * cols // TOKENS_PER_SLOT
        if not all(image_slots[slot : slot + slots]):
            raise ValueError(f"condition image {image + 1} ({rows}x{cols} tokens) does not fill its {slots} slots")
        positions.extend(centred_grid(position, rows, cols))
        image_index.extend([image] * (rows * cols))
        position, slot, image = position + max(rows, cols), slot + slots, image + 1
    if image != len(grids):
        raise ValueError(f"the prompt holds slots for {image} of its {len(grids)} condition images")
    return PrefixLayout(
        torch.tensor(positions, device=device).view(-1, 3),
        torch.tensor(image_index, device=device),
        position,
    )


def block_causal_mask(image_index: torch.Tensor, key_mask: torch.Tensor | None) -> torch.Tensor:
    """(batch or 1, 1, q, k) bool: a query sees the keys before it and, in an image, all of its own image's."""
    order = torch.arange(image_index.shape[0], device=image_index.device)
    same_image = (image_index[:, None] == image_index[None, :]) & (image_index[:, None] >= 0)
    allowed = (order[:, None] >= order[None, :]) | same_image
    if key_mask is None:
        return allowed[None, None]
    return allowed[None, None] & key_mask[:, None, None, :]


class ZeroCentredRMSNorm(nn.Module):
    """RMSNorm in float32 whose weight is stored as scale - 1 (diffusers' ``QwenImage21ZeroCenterRMSNorm``)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        wide = x.float()
        normed = wide * torch.rsqrt(wide.pow(2).mean(dim=-1, keepdim=True) + self.eps)
        return (normed * (self.weight.float() + 1)).to(x.dtype)


class TextProjection(nn.Module):
    def __init__(self, context_dim: int, dim: int, eps: float) -> None:
        super().__init__()
        self.text_norm = ZeroCentredRMSNorm(context_dim, eps)
        self.in_layer = nn.Linear(context_dim, dim, bias=False)
        self.out_layer = nn.Linear(dim, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out_layer(F.gelu(self.in_layer(self.text_norm(x)), approximate="tanh"))


class SwiGLU(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.proj = nn.Linear(dim, hidden, bias=False)
        self.gate_layer = nn.Linear(dim, hidden, bias=False)
        self.out = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(F.silu(self.gate_layer(x)) * self.proj(x))


class PrefixAttention(PrefixCaching, QKVAttention):
    """Self-attention whose keys and values start with the prefix's, kept from ``encode_prefix``; the target's own
    tokens are its one split stream."""

    def __init__(self, dim: int, head_dim: int, eps: float) -> None:
        norm = functools.partial(nn.RMSNorm, eps=eps)
        super().__init__(dim, head_dim, norm, bias=False, sequence_streams=("img",))
        self.heads = dim // head_dim  # the tensor plan divides it by its degree (local_attributes)

    def rotated_qkv(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, ...]:
        q, k, v = self.qkv(x)
        q, k = rotate_qk(q, k, rope)
        return q, k, v

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], prefix: CachedPrefix) -> torch.Tensor:
        q, k, v = self.rotated_qkv(x, rope)
        return self.to_out[0](self.attend_after(prefix, q, k, v).flatten(2).to(q.dtype))

    def attend_prefix(
        self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], mask: torch.Tensor
    ) -> tuple[torch.Tensor, KeyValue]:
        """The prefix under its block-causal ``mask`` ((batch or 1, 1, q, k) bool), once per request; its keys and
        values for the steps."""
        q, k, v = self.rotated_qkv(x, rope)
        return self.to_out[0](self.masked_attention_fn(q, k, v, mask).flatten(2).to(q.dtype)), (k, v)


Modulation = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]  # attention's scale, gate; MLP's, (B, 1, D)


class QwenImage21TransformerBlock(nn.Module):
    """No modulation of its own: every block reads the model's one shared (scale, gate) pairs, without shifts."""

    def __init__(self, config: QwenImage21Config, index: int) -> None:
        super().__init__()
        dim = config.inner_dim
        self.index = index  # its place in the whole stack, which keys its cached prefix in any slice of the stack
        self.img_norm1 = nn.LayerNorm(dim, elementwise_affine=False, eps=config.eps)
        self.attn = PrefixAttention(dim, config.attention_head_dim, config.eps)
        self.img_norm2 = nn.LayerNorm(dim, elementwise_affine=False, eps=config.eps)
        self.img_mlp = SwiGLU(dim, dim * config.mlp_ratio)

    def finish(self, x: torch.Tensor, attn: torch.Tensor, modulation: Modulation) -> torch.Tensor:
        _, attn_gate, mlp_scale, mlp_gate = modulation
        x = x + attn_gate.tanh() * attn
        x = x + mlp_gate.tanh() * self.img_mlp(self.img_norm2(x) * (1 + mlp_scale))
        return clip_fp16(x)

    def forward(
        self,
        x: torch.Tensor,
        modulation: Modulation,
        rope: tuple[torch.Tensor, torch.Tensor],
        prefix: CachedPrefix,
    ) -> torch.Tensor:
        attn = self.attn(self.img_norm1(x) * (1 + modulation[0]), rope, prefix)
        return self.finish(x, attn, modulation)

    def run_prefix(
        self, x: torch.Tensor, modulation: Modulation, rope: tuple[torch.Tensor, torch.Tensor], mask: torch.Tensor
    ) -> tuple[torch.Tensor, KeyValue]:
        attn, kv = self.attn.attend_prefix(self.img_norm1(x) * (1 + modulation[0]), rope, mask)
        return self.finish(x, attn, modulation), kv


@dataclass(frozen=True)
class QwenImage21Prefix:
    """A request's text and condition images, run once: each block's keys and values as this rank keeps them, with
    the prompt's padding (``kv`` keyed by the block's index, so that a step cache's or a pipeline stage's slice of the
    blocks reads its own), and the target's frame position."""

    kv: dict[int, CachedPrefix]
    target_frame: int


@dataclass
class QwenImage21PrefixTokens:
    """The prefix on its way through the blocks at t = 0: its ``hidden`` states (what a pipeline stage passes on),
    what every block reads (the block-causal ``mask``; ``key_mask`` (batch, prefix) False at padding, None: none),
    and each block's keys and values as kept so far. A ring splits its ``hidden`` rows, their rotary rows and the
    mask's query rows."""

    SEQUENCE_FIELDS: ClassVar[dict[str, tuple[str, int]]] = {
        "hidden": ("hidden", 1),
        "rope": ("hidden", 0),
        "mask": ("hidden", 2),
    }

    hidden: torch.Tensor
    modulation: Modulation
    rope: tuple[torch.Tensor, torch.Tensor]
    mask: torch.Tensor
    key_mask: torch.Tensor | None
    target_frame: int
    kept: dict[int, CachedPrefix]


@dataclass
class QwenImage21Tokens:
    """The target's tokens; the prefix rides along as kept (every target token attends to all of it)."""

    SEQUENCE_FIELDS: ClassVar[dict[str, tuple[str, int]]] = {"img": ("img", 1), "img_rope": ("img", 0)}
    OUTPUT_STREAM: ClassVar[str] = "img"

    img: torch.Tensor
    img_rope: tuple[torch.Tensor, torch.Tensor]
    temb: torch.Tensor
    modulation: Modulation
    prefix: QwenImage21Prefix


class QwenImage21Transformer(StagedTransformer):
    BLOCK_LISTS: ClassVar[tuple[str, ...]] = ("transformer_blocks",)

    def __init__(self, config: QwenImage21Config) -> None:
        super().__init__(config)
        dim = config.inner_dim
        self.time_text_embed = TimestepEmbed(dim, TIME_CHANNELS, bias=False)
        self.txt_in = TextProjection(config.context_in_dim, dim, config.eps)
        self.img_in = nn.Linear(config.in_channels * config.patch_size**2, dim, bias=False)
        self.modulation = nn.Sequential(nn.SiLU(), nn.Linear(dim, 4 * dim, bias=False))
        self.transformer_blocks = nn.ModuleList(
            QwenImage21TransformerBlock(config, index) for index in range(config.num_layers)
        )
        self.norm_out = ScaleOnlyNormOut(dim, config.eps)
        self.proj_out = nn.Linear(dim, config.patch_size**2 * config.output_channels, bias=False)

    def conditioning(self, timestep: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, Modulation]:
        """``timestep``: sigma in [0, 1] per sample, cast to ``dtype`` then scaled by 1000 in float32 as diffusers."""
        temb = self.time_text_embed(timestep.to(dtype).float() * 1000, dtype)
        scales_gates = self.modulation(temb).unsqueeze(1).chunk(4, dim=-1)
        return temb, scales_gates

    def rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # Float32 angles as diffusers forms them (its tables index float32 products).
        return multi_axis_rope(positions, self.config.axes_dims_rope, ROPE_THETA, torch.float32)

    def encode_prefix(
        self,
        encoder_hidden_states: torch.Tensor,
        image_slots: torch.Tensor,
        encoder_hidden_states_mask: torch.Tensor | None = None,
        condition_latents: torch.Tensor | None = None,
        condition_grids: tuple[tuple[int, int], ...] = (),
    ) -> QwenImage21Prefix:
        """The prompt encoder's (batch, slots, channels) states, ``image_slots`` (slots,) True where a condition
        image's 2x2 token groups go (filled with ``condition_latents`` (1 or batch, tokens, channels), raster order
        image by image), the mask (batch, slots) True at real tokens; run through every block at t = 0."""
        args = (encoder_hidden_states, image_slots, encoder_hidden_states_mask, condition_latents, condition_grids)
        return self.cached_prefix(self.run_prefix_blocks(self.embed_prefix(*args)))

    def embed_prefix(
        self,
        encoder_hidden_states: torch.Tensor,
        image_slots: torch.Tensor,
        encoder_hidden_states_mask: torch.Tensor | None = None,
        condition_latents: torch.Tensor | None = None,
        condition_grids: tuple[tuple[int, int], ...] = (),
    ) -> QwenImage21PrefixTokens:
        """``encode_prefix``'s inputs, before the blocks."""
        batch, device = encoder_hidden_states.shape[0], encoder_hidden_states.device
        layout = prefix_layout(image_slots.tolist(), condition_grids, device)
        repeats = torch.where(image_slots, TOKENS_PER_SLOT, 1)
        x = self.txt_in(encoder_hidden_states).repeat_interleave(repeats, dim=1)
        is_image = layout.image_index >= 0
        if condition_latents is not None:
            x[:, is_image] = self.img_in(condition_latents).expand(batch, -1, -1).to(x.dtype)
        key_mask = None
        if encoder_hidden_states_mask is not None and not bool(encoder_hidden_states_mask.all()):
            key_mask = encoder_hidden_states_mask.to(torch.bool).repeat_interleave(repeats, dim=1) | is_image
        mask = block_causal_mask(layout.image_index, key_mask)
        _, modulation = self.conditioning(torch.zeros(1, device=device), x.dtype)
        return QwenImage21PrefixTokens(
            x, modulation, self.rope(layout.positions), mask, key_mask, layout.target_frame, {}
        )

    def run_prefix_blocks(self, tokens: QwenImage21PrefixTokens) -> QwenImage21PrefixTokens:
        for block in self.transformer_blocks:
            tokens.hidden, (key, value) = block.run_prefix(tokens.hidden, tokens.modulation, tokens.rope, tokens.mask)
            tokens.kept[block.index] = block.attn.keep_prefix(key, value, tokens.key_mask)
        return tokens

    def cached_prefix(self, tokens: QwenImage21PrefixTokens) -> QwenImage21Prefix:
        return QwenImage21Prefix(dict(tokens.kept), tokens.target_frame)

    def embed(
        self, hidden_states: torch.Tensor, timestep: torch.Tensor, rows: int, cols: int, prefix: QwenImage21Prefix
    ) -> QwenImage21Tokens:
        """The target's (batch, rows * cols, channels) latents, raster order; ``timestep``: sigma in [0, 1]."""
        img = self.img_in(hidden_states)
        temb, modulation = self.conditioning(timestep, img.dtype)
        positions = torch.tensor(centred_grid(prefix.target_frame, rows, cols), device=img.device)
        return QwenImage21Tokens(img, self.rope(positions), temb, modulation, prefix)

    def run_blocks(self, tokens: QwenImage21Tokens) -> QwenImage21Tokens:
        for block in self.transformer_blocks:
            tokens.img = block(tokens.img, tokens.modulation, tokens.img_rope, tokens.prefix.kv[block.index])
        return tokens


class ScaleOnlyNormOut(nn.Module):
    """diffusers' ``QwenImage21AdaLayerNormContinuous``: the conditioning scales the normed output, no shift."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.linear = nn.Linear(dim, dim, bias=False)
        self.norm = nn.LayerNorm(dim, eps=eps, elementwise_affine=False, bias=False)

    def forward(self, x: torch.Tensor, cond: torch.Tensor) -> torch.Tensor:
        return self.norm(x) * (1 + self.linear(F.silu(cond).to(x.dtype))[:, None, :])
