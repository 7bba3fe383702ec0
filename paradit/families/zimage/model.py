"""Z-Image transformer (Turbo and the non-distilled base) as plain single-device math.

Names follow diffusers' ``ZImageTransformer2DModel`` (checkpoints load without key surgery); attention goes through
``AttentionDispatch.attend``, and nothing here knows other devices. Three stages the runtime acts between:

- ``embed``: latents, caption features, timestep -> ``ZImageTokens`` (padded streams, rotary tables, key mask, temb);
- ``run_blocks``: noise refiner over the image, context refiner over the text, joint blocks over [image, text];
- ``head``: image tokens -> prediction, one row per token (pad tokens included; ``unpatchify`` drops them).

As in the reference, each stream is padded to a multiple of 32 tokens with a learnt pad token, a real key every query
attends to; only batch padding past a caption's own rounded length is masked, by a key mask built once per forward.
Must not import torch.distributed."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import nn

from paradit.layers import stages
from paradit.layers.attention import QKVAttention, joint_key_mask
from paradit.layers.embeddings import sinusoidal_embedding
from paradit.layers.stages import CheckpointConfig, StagedTransformer

SEQUENCE_MULTIPLE = 32  # every stream is padded to a multiple of this many tokens
ADALN_DIM = 256  # width of the timestep vector, capped by the model width
TIMESTEP_FREQUENCIES = 256
TIMESTEP_HIDDEN = 1024


@dataclass(frozen=True)
class ZImageConfig(CheckpointConfig):
    all_patch_size: tuple[int, ...] = (2,)
    all_f_patch_size: tuple[int, ...] = (1,)
    in_channels: int = 16
    dim: int = 3840
    n_layers: int = 30
    n_refiner_layers: int = 2
    n_heads: int = 30
    norm_eps: float = 1e-5
    qk_norm: bool = True
    cap_feat_dim: int = 2560
    rope_theta: float = 256.0
    t_scale: float = 1000.0
    axes_dims: tuple[int, ...] = (32, 48, 48)
    axes_lens: tuple[int, ...] = (1024, 512, 512)

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @property
    def adaln_dim(self) -> int:
        return min(self.dim, ADALN_DIM)

    @property
    def patch_size(self) -> int:
        # The pipeline runs the first (and in every published config, only) patch size: 2 x 2, one frame.
        return self.all_patch_size[0]

    @property
    def patch_key(self) -> str:
        return f"{self.all_patch_size[0]}-{self.all_f_patch_size[0]}"


def round_up(n, multiple: int = SEQUENCE_MULTIPLE):
    """``n`` (an int or an integer tensor) rounded up to a multiple of ``multiple``."""
    return (n + multiple - 1) // multiple * multiple


def patchify(latents: torch.Tensor, patch: int) -> torch.Tensor:
    """(B, C, H, W) -> (B, H/p * W/p, p * p * C), rows in raster order, each patch laid out (row, column, channel)."""
    batch, channels, height, width = latents.shape
    x = latents.view(batch, channels, height // patch, patch, width // patch, patch)
    return x.permute(0, 2, 4, 3, 5, 1).reshape(batch, (height // patch) * (width // patch), patch * patch * channels)


def unpatchify(tokens: torch.Tensor, rows: int, cols: int, patch: int) -> torch.Tensor:
    """The inverse of ``patchify`` on the first ``rows * cols`` tokens (the rest are the stream's pad tokens)."""
    return stages.unpatchify(tokens[:, : rows * cols], (rows, cols), (patch, patch))


class RMSNorm(nn.Module):
    """RMS norm with the reference's dtype handling: statistics in float32, the result cast to a half-precision
    weight's dtype before scaling (so bf16 runs round where the reference rounds)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        variance = x.float().pow(2).mean(-1, keepdim=True)
        x = x * torch.rsqrt(variance + self.eps)
        if self.weight.dtype in (torch.float16, torch.bfloat16):
            x = x.to(self.weight.dtype)
        return x * self.weight


def rotate(x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
    """Rotate (B, S, H, D) by unit complex numbers (B or 1, S, D/2): channels (2i, 2i+1) are one complex number.
    A complex64 product, as in the reference, so that half-precision runs round exactly as it does."""
    pairs = torch.view_as_complex(x.float().unflatten(-1, (-1, 2)))
    return torch.view_as_real(pairs * rope[:, :, None, :]).flatten(-2).to(x.dtype)


class ZImageAttention(QKVAttention):
    """Self-attention over whatever sequence the block is given, with per-head RMS norms on Q and K."""

    def forward(self, x: torch.Tensor, rope: torch.Tensor, key_mask: torch.Tensor | None) -> torch.Tensor:
        q, k, v = self.qkv(x)
        out = self.attend(rotate(q, rope), rotate(k, rope), v, key_mask)
        return self.to_out[0](out.flatten(2).to(x.dtype))


class FeedForward(nn.Module):
    """SwiGLU MLP: w2(silu(w1 x) * w3 x)."""

    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(nn.functional.silu(self.w1(x)) * self.w3(x))


class ZImageBlock(nn.Module):
    """Pre- and post-normed attention and MLP. Modulated blocks (noise refiner, joint blocks) scale the normed input
    and tanh-gate the residual from the timestep; the context refiner's blocks have no modulation."""

    def __init__(self, config: ZImageConfig, modulated: bool, streams: tuple[str, ...] | None) -> None:
        super().__init__()
        dim, eps = config.dim, config.norm_eps
        # The reference fixes the Q and K norms' eps at 1e-5 whatever the model's norm_eps.
        qk_norm = functools.partial(RMSNorm, eps=1e-5) if config.qk_norm else nn.Identity
        self.attention = ZImageAttention(dim, config.head_dim, qk_norm, bias=False, sequence_streams=streams)
        self.feed_forward = FeedForward(dim, int(dim / 3 * 8))
        self.attention_norm1 = RMSNorm(dim, eps)
        self.ffn_norm1 = RMSNorm(dim, eps)
        self.attention_norm2 = RMSNorm(dim, eps)
        self.ffn_norm2 = RMSNorm(dim, eps)
        self.adaLN_modulation = nn.Sequential(nn.Linear(config.adaln_dim, 4 * dim)) if modulated else None

    def forward(self, x: torch.Tensor, rope: torch.Tensor, key_mask: torch.Tensor | None,
                temb: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
        if self.adaLN_modulation is None:
            x = x + self.attention_norm2(self.attention(self.attention_norm1(x), rope, key_mask))
            return x + self.ffn_norm2(self.feed_forward(self.ffn_norm1(x)))
        scale_attn, gate_attn, scale_mlp, gate_mlp = self.adaLN_modulation(temb).unsqueeze(1).chunk(4, dim=2)
        attn = self.attention(self.attention_norm1(x) * (1.0 + scale_attn), rope, key_mask)
        x = x + gate_attn.tanh() * self.attention_norm2(attn)
        return x + gate_mlp.tanh() * self.ffn_norm2(self.feed_forward(self.ffn_norm1(x) * (1.0 + scale_mlp)))


class FinalLayer(nn.Module):
    """LayerNorm scaled by the timestep vector, then the projection to patch pixels."""

    def __init__(self, dim: int, cond_dim: int, out_features: int) -> None:
        super().__init__()
        self.norm_final = nn.LayerNorm(dim, elementwise_affine=False, eps=1e-6)
        self.linear = nn.Linear(dim, out_features)
        self.adaLN_modulation = nn.Sequential(nn.SiLU(), nn.Linear(cond_dim, dim))

    def forward(self, x: torch.Tensor, temb: torch.Tensor) -> torch.Tensor:
        return self.linear(self.norm_final(x) * (1.0 + self.adaLN_modulation(temb)).unsqueeze(1))


class TimestepEmbedder(nn.Module):
    """Sinusoidal features (cos first) lifted by a two-layer MLP, named as the reference's ``t_embedder.mlp``."""

    def __init__(self, out_dim: int) -> None:
        super().__init__()
        self.mlp = nn.Sequential(
            nn.Linear(TIMESTEP_FREQUENCIES, TIMESTEP_HIDDEN), nn.SiLU(), nn.Linear(TIMESTEP_HIDDEN, out_dim)
        )

    def forward(self, t: torch.Tensor) -> torch.Tensor:
        return self.mlp(sinusoidal_embedding(t, TIMESTEP_FREQUENCIES).to(self.mlp[0].weight.dtype))


@dataclass
class ZImageTokens:
    SEQUENCE_FIELDS: ClassVar[dict[str, tuple[str, int]]] = {
        "img": ("img", 1), "txt": ("txt", 1), "img_rope": ("img", 1), "txt_rope": ("txt", 1),
        "txt_mask": ("txt", 1),
    }  # fmt: skip
    OUTPUT_STREAM: ClassVar[str] = "img"

    img: torch.Tensor  # (B, image tokens rounded up to 32, dim)
    txt: torch.Tensor  # (B, longest caption rounded up to 32, dim)
    img_rope: torch.Tensor  # complex (B, image tokens, head_dim / 2): the first axis depends on the caption
    txt_rope: torch.Tensor  # complex (1, text tokens, head_dim / 2)
    # (B, text tokens) bool, False past a caption's own rounded length; None when no caption is masked (decided
    # before the split, so every rank agrees), which keeps attention mask-free.
    txt_mask: torch.Tensor | None
    temb: torch.Tensor  # (B, adaln_dim)


class ZImageTransformer(StagedTransformer):
    # A PipeFusion stage may hold refiner blocks, joint blocks or both.
    BLOCK_LISTS: ClassVar[tuple[str, ...]] = ("noise_refiner", "context_refiner", "layers")
    # Step caching watches the joint stack, as diffusers' hooks do (the refiners always run), and its joint stream.
    CACHED_FROM: ClassVar[str] = "layers"
    CACHE_STREAMS: ClassVar[tuple[str, ...]] = ("img", "txt")

    def __init__(self, config: ZImageConfig) -> None:
        super().__init__(config)
        dim, patch = config.dim, config.patch_size
        if config.head_dim != sum(config.axes_dims):
            raise ValueError(f"head dim {config.head_dim} != sum of rotary axes_dims {config.axes_dims}")
        self.all_x_embedder = nn.ModuleDict({config.patch_key: nn.Linear(patch * patch * config.in_channels, dim)})
        self.all_final_layer = nn.ModuleDict(
            {config.patch_key: FinalLayer(dim, config.adaln_dim, patch * patch * config.in_channels)}
        )
        self.noise_refiner = nn.ModuleList(
            ZImageBlock(config, modulated=True, streams=("img",)) for _ in range(config.n_refiner_layers)
        )
        self.context_refiner = nn.ModuleList(
            ZImageBlock(config, modulated=False, streams=("txt",)) for _ in range(config.n_refiner_layers)
        )
        self.t_embedder = TimestepEmbedder(config.adaln_dim)
        self.cap_embedder = nn.Sequential(
            RMSNorm(config.cap_feat_dim, eps=config.norm_eps), nn.Linear(config.cap_feat_dim, dim)
        )
        self.x_pad_token = nn.Parameter(torch.zeros(1, dim))
        self.cap_pad_token = nn.Parameter(torch.zeros(1, dim))
        self.layers = nn.ModuleList(
            ZImageBlock(config, modulated=True, streams=("img", "txt")) for _ in range(config.n_layers)
        )
        self._rope_tables: dict[torch.device, list[torch.Tensor]] = {}

    def rope_tables(self, device: torch.device) -> list[torch.Tensor]:
        """Per axis, unit complex numbers for positions 0 .. axes_lens[i] - 1, (len, axes_dims[i] / 2), once per device;
        built on the CPU as the reference does (float64 angles, rounded to float32, then polar), bit for bit."""
        if device not in self._rope_tables:
            tables = []
            for dim, length in zip(self.config.axes_dims, self.config.axes_lens):
                inv_freq = 1.0 / self.config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)
                angles = torch.outer(torch.arange(length, dtype=torch.float64), inv_freq).float()
                tables.append(torch.polar(torch.ones_like(angles), angles).to(device))
            self._rope_tables[device] = tables
        return self._rope_tables[device]

    def rope(self, positions: torch.Tensor) -> torch.Tensor:
        """Complex rotations (..., head_dim / 2) for integer positions (..., 3), each below its axis's axes_lens."""
        tables = self.rope_tables(positions.device)
        return torch.cat([table[positions[..., axis]] for axis, table in enumerate(tables)], dim=-1)

    def embed(self, hidden_states: torch.Tensor, timestep: torch.Tensor, encoder_hidden_states: torch.Tensor,
              encoder_attention_mask: torch.Tensor | None = None) -> ZImageTokens:  # fmt: skip
        """``hidden_states``: latents (B, C, H, W); ``timestep``: (B,) 1 - sigma; ``encoder_hidden_states``: captions
        (B, T, cap_feat_dim), right-padded where ``encoder_attention_mask`` is False (None: all T long)."""
        batch, device = hidden_states.shape[0], hidden_states.device
        patch = self.config.patch_size
        rows, cols = hidden_states.shape[2] // patch, hidden_states.shape[3] // patch
        temb = self.t_embedder(timestep * self.config.t_scale).to(hidden_states.dtype)

        text_len = encoder_hidden_states.shape[1]
        text_stream = round_up(text_len)
        text_index = torch.arange(text_stream, device=device)
        if encoder_attention_mask is None:
            real = (text_index < text_len).expand(batch, -1)
        else:
            real = nn.functional.pad(encoder_attention_mask.bool(), (0, text_stream - text_len))
        caption_lens = round_up(real.sum(dim=1))  # each caption's length in the reference, pads included
        captions = self.cap_embedder(nn.functional.pad(encoder_hidden_states, (0, 0, 0, text_stream - text_len)))
        txt = torch.where(real[..., None], captions, self.cap_pad_token.to(captions.dtype))
        txt_positions = nn.functional.pad((text_index + 1)[None, :, None], (0, 2))

        image_tokens = rows * cols
        img = self.all_x_embedder[self.config.patch_key](patchify(hidden_states, patch))
        pads = self.x_pad_token.to(img.dtype).expand(batch, round_up(image_tokens) - image_tokens, -1)
        img = torch.cat([img, pads], dim=1)
        # Image positions: (caption length + 1, row, column); the stream's pad tokens sit at (0, 0, 0).
        grid = torch.cartesian_prod(torch.arange(rows, device=device), torch.arange(cols, device=device))
        img_positions = torch.zeros(batch, img.shape[1], 3, dtype=torch.long, device=device)
        img_positions[:, :image_tokens, 0] = (caption_lens + 1)[:, None]
        img_positions[:, :image_tokens, 1:] = grid
        return ZImageTokens(img=img, txt=txt, img_rope=self.rope(img_positions), txt_rope=self.rope(txt_positions),
                            txt_mask=None if encoder_attention_mask is None else text_index < caption_lens[:, None],
                            temb=temb)  # fmt: skip

    def run_blocks(self, tokens: ZImageTokens) -> ZImageTokens:
        img, txt = tokens.img, tokens.txt
        for block in self.noise_refiner:
            img = block(img, tokens.img_rope, None, tokens.temb)
        for block in self.context_refiner:
            txt = block(txt, tokens.txt_rope, tokens.txt_mask)

        rope = torch.cat([tokens.img_rope, tokens.txt_rope.expand(img.shape[0], -1, -1)], dim=1)
        joint_mask = joint_key_mask(tokens.txt_mask, img, text_first=False)
        x = torch.cat([img, txt], dim=1)
        for block in self.layers:
            x = block(x, rope, joint_mask, tokens.temb)
        tokens.img, tokens.txt = x.split([img.shape[1], txt.shape[1]], dim=1)
        return tokens

    def head(self, tokens: ZImageTokens) -> torch.Tensor:
        return self.all_final_layer[self.config.patch_key](tokens.img, tokens.temb)
