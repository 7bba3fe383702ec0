"""Qwen-Image transformer (MMDiT with 60 dual-stream blocks): diffusers' ``QwenImageTransformer2DModel``."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import nn

from paradit.errors import CheckpointError
from paradit.layers.attention import JointAttention, joint_key_mask
from paradit.layers.embeddings import TimestepEmbed
from paradit.layers.feedforward import GeluFeedForward
from paradit.layers.modulation import AdaLayerNormOut, clip_fp16, split_modulation
from paradit.layers.rotary import multi_axis_rope
from paradit.layers.stages import HeadsConfig, JointTokens, StagedTransformer

ROPE_THETA = 10000
EPS = 1e-6

# Only the layered / distilled variants of the diffusers class turn these on; with one on it is another model.
_VARIANT_SWITCHES = ("guidance_embeds", "use_additional_t_cond", "use_layer3d_rope")


@dataclass(frozen=True)
class QwenImageConfig(HeadsConfig):
    patch_size: int = 2
    in_channels: int = 64
    out_channels: int | None = 16
    num_layers: int = 60
    attention_head_dim: int = 128
    num_attention_heads: int = 24
    joint_attention_dim: int = 3584
    axes_dims_rope: tuple[int, int, int] = (16, 56, 56)
    # Qwen-Image-Edit-2511: the input images' tokens are modulated as at timestep 0, the target's at the step's.
    zero_cond_t: bool = False

    @classmethod
    def from_dict(cls, config: dict[str, Any]) -> QwenImageConfig:
        switched_on = [name for name in _VARIANT_SWITCHES if config.get(name)]
        if switched_on:
            raise CheckpointError(
                f"transformer config sets {', '.join(switched_on)}: a Qwen-Image variant paradit does not serve "
                "(the text-to-image and edit models have all of these off)"
            )
        return super().from_dict(config)


def image_positions(grids: tuple[tuple[int, int], ...], device: torch.device) -> torch.Tensor:
    """(sum of rows * cols, 3) row-major (frame, row, column) positions of each (rows, cols) grid in turn, grid i at
    frame i (the target, then the edit's input images), centred: side n spans -(n - n // 2) .. n // 2 - 1."""
    positions = []
    for frame, (rows, cols) in enumerate(grids):
        row = torch.arange(rows, device=device) - (rows - rows // 2)
        col = torch.arange(cols, device=device) - (cols - cols // 2)
        positions.append(torch.cartesian_prod(torch.tensor([frame], device=device), row, col))
    return torch.cat(positions)


def text_positions(grids: tuple[tuple[int, int], ...], text_len: int, device: torch.device) -> torch.Tensor:
    """(text_len, 3) positions of the text tokens, counting on from the largest half-side of any grid on every axis."""
    start = max(max(rows // 2, cols // 2) for rows, cols in grids)
    return torch.arange(start, start + text_len, device=device)[:, None].expand(-1, 3)


class QwenImageTransformerBlock(nn.Module):
    def __init__(self, config: QwenImageConfig) -> None:
        super().__init__()
        dim, head_dim = config.inner_dim, config.attention_head_dim
        self.img_mod = nn.Sequential(nn.SiLU(), nn.Linear(dim, 6 * dim))
        self.img_norm1 = nn.LayerNorm(dim, elementwise_affine=False, eps=EPS)
        self.attn = JointAttention(dim, head_dim, functools.partial(nn.RMSNorm, eps=EPS))
        self.img_norm2 = nn.LayerNorm(dim, elementwise_affine=False, eps=EPS)
        self.img_mlp = GeluFeedForward(dim, 4 * dim, dim)
        self.txt_mod = nn.Sequential(nn.SiLU(), nn.Linear(dim, 6 * dim))
        self.txt_norm1 = nn.LayerNorm(dim, elementwise_affine=False, eps=EPS)
        self.txt_norm2 = nn.LayerNorm(dim, elementwise_affine=False, eps=EPS)
        self.txt_mlp = GeluFeedForward(dim, 4 * dim, dim)

    def forward(
        self,
        img: torch.Tensor,
        txt: torch.Tensor,
        temb: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        key_mask: torch.Tensor | None,
        input_images: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``input_images`` (``zero_cond_t``): the timestep-0 embedding; (batch, img, 1) True where it modulates."""
        img_mods = split_modulation(self.img_mod(temb), 2)
        if input_images is not None:
            still, chosen = input_images
            img_mods = [
                tuple(torch.where(chosen, at_zero, at_t) for at_t, at_zero in zip(mods, mods_zero))
                for mods, mods_zero in zip(img_mods, split_modulation(self.img_mod(still), 2))
            ]
        (shift_a, scale_a, gate_a), (shift_m, scale_m, gate_m) = img_mods
        (c_shift_a, c_scale_a, c_gate_a), (c_shift_m, c_scale_m, c_gate_m) = split_modulation(self.txt_mod(temb), 2)
        img_in = self.img_norm1(img) * (1 + scale_a) + shift_a
        img_attn, txt_attn = self.attn(img_in, self.txt_norm1(txt) * (1 + c_scale_a) + c_shift_a, rope, key_mask)
        img = img + gate_a * img_attn
        txt = txt + c_gate_a * txt_attn
        img = img + gate_m * self.img_mlp(self.img_norm2(img) * (1 + scale_m) + shift_m)
        txt = txt + c_gate_m * self.txt_mlp(self.txt_norm2(txt) * (1 + c_scale_m) + c_shift_m)
        return clip_fp16(img), clip_fp16(txt)


@dataclass
class QwenImageTokens(JointTokens):
    SEQUENCE_FIELDS: ClassVar[dict[str, tuple[str, int]]] = {
        **JointTokens.SEQUENCE_FIELDS,
        "txt_mask": ("txt", 1),
        "input_image_rows": ("img", 1),
    }

    # (batch, text) bool, True for real tokens; None when nothing is padded, so attention runs unmasked (fast kernels).
    txt_mask: torch.Tensor | None
    temb: torch.Tensor
    # zero_cond_t with input images: (batch, img, 1) bool, True for their tokens, and the timestep-0 embedding.
    input_image_rows: torch.Tensor | None = None
    still_temb: torch.Tensor | None = None


class QwenImageTransformer(StagedTransformer):
    BLOCK_LISTS: ClassVar[tuple[str, ...]] = ("transformer_blocks",)

    def __init__(self, config: QwenImageConfig) -> None:
        super().__init__(config)
        dim = config.inner_dim
        self.time_text_embed = TimestepEmbed(dim)  # diffusers' QwenTimestepProjEmbeddings
        self.txt_norm = nn.RMSNorm(config.joint_attention_dim, eps=EPS)
        self.img_in = nn.Linear(config.in_channels, dim)
        self.txt_in = nn.Linear(config.joint_attention_dim, dim)
        self.transformer_blocks = nn.ModuleList(QwenImageTransformerBlock(config) for _ in range(config.num_layers))
        self.norm_out = AdaLayerNormOut(dim, dim, eps=EPS)
        self.proj_out = nn.Linear(dim, config.patch_size**2 * config.output_channels)

    def embed(
        self,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor,
        timestep: torch.Tensor,
        rows: int,
        cols: int,
        encoder_hidden_states_mask: torch.Tensor | None = None,
        input_grids: tuple[tuple[int, int], ...] = (),
    ) -> QwenImageTokens:
        """Packed latents, then an edit's input images' (of ``input_grids``); ``timestep``: sigma in [0, 1]."""
        img = self.img_in(hidden_states)
        text_len = encoder_hidden_states.shape[1]
        txt_mask = None if encoder_hidden_states_mask is None else encoder_hidden_states_mask.to(torch.bool)
        device, axes, grids = hidden_states.device, self.config.axes_dims_rope, ((rows, cols), *input_grids)
        temb = self.time_text_embed(timestep.to(img.dtype), img.dtype, scale=1000)
        input_image_rows = still_temb = None
        if self.config.zero_cond_t and input_grids:
            input_image_rows = (torch.arange(img.shape[1], device=device) >= rows * cols).view(1, -1, 1)
            input_image_rows = input_image_rows.expand(img.shape[0], -1, -1)
            still_temb = self.time_text_embed(torch.zeros_like(timestep, dtype=img.dtype), img.dtype, scale=1000)
        # Float32 angles as in the reference: its tables to an ulp, where float64 angles differ by ~1e-6 at 1024x1024.
        return QwenImageTokens(
            img=img,
            txt=self.txt_in(self.txt_norm(encoder_hidden_states)),
            img_rope=multi_axis_rope(image_positions(grids, device), axes, ROPE_THETA, torch.float32),
            txt_rope=multi_axis_rope(text_positions(grids, text_len, device), axes, ROPE_THETA, torch.float32),
            txt_mask=txt_mask,
            temb=temb,
            input_image_rows=input_image_rows,
            still_temb=still_temb,
        )

    def run_blocks(self, tokens: QwenImageTokens) -> QwenImageTokens:
        rope = tuple(torch.cat([t, i], dim=0) for t, i in zip(tokens.txt_rope, tokens.img_rope))
        key_mask = joint_key_mask(tokens.txt_mask, tokens.img, text_first=True)
        input_images = None if tokens.still_temb is None else (tokens.still_temb, tokens.input_image_rows)
        for block in self.transformer_blocks:
            tokens.img, tokens.txt = block(tokens.img, tokens.txt, tokens.temb, rope, key_mask, input_images)
        return tokens
