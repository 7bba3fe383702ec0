"""FLUX.2 transformer (dev, klein) as plain single-device math.

Parameter names are those of diffusers' ``Flux2Transformer2DModel``, so published checkpoints load without key
surgery. The forward pass is three stages the parallel runtime can act between:

- ``embed``: latents, text embeddings, timestep and position ids -> ``Flux2Tokens`` (two token streams, their rotary
  tables, the modulation vectors);
- ``run_blocks``: the double-stream blocks, then the single-stream blocks over [text, image];
- ``head``: image tokens -> prediction.

Every attention layer calls ``AttentionDispatch.attend``; nothing here knows about devices other than its own.
Must not import torch.distributed.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import nn

from paradit.layers.attention import AttentionDispatch, joint_qkv
from paradit.layers.embeddings import TimestepMLP, sinusoidal_embedding
from paradit.layers.norms import AdaLayerNormOut
from paradit.layers.rotary import apply_rope_interleaved, multi_axis_rope


@dataclass(frozen=True)
class Flux2Config:
    """The keyword arguments of diffusers' ``Flux2Transformer2DModel`` (its ``transformer/config.json``)."""

    patch_size: int = 1
    in_channels: int = 128
    out_channels: int | None = None
    num_layers: int = 8
    num_single_layers: int = 48
    attention_head_dim: int = 128
    num_attention_heads: int = 48
    joint_attention_dim: int = 15360
    timestep_guidance_channels: int = 256
    mlp_ratio: float = 3.0
    axes_dims_rope: tuple[int, ...] = (32, 32, 32, 32)
    rope_theta: int = 2000
    eps: float = 1e-6
    guidance_embeds: bool = True

    @classmethod
    def from_dict(cls, config: dict[str, Any]) -> Flux2Config:
        names = {f.name for f in dataclasses.fields(cls)}
        values = {k: v for k, v in config.items() if k in names}
        if "axes_dims_rope" in values:
            values["axes_dims_rope"] = tuple(values["axes_dims_rope"])
        return cls(**values)

    @property
    def inner_dim(self) -> int:
        return self.num_attention_heads * self.attention_head_dim


def _split_modulation(mod: torch.Tensor, sets: int) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """(B, 3*sets*D) -> ``sets`` triples of (shift, scale, gate), each (B, 1, D)."""
    chunks = mod.unsqueeze(1).chunk(3 * sets, dim=-1)
    return [tuple(chunks[3 * i : 3 * i + 3]) for i in range(sets)]


def _swiglu(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.chunk(2, dim=-1)
    return nn.functional.silu(gate) * up


def _rope_heads(
    q: torch.Tensor, k: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]
) -> tuple[torch.Tensor, torch.Tensor]:
    cos, sin = rope
    return apply_rope_interleaved(q, cos, sin), apply_rope_interleaved(k, cos, sin)


class FeedForward(nn.Module):
    """SwiGLU MLP whose gate and up projections share ``linear_in``."""

    def __init__(self, dim: int, mult: float) -> None:
        super().__init__()
        inner = int(dim * mult)
        self.linear_in = nn.Linear(dim, inner * 2, bias=False)
        self.linear_out = nn.Linear(inner, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_out(_swiglu(self.linear_in(x)))


class JointAttention(AttentionDispatch):
    """Attention over [text, image] with separate projections per stream (double-stream blocks)."""

    def __init__(self, dim: int, heads: int, head_dim: int, eps: float) -> None:
        super().__init__(sequence_streams=("txt", "img"))
        self.heads = heads
        self.head_dim = head_dim
        inner = heads * head_dim
        self.to_q = nn.Linear(dim, inner, bias=False)
        self.to_k = nn.Linear(dim, inner, bias=False)
        self.to_v = nn.Linear(dim, inner, bias=False)
        self.norm_q = nn.RMSNorm(head_dim, eps=eps)
        self.norm_k = nn.RMSNorm(head_dim, eps=eps)
        self.to_out = nn.ModuleList([nn.Linear(inner, dim, bias=False)])
        self.add_q_proj = nn.Linear(dim, inner, bias=False)
        self.add_k_proj = nn.Linear(dim, inner, bias=False)
        self.add_v_proj = nn.Linear(dim, inner, bias=False)
        self.norm_added_q = nn.RMSNorm(head_dim, eps=eps)
        self.norm_added_k = nn.RMSNorm(head_dim, eps=eps)
        self.to_add_out = nn.Linear(inner, dim, bias=False)

    def forward(
        self, img: torch.Tensor, txt: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        q, k, v = joint_qkv(self, img, txt, text_first=True)
        q, k = _rope_heads(q, k, rope)
        out = self.attend(q, k, v).flatten(2).to(q.dtype)
        txt_out, img_out = out.split([txt.shape[1], img.shape[1]], dim=1)
        return self.to_out[0](img_out), self.to_add_out(txt_out)


class ParallelSelfAttention(AttentionDispatch):
    """Single-stream block body: one projection yields Q, K, V and the MLP input; one projection mixes both back."""

    def __init__(self, dim: int, heads: int, head_dim: int, mlp_ratio: float, eps: float) -> None:
        super().__init__(sequence_streams=("txt", "img"))
        self.heads = heads
        self.head_dim = head_dim
        self.inner_dim = heads * head_dim
        self.mlp_hidden_dim = int(dim * mlp_ratio)
        self.to_qkv_mlp_proj = nn.Linear(dim, self.inner_dim * 3 + self.mlp_hidden_dim * 2, bias=False)
        self.norm_q = nn.RMSNorm(head_dim, eps=eps)
        self.norm_k = nn.RMSNorm(head_dim, eps=eps)
        self.to_out = nn.Linear(self.inner_dim + self.mlp_hidden_dim, dim, bias=False)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        proj = self.to_qkv_mlp_proj(x)
        qkv_width = proj.shape[-1] * 3 * self.inner_dim // (3 * self.inner_dim + 2 * self.mlp_hidden_dim)
        qkv, mlp = proj.split([qkv_width, proj.shape[-1] - qkv_width], dim=-1)
        q, k, v = (t.unflatten(-1, (-1, self.head_dim)) for t in qkv.chunk(3, dim=-1))
        q, k = _rope_heads(self.norm_q(q), self.norm_k(k), rope)
        attn = self.attend(q, k, v).flatten(2).to(q.dtype)
        return self.to_out(torch.cat([attn, _swiglu(mlp)], dim=-1))


def _clip_fp16(x: torch.Tensor) -> torch.Tensor:
    # fp16 overflows in the residual stream of these models; clipping is what the reference does.
    return x.clip(-65504, 65504) if x.dtype == torch.float16 else x


class Flux2TransformerBlock(nn.Module):
    """Double-stream block: text and image keep their own weights and meet in joint attention."""

    def __init__(self, dim: int, heads: int, head_dim: int, mlp_ratio: float, eps: float) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(dim, elementwise_affine=False, eps=eps)
        self.norm1_context = nn.LayerNorm(dim, elementwise_affine=False, eps=eps)
        self.attn = JointAttention(dim, heads, head_dim, eps)
        self.norm2 = nn.LayerNorm(dim, elementwise_affine=False, eps=eps)
        self.ff = FeedForward(dim, mlp_ratio)
        self.norm2_context = nn.LayerNorm(dim, elementwise_affine=False, eps=eps)
        self.ff_context = FeedForward(dim, mlp_ratio)

    def forward(
        self,
        img: torch.Tensor,
        txt: torch.Tensor,
        mod_img: torch.Tensor,
        mod_txt: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
    ) -> tuple[torch.Tensor, torch.Tensor]:
        (shift_a, scale_a, gate_a), (shift_m, scale_m, gate_m) = _split_modulation(mod_img, 2)
        (c_shift_a, c_scale_a, c_gate_a), (c_shift_m, c_scale_m, c_gate_m) = _split_modulation(mod_txt, 2)
        img_attn, txt_attn = self.attn(
            (1 + scale_a) * self.norm1(img) + shift_a, (1 + c_scale_a) * self.norm1_context(txt) + c_shift_a, rope
        )
        img = img + gate_a * img_attn
        img = img + gate_m * self.ff(self.norm2(img) * (1 + scale_m) + shift_m)
        txt = txt + c_gate_a * txt_attn
        txt = txt + c_gate_m * self.ff_context(self.norm2_context(txt) * (1 + c_scale_m) + c_shift_m)
        return img, _clip_fp16(txt)


class Flux2SingleTransformerBlock(nn.Module):
    """Single-stream block over the concatenated [text, image] sequence."""

    def __init__(self, dim: int, heads: int, head_dim: int, mlp_ratio: float, eps: float) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim, elementwise_affine=False, eps=eps)
        self.attn = ParallelSelfAttention(dim, heads, head_dim, mlp_ratio, eps)

    def forward(self, x: torch.Tensor, mod: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        ((shift, scale, gate),) = _split_modulation(mod, 1)
        x = x + gate * self.attn((1 + scale) * self.norm(x) + shift, rope)
        return _clip_fp16(x)


class Modulation(nn.Module):
    """SiLU then one projection to (shift, scale, gate) for ``sets`` sub-layers, shared by every block of a kind."""

    def __init__(self, dim: int, sets: int) -> None:
        super().__init__()
        self.linear = nn.Linear(dim, dim * 3 * sets, bias=False)

    def forward(self, temb: torch.Tensor) -> torch.Tensor:
        return self.linear(nn.functional.silu(temb))


class TimeGuidanceEmbed(nn.Module):
    def __init__(self, in_channels: int, dim: int, guidance_embeds: bool) -> None:
        super().__init__()
        self.in_channels = in_channels
        self.timestep_embedder = TimestepMLP(in_channels, dim, bias=False)
        self.guidance_embedder = TimestepMLP(in_channels, dim, bias=False) if guidance_embeds else None

    def forward(self, timestep: torch.Tensor, guidance: torch.Tensor | None) -> torch.Tensor:
        emb = self.timestep_embedder(sinusoidal_embedding(timestep, self.in_channels).to(timestep.dtype))
        if guidance is not None and self.guidance_embedder is not None:
            emb = emb + self.guidance_embedder(sinusoidal_embedding(guidance, self.in_channels).to(guidance.dtype))
        return emb


@dataclass
class Flux2Tokens:
    """What flows between the stages. The runtime may slice ``img``/``txt`` along the sequence (dim 1) together with
    the matching rows of ``img_rope``/``txt_rope``; everything else is per sample and stays whole."""

    # field -> (the token stream it belongs to, its sequence dimension); the prediction comes from OUTPUT_STREAM.
    SEQUENCE_FIELDS: ClassVar[dict[str, tuple[str, int]]] = {
        "img": ("img", 1), "txt": ("txt", 1), "img_rope": ("img", 0), "txt_rope": ("txt", 0),
    }  # fmt: skip
    OUTPUT_STREAM: ClassVar[str] = "img"

    img: torch.Tensor
    txt: torch.Tensor
    img_rope: tuple[torch.Tensor, torch.Tensor]
    txt_rope: tuple[torch.Tensor, torch.Tensor]
    temb: torch.Tensor
    mod_img: torch.Tensor
    mod_txt: torch.Tensor
    mod_single: torch.Tensor


class Flux2Transformer(nn.Module):
    # The block stacks in the order run_blocks runs them; run_blocks runs whichever blocks they hold (PipeFusion
    # leaves each stage only its own).
    BLOCK_LISTS: ClassVar[tuple[str, ...]] = ("transformer_blocks", "single_transformer_blocks")

    def __init__(self, config: Flux2Config) -> None:
        super().__init__()
        self.config = config
        dim, heads, head_dim = config.inner_dim, config.num_attention_heads, config.attention_head_dim
        out_channels = config.out_channels or config.in_channels
        self.time_guidance_embed = TimeGuidanceEmbed(config.timestep_guidance_channels, dim, config.guidance_embeds)
        self.double_stream_modulation_img = Modulation(dim, 2)
        self.double_stream_modulation_txt = Modulation(dim, 2)
        self.single_stream_modulation = Modulation(dim, 1)
        self.x_embedder = nn.Linear(config.in_channels, dim, bias=False)
        self.context_embedder = nn.Linear(config.joint_attention_dim, dim, bias=False)
        self.transformer_blocks = nn.ModuleList(
            Flux2TransformerBlock(dim, heads, head_dim, config.mlp_ratio, config.eps) for _ in range(config.num_layers)
        )
        self.single_transformer_blocks = nn.ModuleList(
            Flux2SingleTransformerBlock(dim, heads, head_dim, config.mlp_ratio, config.eps)
            for _ in range(config.num_single_layers)
        )
        self.norm_out = AdaLayerNormOut(dim, dim, eps=config.eps, bias=False)
        self.proj_out = nn.Linear(dim, config.patch_size**2 * out_channels, bias=False)

    def rope(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return multi_axis_rope(ids[0] if ids.ndim == 3 else ids, self.config.axes_dims_rope, self.config.rope_theta)

    def embed(
        self,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor,
        timestep: torch.Tensor,
        img_ids: torch.Tensor,
        txt_ids: torch.Tensor,
        guidance: torch.Tensor | None = None,
    ) -> Flux2Tokens:
        """``timestep`` and ``guidance`` are in [0, 1] as the pipeline passes them (sigma), per sample."""
        dtype = hidden_states.dtype
        timestep = timestep.to(dtype) * 1000
        if guidance is not None:
            guidance = guidance.to(dtype) * 1000
        temb = self.time_guidance_embed(timestep, guidance)
        return Flux2Tokens(
            img=self.x_embedder(hidden_states),
            txt=self.context_embedder(encoder_hidden_states),
            img_rope=self.rope(img_ids),
            txt_rope=self.rope(txt_ids),
            temb=temb,
            mod_img=self.double_stream_modulation_img(temb),
            mod_txt=self.double_stream_modulation_txt(temb),
            mod_single=self.single_stream_modulation(temb),
        )

    def run_blocks(self, tokens: Flux2Tokens) -> Flux2Tokens:
        rope = tuple(torch.cat([t, i], dim=0) for t, i in zip(tokens.txt_rope, tokens.img_rope))
        img, txt = tokens.img, tokens.txt
        for block in self.transformer_blocks:
            img, txt = block(img, txt, tokens.mod_img, tokens.mod_txt, rope)
        x = torch.cat([txt, img], dim=1)
        for block in self.single_transformer_blocks:
            x = block(x, tokens.mod_single, rope)
        tokens.txt, tokens.img = x.split([txt.shape[1], img.shape[1]], dim=1)
        return tokens

    def head(self, tokens: Flux2Tokens) -> torch.Tensor:
        return self.proj_out(self.norm_out(tokens.img, tokens.temb))

    def forward(
        self,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor,
        timestep: torch.Tensor,
        img_ids: torch.Tensor,
        txt_ids: torch.Tensor,
        guidance: torch.Tensor | None = None,
    ) -> torch.Tensor:
        tokens = self.embed(hidden_states, encoder_hidden_states, timestep, img_ids, txt_ids, guidance)
        return self.head(self.run_blocks(tokens))
