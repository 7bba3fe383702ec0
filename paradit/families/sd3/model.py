"""Stable Diffusion 3 / 3.5 transformer (MMDiT, MMDiT-X): diffusers' ``SD3Transformer2DModel``. Positions are cropped
sin-cos tables; SD3.5-medium's first joint blocks add image-only attention, and the last leaves the text as it is."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import nn

from paradit.errors import CheckpointError
from paradit.layers import stages
from paradit.layers.attention import JointAttention, QKVAttention
from paradit.layers.embeddings import TimestepEmbed
from paradit.layers.feedforward import GeluFeedForward
from paradit.layers.modulation import AdaLayerNormOut, Modulation, split_modulation
from paradit.layers.stages import HeadsConfig, StagedTransformer

EPS = 1e-6  # every norm of the published model, qk norms included


@dataclass(frozen=True)
class SD3Config(HeadsConfig):
    sample_size: int = 128
    patch_size: int = 2
    in_channels: int = 16
    num_layers: int = 18
    attention_head_dim: int = 64
    num_attention_heads: int = 18
    joint_attention_dim: int = 4096
    caption_projection_dim: int = 1152
    pooled_projection_dim: int = 2048
    out_channels: int | None = 16
    pos_embed_max_size: int = 96
    dual_attention_layers: tuple[int, ...] = ()
    qk_norm: str | None = None

    @classmethod
    def from_dict(cls, config: dict[str, Any]) -> SD3Config:
        if config.get("qk_norm") not in (None, "rms_norm"):
            raise CheckpointError(
                f"qk_norm {config['qk_norm']!r} is not supported; SD3 checkpoints use None or 'rms_norm'"
            )
        return super().from_dict(config)


def sincos_position_table(dim: int, grid: int, base_size: int) -> torch.Tensor:
    """(1, grid * grid, dim) row-major 2-D [sin, cos] table, the column in the first half of the channels, the row
    in the second; positions rescaled so ``base_size`` span ``grid``, float64 angles of float32 ones, as published."""
    positions = torch.arange(grid, dtype=torch.float32) / (grid / base_size)
    exponents = torch.arange(dim // 4, dtype=torch.float64) / (dim / 4)
    angles = torch.outer(positions.double(), 1.0 / 10000**exponents)
    axis = torch.cat([angles.sin(), angles.cos()], dim=1)
    columns = axis[None, :, :].expand(grid, grid, -1)
    rows = axis[:, None, :].expand(grid, grid, -1)
    return torch.cat([columns, rows], dim=-1).reshape(1, grid * grid, dim).float()


class PatchEmbed(nn.Module):
    """Patch projection plus the centred window of a fixed ``max_size`` x ``max_size`` table (``pos_embed``)."""

    def __init__(self, config: SD3Config) -> None:
        super().__init__()
        self.patch_size = config.patch_size
        self.max_size = config.pos_embed_max_size
        self.base_size = config.sample_size // config.patch_size
        self.proj = nn.Conv2d(
            config.in_channels, config.inner_dim, kernel_size=config.patch_size, stride=config.patch_size
        )
        self.register_buffer("pos_embed", torch.empty(1, self.max_size**2, config.inner_dim))
        # Built on the meta device (memory estimates, loading), the table holds no values to compute, and computing
        # them there would run torch's Python decompositions, which import torch._dynamo.
        if not self.pos_embed.is_meta:
            self.fill_position_table()

    @torch.no_grad()
    def fill_position_table(self) -> None:
        """Recompute the fixed table in place: random-weight ("dummy") initialisation zeroes every buffer."""
        table = sincos_position_table(self.pos_embed.shape[-1], self.max_size, self.base_size)
        self.pos_embed.copy_(table.to(self.pos_embed.device, self.pos_embed.dtype))

    def forward(self, latents: torch.Tensor) -> torch.Tensor:
        rows, cols = latents.shape[-2] // self.patch_size, latents.shape[-1] // self.patch_size
        tokens = self.proj(latents).flatten(2).transpose(1, 2)
        top, left = (self.max_size - rows) // 2, (self.max_size - cols) // 2
        table = self.pos_embed.view(self.max_size, self.max_size, -1)[top : top + rows, left : left + cols]
        # The sum is formed in the table's precision (float32 for a float32 table), then cast, as the reference does.
        return (tokens + table.reshape(1, rows * cols, -1)).to(tokens.dtype)


class AdaLayerNormZero(Modulation):
    """The modulation triples (attention's, the MLP's, dual attention's image-only one) and their LayerNorm."""

    def __init__(self, dim: int, sets: int) -> None:
        super().__init__(dim, sets)
        self.norm = nn.LayerNorm(dim, elementwise_affine=False, eps=EPS)

    def forward(self, temb: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        return split_modulation(super().forward(temb), self.sets)


class JointTransformerBlock(nn.Module):
    """MMDiT block: adaLN-Zero and MLPs per stream, joint attention. ``dual_attention`` adds image-only attention
    (MMDiT-X); ``context_pre_only`` (last block) gives the text a plain adaptive LayerNorm and no update (unread)."""

    def __init__(self, config: SD3Config, context_pre_only: bool, dual_attention: bool) -> None:
        super().__init__()
        dim, head_dim = config.inner_dim, config.attention_head_dim
        qk_norm = functools.partial(nn.RMSNorm, eps=EPS) if config.qk_norm == "rms_norm" else nn.Identity
        self.context_pre_only = context_pre_only
        self.norm1 = AdaLayerNormZero(dim, sets=3 if dual_attention else 2)
        self.norm1_context = AdaLayerNormOut(dim, dim, eps=EPS) if context_pre_only else AdaLayerNormZero(dim, sets=2)
        self.attn = JointAttention(dim, head_dim, qk_norm, text_first=False, context_pre_only=context_pre_only)
        self.attn2 = QKVAttention(dim, head_dim, qk_norm, sequence_streams=("img",)) if dual_attention else None
        self.norm2 = nn.LayerNorm(dim, elementwise_affine=False, eps=EPS)
        self.ff = GeluFeedForward(dim, 4 * dim, dim)
        if not context_pre_only:
            self.norm2_context = nn.LayerNorm(dim, elementwise_affine=False, eps=EPS)
            self.ff_context = GeluFeedForward(dim, 4 * dim, dim)

    def forward(
        self, img: torch.Tensor, txt: torch.Tensor, temb: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        (shift_a, scale_a, gate_a), (shift_m, scale_m, gate_m), *image_only = self.norm1(temb)
        img_normed = self.norm1.norm(img)
        if self.context_pre_only:
            txt_in = self.norm1_context(txt, temb)
        else:
            (c_shift_a, c_scale_a, c_gate_a), (c_shift_m, c_scale_m, c_gate_m) = self.norm1_context(temb)
            txt_in = self.norm1_context.norm(txt) * (1 + c_scale_a) + c_shift_a
        img_attn, txt_attn = self.attn(img_normed * (1 + scale_a) + shift_a, txt_in)
        img = img + gate_a * img_attn
        if self.attn2 is not None:
            ((shift_a2, scale_a2, gate_a2),) = image_only
            img = img + gate_a2 * self.attn2(img_normed * (1 + scale_a2) + shift_a2)
        img = img + gate_m * self.ff(self.norm2(img) * (1 + scale_m) + shift_m)
        if self.context_pre_only:
            return img, None
        txt = txt + c_gate_a * txt_attn
        txt = txt + c_gate_m * self.ff_context(self.norm2_context(txt) * (1 + c_scale_m) + c_shift_m)
        return img, txt


@dataclass
class SD3Tokens:
    """``txt`` is None once the last block, which does not update it, has run."""

    SEQUENCE_FIELDS: ClassVar[dict[str, tuple[str, int]]] = {"img": ("img", 1), "txt": ("txt", 1)}
    OUTPUT_STREAM: ClassVar[str] = "img"

    img: torch.Tensor
    txt: torch.Tensor | None
    temb: torch.Tensor


class SD3Transformer(StagedTransformer):
    BLOCK_LISTS: ClassVar[tuple[str, ...]] = ("transformer_blocks",)

    def __init__(self, config: SD3Config) -> None:
        super().__init__(config)
        dim = config.inner_dim
        self.pos_embed = PatchEmbed(config)
        self.time_text_embed = TimestepEmbed(dim, pooled_dim=config.pooled_projection_dim)
        self.context_embedder = nn.Linear(config.joint_attention_dim, config.caption_projection_dim)
        last = config.num_layers - 1
        self.transformer_blocks = nn.ModuleList(
            JointTransformerBlock(config, context_pre_only=i == last, dual_attention=i in config.dual_attention_layers)
            for i in range(config.num_layers)
        )
        self.norm_out = AdaLayerNormOut(dim, dim, eps=EPS)
        self.proj_out = nn.Linear(dim, config.patch_size**2 * config.output_channels)

    def embed(
        self,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor,
        pooled_projections: torch.Tensor,
        timestep: torch.Tensor,
    ) -> SD3Tokens:
        """``hidden_states``: latents (batch, channels, height, width); ``timestep``: per sample, 0-1000."""
        return SD3Tokens(
            img=self.pos_embed(hidden_states).contiguous(),
            txt=self.context_embedder(encoder_hidden_states),
            temb=self.time_text_embed(timestep, pooled_projections.dtype, pooled=pooled_projections),
        )

    def run_blocks(self, tokens: SD3Tokens) -> SD3Tokens:
        for block in self.transformer_blocks:
            tokens.img, tokens.txt = block(tokens.img, tokens.txt, tokens.temb)
        return tokens


def unpatchify(patches: torch.Tensor, patch_size: int, height: int, width: int) -> torch.Tensor:
    """(batch, tokens, p * p * channels) from ``head`` -> (batch, channels, height, width) latents."""
    return stages.unpatchify(patches, (height // patch_size, width // patch_size), (patch_size, patch_size))
