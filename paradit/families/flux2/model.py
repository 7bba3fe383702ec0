"""FLUX.2's transformer, diffusers' ``Flux2Transformer2DModel``; klein KV caches its references' keys and values."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import nn

from paradit.layers.attention import AttentionDispatch, JointAttention
from paradit.layers.embeddings import TimestepEmbed
from paradit.layers.kept_rows import output_features
from paradit.layers.modulation import AdaLayerNormOut, Modulation, clip_fp16, split_modulation
from paradit.layers.rotary import apply_rope_interleaved, multi_axis_rope, rotate_qk
from paradit.layers.stages import HeadsConfig, JointTokens, StagedTransformer


@dataclass(frozen=True)
class Flux2Config(HeadsConfig):
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


# diffusers' KV pipeline leaves its transformer's ``ref_fixed_timestep`` at 0: the references are modulated as clean.
REFERENCE_TIMESTEP = 0.0

KeyValue = tuple[torch.Tensor, torch.Tensor]  # one block's references' keys and values (batch 1, rotated)
Rows = tuple[int, int]  # (start, stop) of the sequence: the rows whose output the last block computes
ReferenceKV = dict[nn.Module, KeyValue]  # per block, as ``cache_references`` makes them


def join_reference(key: torch.Tensor, value: torch.Tensor, reference: KeyValue, text_tokens: int) -> KeyValue:
    """Keys and values as [text, references, image], the order diffusers' KV attention sums them in."""
    return tuple(
        torch.cat([x[:, :text_tokens], cached.expand(x.shape[0], -1, -1, -1), x[:, text_tokens:]], dim=1)
        for x, cached in zip((key, value), reference)
    )


def _swiglu(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.chunk(2, dim=-1)
    return nn.functional.silu(gate) * up


class FeedForward(nn.Module):
    def __init__(self, dim: int, mult: float) -> None:
        super().__init__()
        inner = int(dim * mult)
        self.linear_in = nn.Linear(dim, inner * 2, bias=False)
        self.linear_out = nn.Linear(inner, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_out(_swiglu(self.linear_in(x)))


class ParallelSelfAttention(AttentionDispatch):
    """Single-stream block body: one projection yields Q, K, V and the MLP input; one projection mixes both back."""

    def __init__(self, config: Flux2Config) -> None:
        super().__init__(sequence_streams=("txt", "img"))
        dim = self.inner_dim = config.inner_dim
        self.heads, self.head_dim = config.num_attention_heads, config.attention_head_dim
        self.mlp_hidden_dim = int(dim * config.mlp_ratio)
        self.to_qkv_mlp_proj = nn.Linear(dim, self.inner_dim * 3 + self.mlp_hidden_dim * 2, bias=False)
        self.norm_q = nn.RMSNorm(self.head_dim, eps=config.eps)
        self.norm_k = nn.RMSNorm(self.head_dim, eps=config.eps)
        self.to_out = nn.Linear(self.inner_dim + self.mlp_hidden_dim, dim, bias=False)

    def forward(
        self,
        x: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        reference: KeyValue | None = None,
        text_tokens: int = 0,
        kept: Rows | None = None,
    ) -> torch.Tensor:
        """``kept``: the output of those rows alone, attending to every row's keys and values."""
        q, k, v, mlp = self.project(x, rope) if kept is None else self.project_kept(x, rope, *kept)
        if reference is not None:
            k, v = join_reference(k, v, reference, text_tokens)
        return self.mix(self.attend(q, k, v).flatten(2).to(q.dtype), mlp)

    def attend_references(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]):
        q, k, v, mlp = self.project(x, rope)
        # A copy: the slice would keep the whole projection (the MLP's input too) alive as long as the cache.
        return self.mix(self.attend(q, k, v).flatten(2).to(q.dtype), mlp), (k, v.contiguous())

    def project(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, ...]:
        q, k, v, mlp = self.split(self.to_qkv_mlp_proj(x))
        q, k = rotate_qk(self.norm_q(q), self.norm_k(k), rope)
        return q, k, v, mlp

    def project_kept(
        self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], start: int, stop: int
    ) -> tuple[torch.Tensor, ...]:
        """``project``'s Q and MLP input of rows [start, stop); K and V of every row, the other rows' from the K and V
        rows of the fused weight alone (their Q and MLP columns would be thrown away)."""
        q, k_kept, v_kept, mlp = self.split(self.to_qkv_mlp_proj(x[:, start:stop]))
        width = self.attention_width(self.to_qkv_mlp_proj.weight.shape[0])
        others = torch.cat([x[:, :start], x[:, stop:]], dim=1)
        k_others, v_others = (
            t.unflatten(-1, (-1, self.head_dim))
            for t in output_features(self.to_qkv_mlp_proj, others, width, 3 * width).chunk(2, dim=-1)
        )
        k, v = (
            torch.cat([rest[:, :start], kept, rest[:, start:]], dim=1)
            for rest, kept in ((k_others, k_kept), (v_others, v_kept))
        )
        cos, sin = rope
        q = apply_rope_interleaved(self.norm_q(q), cos[start:stop], sin[start:stop])
        return q, apply_rope_interleaved(self.norm_k(k), cos, sin), v, mlp

    def split(self, proj: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """The fused projection's [q, k, v, MLP input], Q/K/V as heads."""
        qkv_width = 3 * self.attention_width(proj.shape[-1])
        qkv, mlp = proj.split([qkv_width, proj.shape[-1] - qkv_width], dim=-1)
        q, k, v = (t.unflatten(-1, (-1, self.head_dim)) for t in qkv.chunk(3, dim=-1))
        return q, k, v, mlp

    def attention_width(self, features: int) -> int:
        """Q's (K's, V's) share of the fused projection's ``features``: a tensor-parallel shard's, or the whole."""
        return features * self.inner_dim // (3 * self.inner_dim + 2 * self.mlp_hidden_dim)

    def mix(self, attn: torch.Tensor, mlp: torch.Tensor) -> torch.Tensor:
        return self.to_out(torch.cat([attn, _swiglu(mlp)], dim=-1))


class Flux2Attention(JointAttention):
    def forward(
        self,
        img: torch.Tensor,
        txt: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        reference: KeyValue | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if reference is None:
            return super().forward(img, txt, rope)
        q_img, k_img, v_img = self.qkv(img)
        q_txt = self.project(txt, self.add_q_proj, self.norm_added_q)
        k_txt = self.project(txt, self.add_k_proj, self.norm_added_k)
        q, k = rotate_qk(torch.cat([q_txt, q_img], dim=1), torch.cat([k_txt, k_img], dim=1), rope)
        v = torch.cat([self.project(txt, self.add_v_proj), v_img], dim=1)
        k, v = join_reference(k, v, reference, txt.shape[1])
        txt_out, img_out = self.attend(q, k, v).flatten(2).to(q.dtype).split([txt.shape[1], img.shape[1]], dim=1)
        return self.to_out[0](img_out), self.to_add_out(txt_out)

    def attend_references(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]):
        q, k, v = self.qkv(x)
        q, k = rotate_qk(q, k, rope)
        return self.to_out[0](self.attend(q, k, v).flatten(2).to(q.dtype)), (k, v)


def _after_attention(
    x: torch.Tensor,
    attn: torch.Tensor,
    gate: torch.Tensor,
    mlp: tuple[torch.Tensor, ...],
    norm: nn.Module,
    ff: nn.Module,
) -> torch.Tensor:
    shift, scale, mlp_gate = mlp
    x = x + gate * attn
    return x + mlp_gate * ff(norm(x) * (1 + scale) + shift)


class Flux2TransformerBlock(nn.Module):
    def __init__(self, config: Flux2Config) -> None:
        super().__init__()
        dim, eps = config.inner_dim, config.eps
        self.norm1 = nn.LayerNorm(dim, elementwise_affine=False, eps=eps)
        self.norm1_context = nn.LayerNorm(dim, elementwise_affine=False, eps=eps)
        self.attn = Flux2Attention(dim, config.attention_head_dim, functools.partial(nn.RMSNorm, eps=eps), bias=False)
        self.norm2 = nn.LayerNorm(dim, elementwise_affine=False, eps=eps)
        self.ff = FeedForward(dim, config.mlp_ratio)
        self.norm2_context = nn.LayerNorm(dim, elementwise_affine=False, eps=eps)
        self.ff_context = FeedForward(dim, config.mlp_ratio)

    def forward(
        self,
        img: torch.Tensor,
        txt: torch.Tensor,
        mod_img: torch.Tensor,
        mod_txt: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        reference: KeyValue | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        (shift_a, scale_a, gate_a), mlp = split_modulation(mod_img, 2)
        (c_shift_a, c_scale_a, c_gate_a), c_mlp = split_modulation(mod_txt, 2)
        img_in = (1 + scale_a) * self.norm1(img) + shift_a
        txt_in = (1 + c_scale_a) * self.norm1_context(txt) + c_shift_a
        img_attn, txt_attn = self.attn(img_in, txt_in, rope, reference)
        img = _after_attention(img, img_attn, gate_a, mlp, self.norm2, self.ff)
        txt = _after_attention(txt, txt_attn, c_gate_a, c_mlp, self.norm2_context, self.ff_context)
        return img, clip_fp16(txt)

    def run_references(self, x: torch.Tensor, mod: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]):
        """References alone, through the image stream's weights: their next state, and their keys and values here."""
        (shift, scale, gate), mlp = split_modulation(mod, 2)
        out, kv = self.attn.attend_references((1 + scale) * self.norm1(x) + shift, rope)
        return _after_attention(x, out, gate, mlp, self.norm2, self.ff), kv


class Flux2SingleTransformerBlock(nn.Module):
    def __init__(self, config: Flux2Config) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(config.inner_dim, elementwise_affine=False, eps=config.eps)
        self.attn = ParallelSelfAttention(config)

    def forward(
        self,
        x: torch.Tensor,
        mod: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        reference: KeyValue | None = None,
        text_tokens: int = 0,
        kept: Rows | None = None,
    ) -> torch.Tensor:
        """``kept``: the next state of those rows alone (the last block's)."""
        ((shift, scale, gate),) = split_modulation(mod, 1)
        out = self.attn((1 + scale) * self.norm(x) + shift, rope, reference, text_tokens, kept)
        return clip_fp16((x if kept is None else x[:, kept[0] : kept[1]]) + gate * out)

    def run_references(self, x: torch.Tensor, mod: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]):
        ((shift, scale, gate),) = split_modulation(mod, 1)
        out, kv = self.attn.attend_references((1 + scale) * self.norm(x) + shift, rope)
        return clip_fp16(x + gate * out), kv


@dataclass
class Flux2Tokens(JointTokens):
    """The streams, plus the modulation vectors every block of a kind shares (one projection each, in ``embed``)."""

    temb: torch.Tensor
    mod_img: torch.Tensor
    mod_txt: torch.Tensor
    mod_single: torch.Tensor
    reference_kv: ReferenceKV | None = None  # a KV checkpoint's cached references, which every block attends to
    # The image stream's first tokens, whose prediction alone the step keeps (None: every token's is computed): the
    # last block then computes those rows alone (the text's and the references' are dropped after it).
    output_tokens: int | None = None


class Flux2Transformer(StagedTransformer):
    BLOCK_LISTS: ClassVar[tuple[str, ...]] = ("transformer_blocks", "single_transformer_blocks")

    def __init__(self, config: Flux2Config) -> None:
        super().__init__(config)
        dim, channels = config.inner_dim, config.timestep_guidance_channels
        self.time_guidance_embed = TimestepEmbed(dim, channels, bias=False, guidance=config.guidance_embeds)
        self.double_stream_modulation_img = Modulation(dim, 2, bias=False)
        self.double_stream_modulation_txt = Modulation(dim, 2, bias=False)
        self.single_stream_modulation = Modulation(dim, 1, bias=False)
        self.x_embedder = nn.Linear(config.in_channels, dim, bias=False)
        self.context_embedder = nn.Linear(config.joint_attention_dim, dim, bias=False)
        self.transformer_blocks = nn.ModuleList(Flux2TransformerBlock(config) for _ in range(config.num_layers))
        self.single_transformer_blocks = nn.ModuleList(
            Flux2SingleTransformerBlock(config) for _ in range(config.num_single_layers)
        )
        self.norm_out = AdaLayerNormOut(dim, dim, eps=config.eps, bias=False)
        self.proj_out = nn.Linear(dim, config.patch_size**2 * config.output_channels, bias=False)

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
        reference_kv: ReferenceKV | None = None,
        output_tokens: int | None = None,
    ) -> Flux2Tokens:
        """``timestep``, ``guidance``: sigma in [0, 1] per sample; ``reference_kv``: ``cache_references``' output;
        ``output_tokens``: only the first so many image tokens' prediction is wanted (the rest may come out or not)."""
        dtype = hidden_states.dtype
        timestep = timestep.to(dtype) * 1000
        guidance = None if guidance is None else guidance.to(dtype) * 1000
        temb = self.time_guidance_embed(timestep, dtype, guidance)
        return Flux2Tokens(
            img=self.x_embedder(hidden_states),
            txt=self.context_embedder(encoder_hidden_states),
            img_rope=self.rope(img_ids),
            txt_rope=self.rope(txt_ids),
            temb=temb,
            mod_img=self.double_stream_modulation_img(temb),
            mod_txt=self.double_stream_modulation_txt(temb),
            mod_single=self.single_stream_modulation(temb),
            reference_kv=reference_kv,
            output_tokens=output_tokens,
        )

    def cache_references(self, latents: torch.Tensor, ids: torch.Tensor) -> ReferenceKV:
        """Each block's keys and values of the references (1, tokens, channels), run alone at REFERENCE_TIMESTEP."""
        temb = self.time_guidance_embed(latents.new_full((1,), REFERENCE_TIMESTEP * 1000), latents.dtype)
        mod_double, mod_single = self.double_stream_modulation_img(temb), self.single_stream_modulation(temb)
        x, rope, cached = self.x_embedder(latents), self.rope(ids), {}
        for block in self.transformer_blocks:
            x, cached[block] = block.run_references(x, mod_double, rope)
        for block in self.single_transformer_blocks:
            x, cached[block] = block.run_references(x, mod_single, rope)
        return cached

    def run_blocks(self, tokens: Flux2Tokens) -> Flux2Tokens:
        rope = tuple(torch.cat([t, i], dim=0) for t, i in zip(tokens.txt_rope, tokens.img_rope))
        cached = tokens.reference_kv or {}
        for block in self.transformer_blocks:
            tokens.img, tokens.txt = block(
                tokens.img, tokens.txt, tokens.mod_img, tokens.mod_txt, rope, cached.get(block)
            )
        x, text = torch.cat([tokens.txt, tokens.img], dim=1), tokens.txt.shape[1]
        blocks = self.single_transformer_blocks
        kept = None if tokens.output_tokens is None or not blocks else (text, text + tokens.output_tokens)
        for index, block in enumerate(blocks):
            x = block(x, tokens.mod_single, rope, cached.get(block), text, kept if index == len(blocks) - 1 else None)
        if kept is None:
            tokens.txt, tokens.img = x.split([text, tokens.img.shape[1]], dim=1)
        else:  # the last block gave the kept rows alone; the text keeps the state it entered the single blocks with
            tokens.img = x
        return tokens
