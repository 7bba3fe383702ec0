"""Qwen-Image transformer (MMDiT with 60 dual-stream blocks) as plain single-device math.

Parameter names are those of diffusers' ``QwenImageTransformer2DModel``, so published checkpoints load without key
surgery. The forward pass is three stages the parallel runtime can act between:

- ``embed``: packed latents, text embeddings (with their padding mask), timestep and the latent grid ->
  ``QwenImageTokens`` (image and text streams, their rotary tables, the text mask, the timestep embedding);
- ``run_blocks``: the dual-stream blocks, text and image meeting in joint attention over [text, image];
- ``head``: image tokens -> prediction.

Qwen-Image's rotary embedding is its own: image rows and columns are centred on 0 (negative above and left of the
centre), and text tokens sit on the diagonal just past the image's half-extent, the same position on every axis.

Every attention layer calls ``AttentionDispatch.attend``; nothing here knows about devices other than its own.
Must not import torch.distributed.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import nn

from paradit.errors import CheckpointError
from paradit.layers.attention import AttentionDispatch, joint_qkv
from paradit.layers.embeddings import TimestepMLP
from paradit.layers.norms import AdaLayerNormOut
from paradit.layers.rotary import apply_rope_interleaved

ROPE_THETA = 10000
TIMESTEP_CHANNELS = 256
EPS = 1e-6

# Switches of the diffusers class that only its edit / layered / distilled variants turn on; the text-to-image
# model has them all off, and a checkpoint with one on is a different model.
_VARIANT_SWITCHES = ("guidance_embeds", "zero_cond_t", "use_additional_t_cond", "use_layer3d_rope")


@dataclass(frozen=True)
class QwenImageConfig:
    """The keyword arguments of diffusers' ``QwenImageTransformer2DModel`` (its ``transformer/config.json``)."""

    patch_size: int = 2
    in_channels: int = 64
    out_channels: int | None = 16
    num_layers: int = 60
    attention_head_dim: int = 128
    num_attention_heads: int = 24
    joint_attention_dim: int = 3584
    axes_dims_rope: tuple[int, int, int] = (16, 56, 56)

    @classmethod
    def from_dict(cls, config: dict[str, Any]) -> QwenImageConfig:
        switched_on = [name for name in _VARIANT_SWITCHES if config.get(name)]
        if switched_on:
            raise CheckpointError(
                f"transformer config sets {', '.join(switched_on)}: a Qwen-Image variant paradit does not serve "
                "(the text-to-image model has all of these off)"
            )
        names = {f.name for f in dataclasses.fields(cls)}
        values = {k: v for k, v in config.items() if k in names}
        if "axes_dims_rope" in values:
            values["axes_dims_rope"] = tuple(values["axes_dims_rope"])
        return cls(**values)

    @property
    def inner_dim(self) -> int:
        return self.num_attention_heads * self.attention_head_dim


def image_positions(rows: int, cols: int, device: torch.device | None = None) -> torch.Tensor:
    """(rows * cols, 3) positions (frame, row, column) of the latent grid in row-major order, rows and columns
    centred: a side of n runs from -(n - n // 2) to n // 2 - 1."""
    row = torch.arange(rows, device=device) - (rows - rows // 2)
    col = torch.arange(cols, device=device) - (cols - cols // 2)
    frame = torch.zeros(1, dtype=row.dtype, device=device)
    return torch.cartesian_prod(frame, row, col)


def text_positions(rows: int, cols: int, text_len: int, device: torch.device | None = None) -> torch.Tensor:
    """(text_len, 3) positions of the text tokens: counting on from the image's largest half-side, on every axis."""
    start = max(rows // 2, cols // 2)
    return torch.arange(start, start + text_len, device=device)[:, None].expand(-1, 3)


def rope_tables(
    positions: torch.Tensor, axes_dims: tuple[int, ...], theta: float = ROPE_THETA
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables (seq, sum(axes_dims)) for (seq, n_axes) integer positions, each frequency repeated for the
    interleaved (real, imaginary) pair it rotates. Float32 angles, computed as the reference computes them: the
    tables agree with its to an ulp, where float64 angles would differ by ~1e-6 at 1024x1024."""
    cos_parts, sin_parts = [], []
    for axis, dim in enumerate(axes_dims):
        exponents = torch.arange(0, dim, 2, device=positions.device).to(torch.float32).div(dim)
        inv_freq = 1.0 / torch.pow(theta, exponents)
        angles = torch.outer(positions[:, axis].to(torch.float32), inv_freq)
        cos_parts.append(angles.cos().repeat_interleave(2, dim=1))
        sin_parts.append(angles.sin().repeat_interleave(2, dim=1))
    return torch.cat(cos_parts, dim=-1), torch.cat(sin_parts, dim=-1)


def timestep_features(sigma: torch.Tensor, channels: int = TIMESTEP_CHANNELS) -> torch.Tensor:
    """(N,) sigmas in [0, 1] -> (N, channels) cos/sin features of the timestep 1000 * sigma, in float32.

    The factor 1000 multiplies the angles after the frequency product, the reference's order (scaling sigma first
    rounds the fastest angles differently, by up to 6e-5 rad)."""
    half = channels // 2
    exponent = -math.log(10000) * torch.arange(half, dtype=torch.float32, device=sigma.device) / half
    angles = 1000 * (sigma[:, None].float() * torch.exp(exponent)[None, :])
    return torch.cat([angles.cos(), angles.sin()], dim=-1)


class TimestepProjection(nn.Module):
    """Sinusoidal features of the timestep lifted to the model width (diffusers' ``QwenTimestepProjEmbeddings``)."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.timestep_embedder = TimestepMLP(TIMESTEP_CHANNELS, dim)

    def forward(self, sigma: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return self.timestep_embedder(timestep_features(sigma).to(dtype))


class GeluProjection(nn.Module):
    """Linear then tanh-approximated GELU (diffusers' ``GELU`` activation module, which owns the projection)."""

    def __init__(self, dim: int, inner: int) -> None:
        super().__init__()
        self.proj = nn.Linear(dim, inner)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.gelu(self.proj(x), approximate="tanh")


class FeedForward(nn.Module):
    """4x GELU MLP. ``net`` keeps the checkpoint's indices: 0 the projection in, 2 the projection out; 1 is where
    training had its dropout, an identity at inference."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.net = nn.ModuleList([GeluProjection(dim, 4 * dim), nn.Identity(), nn.Linear(4 * dim, dim)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.net:
            x = layer(x)
        return x


class JointAttention(AttentionDispatch):
    """Attention over [text, image] with separate Q/K/V/out projections and QK RMS norms per stream."""

    def __init__(self, dim: int, heads: int, head_dim: int) -> None:
        super().__init__(sequence_streams=("txt", "img"))
        self.heads = heads
        self.head_dim = head_dim
        inner = heads * head_dim
        self.to_q = nn.Linear(dim, inner)
        self.to_k = nn.Linear(dim, inner)
        self.to_v = nn.Linear(dim, inner)
        self.norm_q = nn.RMSNorm(head_dim, eps=EPS)
        self.norm_k = nn.RMSNorm(head_dim, eps=EPS)
        self.to_out = nn.ModuleList([nn.Linear(inner, dim)])
        self.add_q_proj = nn.Linear(dim, inner)
        self.add_k_proj = nn.Linear(dim, inner)
        self.add_v_proj = nn.Linear(dim, inner)
        self.norm_added_q = nn.RMSNorm(head_dim, eps=EPS)
        self.norm_added_k = nn.RMSNorm(head_dim, eps=EPS)
        self.to_add_out = nn.Linear(inner, dim)

    def forward(
        self,
        img: torch.Tensor,
        txt: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        key_mask: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``rope`` covers [text, image] in that order; ``key_mask`` (batch, text + image) or None."""
        q, k, v = joint_qkv(self, img, txt, text_first=True)
        cos, sin = rope
        q, k = apply_rope_interleaved(q, cos, sin), apply_rope_interleaved(k, cos, sin)
        out = self.attend(q, k, v, key_mask).flatten(2).to(q.dtype)
        txt_out, img_out = out.split([txt.shape[1], img.shape[1]], dim=1)
        return self.to_out[0](img_out), self.to_add_out(txt_out)


def _modulation(params: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """(B, 6*D) -> (shift, scale, gate) for the attention and the MLP sub-layers, each (B, 1, D)."""
    chunks = params.unsqueeze(1).chunk(6, dim=-1)
    return [chunks[0:3], chunks[3:6]]


def _clip_fp16(x: torch.Tensor) -> torch.Tensor:
    # fp16 overflows in the residual streams of this model; clipping is what the reference does.
    return x.clip(-65504, 65504) if x.dtype == torch.float16 else x


class QwenImageTransformerBlock(nn.Module):
    """Dual-stream block: text and image keep their own weights and modulation and meet in joint attention."""

    def __init__(self, dim: int, heads: int, head_dim: int) -> None:
        super().__init__()
        self.img_mod = nn.Sequential(nn.SiLU(), nn.Linear(dim, 6 * dim))
        self.img_norm1 = nn.LayerNorm(dim, elementwise_affine=False, eps=EPS)
        self.attn = JointAttention(dim, heads, head_dim)
        self.img_norm2 = nn.LayerNorm(dim, elementwise_affine=False, eps=EPS)
        self.img_mlp = FeedForward(dim)
        self.txt_mod = nn.Sequential(nn.SiLU(), nn.Linear(dim, 6 * dim))
        self.txt_norm1 = nn.LayerNorm(dim, elementwise_affine=False, eps=EPS)
        self.txt_norm2 = nn.LayerNorm(dim, elementwise_affine=False, eps=EPS)
        self.txt_mlp = FeedForward(dim)

    def forward(
        self,
        img: torch.Tensor,
        txt: torch.Tensor,
        temb: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        key_mask: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        (shift_a, scale_a, gate_a), (shift_m, scale_m, gate_m) = _modulation(self.img_mod(temb))
        (c_shift_a, c_scale_a, c_gate_a), (c_shift_m, c_scale_m, c_gate_m) = _modulation(self.txt_mod(temb))
        img_attn, txt_attn = self.attn(
            self.img_norm1(img) * (1 + scale_a) + shift_a,
            self.txt_norm1(txt) * (1 + c_scale_a) + c_shift_a,
            rope,
            key_mask,
        )
        img = img + gate_a * img_attn
        txt = txt + c_gate_a * txt_attn
        img = img + gate_m * self.img_mlp(self.img_norm2(img) * (1 + scale_m) + shift_m)
        txt = txt + c_gate_m * self.txt_mlp(self.txt_norm2(txt) * (1 + c_scale_m) + c_shift_m)
        return _clip_fp16(img), _clip_fp16(txt)


@dataclass
class QwenImageTokens:
    """What flows between the stages. The runtime may slice ``img``/``txt`` along the sequence (dim 1) together with
    the matching rows of their rotary tables and columns of ``txt_mask``; everything else is per sample and stays
    whole."""

    # field -> (the token stream it belongs to, its sequence dimension); the prediction comes from OUTPUT_STREAM.
    SEQUENCE_FIELDS: ClassVar[dict[str, tuple[str, int]]] = {
        "img": ("img", 1), "txt": ("txt", 1), "img_rope": ("img", 0), "txt_rope": ("txt", 0),
        "txt_mask": ("txt", 1),
    }  # fmt: skip
    OUTPUT_STREAM: ClassVar[str] = "img"

    img: torch.Tensor
    txt: torch.Tensor
    img_rope: tuple[torch.Tensor, torch.Tensor]
    txt_rope: tuple[torch.Tensor, torch.Tensor]
    # (batch, text) bool, True for real tokens; None when no sample is padded, so attention runs unmasked (the fast
    # kernels). The runtime splits it with the text tokens and passes None through.
    txt_mask: torch.Tensor | None
    temb: torch.Tensor


class QwenImageTransformer(nn.Module):
    # The block stacks in run order; run_blocks runs whichever blocks they hold (PipeFusion leaves a stage its own).
    BLOCK_LISTS: ClassVar[tuple[str, ...]] = ("transformer_blocks",)

    def __init__(self, config: QwenImageConfig) -> None:
        super().__init__()
        self.config = config
        dim, heads, head_dim = config.inner_dim, config.num_attention_heads, config.attention_head_dim
        out_channels = config.out_channels or config.in_channels
        self.time_text_embed = TimestepProjection(dim)
        self.txt_norm = nn.RMSNorm(config.joint_attention_dim, eps=EPS)
        self.img_in = nn.Linear(config.in_channels, dim)
        self.txt_in = nn.Linear(config.joint_attention_dim, dim)
        self.transformer_blocks = nn.ModuleList(
            QwenImageTransformerBlock(dim, heads, head_dim) for _ in range(config.num_layers)
        )
        self.norm_out = AdaLayerNormOut(dim, dim, eps=EPS)
        self.proj_out = nn.Linear(dim, config.patch_size**2 * out_channels)

    def embed(
        self,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor,
        timestep: torch.Tensor,
        rows: int,
        cols: int,
        encoder_hidden_states_mask: torch.Tensor | None = None,
    ) -> QwenImageTokens:
        """``hidden_states`` are packed latents (batch, rows * cols, in_channels) of a rows x cols token grid;
        ``timestep`` is sigma in [0, 1] per sample, as the pipeline passes it; ``encoder_hidden_states_mask``
        (batch, text), nonzero for real tokens, or None when no sample is padded."""
        img = self.img_in(hidden_states)
        text_len = encoder_hidden_states.shape[1]
        txt_mask = None if encoder_hidden_states_mask is None else encoder_hidden_states_mask.to(torch.bool)
        device = hidden_states.device
        axes = self.config.axes_dims_rope
        return QwenImageTokens(
            img=img,
            txt=self.txt_in(self.txt_norm(encoder_hidden_states)),
            img_rope=rope_tables(image_positions(rows, cols, device), axes),
            txt_rope=rope_tables(text_positions(rows, cols, text_len, device), axes),
            txt_mask=txt_mask,
            temb=self.time_text_embed(timestep.to(img.dtype), img.dtype),
        )

    def run_blocks(self, tokens: QwenImageTokens) -> QwenImageTokens:
        rope = tuple(torch.cat([t, i], dim=0) for t, i in zip(tokens.txt_rope, tokens.img_rope))
        img, txt = tokens.img, tokens.txt
        # One key mask for the whole forward (the parallel runtime gathers it once per tensor it sees).
        key_mask = None
        if tokens.txt_mask is not None:
            image_keys = tokens.txt_mask.new_ones(img.shape[0], img.shape[1])
            key_mask = torch.cat([tokens.txt_mask, image_keys], dim=1)
        for block in self.transformer_blocks:
            img, txt = block(img, txt, tokens.temb, rope, key_mask)
        tokens.img, tokens.txt = img, txt
        return tokens

    def head(self, tokens: QwenImageTokens) -> torch.Tensor:
        return self.proj_out(self.norm_out(tokens.img, tokens.temb))

    def forward(
        self,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor,
        timestep: torch.Tensor,
        rows: int,
        cols: int,
        encoder_hidden_states_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        tokens = self.embed(hidden_states, encoder_hidden_states, timestep, rows, cols, encoder_hidden_states_mask)
        return self.head(self.run_blocks(tokens))
