"""Z-Image's transformer (Turbo, base, Omni), diffusers' ``ZImageTransformer2DModel``: stream refiners, joint blocks."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import nn

from paradit.layers import stages
from paradit.layers.attention import QKVAttention
from paradit.layers.embeddings import sinusoidal_embedding
from paradit.layers.stages import CheckpointConfig, StagedTransformer

SEQUENCE_MULTIPLE = 32  # as the reference, streams are padded to a multiple of 32 with a learnt pad token (a real key)
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
    siglip_feat_dim: int | None = None  # the Omni checkpoints' SigLIP width
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
    """Statistics in float32, the result cast to a half-precision weight's dtype before scaling, as the reference."""

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


def with_pad_tokens(x: torch.Tensor, pad_token: torch.Tensor) -> torch.Tensor:
    n = x.shape[1]
    return torch.cat([x, pad_token.to(x.dtype).expand(x.shape[0], round_up(n) - n, -1)], dim=1)


def image_positions(first: torch.Tensor, grid: torch.Tensor) -> torch.Tensor:
    """(B, n rounded up, 3) rotary positions: token i at (first[b], *grid[i]), then the pad tokens at (0, 0, 0)."""
    n = grid.shape[0]
    positions = torch.zeros(first.shape[0], round_up(n), 3, dtype=torch.long, device=first.device)
    positions[:, :n, 0] = first[:, None]
    positions[:, :n, 1:] = grid
    return positions


def raster_grid(rows: int, cols: int, device: torch.device) -> torch.Tensor:
    return torch.cartesian_prod(torch.arange(rows, device=device), torch.arange(cols, device=device))


def modulate(layer: nn.Module, temb: torch.Tensor, per_token: tuple[torch.Tensor, torch.Tensor] | None):
    """``layer(temb)`` as (B, 1, width); with ``per_token`` (clean embedding, (B, S, 1) True where noisy) per token."""
    rows = layer(temb).unsqueeze(1)
    if per_token is None:
        return rows
    clean, noisy = per_token
    return torch.where(noisy, rows, layer(clean).unsqueeze(1))


def rotate(x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
    """Rotate (B, S, H, D) by unit complex numbers (B or 1, S, D/2): channels (2i, 2i+1) are one complex number.
    A complex64 product, as in the reference, so that half-precision runs round exactly as it does."""
    pairs = torch.view_as_complex(x.float().unflatten(-1, (-1, 2)))
    return torch.view_as_real(pairs * rope[:, :, None, :]).flatten(-2).to(x.dtype)


class ZImageAttention(QKVAttention):
    def forward(self, x: torch.Tensor, rope: torch.Tensor, key_mask: torch.Tensor | None) -> torch.Tensor:
        q, k, v = self.qkv(x)
        out = self.attend(rotate(q, rope), rotate(k, rope), v, key_mask)
        return self.to_out[0](out.flatten(2).to(x.dtype))


class FeedForward(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(nn.functional.silu(self.w1(x)) * self.w3(x))


class ZImageBlock(nn.Module):
    """Pre- and post-normed attention and MLP, timestep-modulated except in the context and SigLIP refiners."""

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

    def forward(
        self,
        x: torch.Tensor,
        rope: torch.Tensor,
        key_mask: torch.Tensor | None,
        temb: torch.Tensor | None = None,
        per_token=None,
    ) -> torch.Tensor:
        if self.adaLN_modulation is None:
            x = x + self.attention_norm2(self.attention(self.attention_norm1(x), rope, key_mask))
            return x + self.ffn_norm2(self.feed_forward(self.ffn_norm1(x)))
        scale_attn, gate_attn, scale_mlp, gate_mlp = modulate(self.adaLN_modulation, temb, per_token).chunk(4, dim=2)
        attn = self.attention(self.attention_norm1(x) * (1.0 + scale_attn), rope, key_mask)
        x = x + gate_attn.tanh() * self.attention_norm2(attn)
        return x + gate_mlp.tanh() * self.ffn_norm2(self.feed_forward(self.ffn_norm1(x) * (1.0 + scale_mlp)))


class FinalLayer(nn.Module):
    def __init__(self, dim: int, cond_dim: int, out_features: int) -> None:
        super().__init__()
        self.norm_final = nn.LayerNorm(dim, elementwise_affine=False, eps=1e-6)
        self.linear = nn.Linear(dim, out_features)
        self.adaLN_modulation = nn.Sequential(nn.SiLU(), nn.Linear(cond_dim, dim))

    def forward(self, x: torch.Tensor, temb: torch.Tensor, per_token=None) -> torch.Tensor:
        return self.linear(self.norm_final(x) * (1.0 + modulate(self.adaLN_modulation, temb, per_token)))


class TimestepEmbedder(nn.Module):
    def __init__(self, out_dim: int) -> None:
        super().__init__()
        self.mlp = nn.Sequential(
            nn.Linear(TIMESTEP_FREQUENCIES, TIMESTEP_HIDDEN), nn.SiLU(), nn.Linear(TIMESTEP_HIDDEN, out_dim)
        )

    def forward(self, t: torch.Tensor) -> torch.Tensor:
        return self.mlp(sinusoidal_embedding(t, TIMESTEP_FREQUENCIES).to(self.mlp[0].weight.dtype))


@dataclass
class ZImageTokens:
    # Each field along dim 1 of the stream its name starts with.
    SEQUENCE_FIELDS: ClassVar[dict[str, tuple[str, int]]] = {
        name: (name.split("_")[0], 1) for name in ("img", "txt", "img_rope", "txt_rope", "txt_mask")
    }
    OUTPUT_STREAM: ClassVar[str] = "img"

    img: torch.Tensor  # (B, image tokens rounded up to 32, dim)
    txt: torch.Tensor  # (B, longest caption rounded up to 32, dim)
    img_rope: torch.Tensor  # complex (B, image tokens, head_dim / 2): the first axis depends on the caption
    txt_rope: torch.Tensor  # complex (1, text tokens, head_dim / 2)
    # (B, text tokens) False past a caption's own rounded length; None (every rank agrees) when none is: mask-free.
    txt_mask: torch.Tensor | None
    temb: torch.Tensor  # (B, adaln_dim)

    def per_token(self, *streams: str) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The per-token modulation of ``streams`` concatenated (``modulate``): none, every token is noisy."""
        return None


@dataclass
class ZImageOmniTokens(ZImageTokens):
    """With the Omni inputs: the image stream holds the target's tokens then each condition image's, each padded to
    32; ``sig`` each image's SigLIP tokens, padded alike, then 32 pad tokens for the target (none without images)."""

    SEQUENCE_FIELDS: ClassVar[dict[str, tuple[str, int]]] = {
        **ZImageTokens.SEQUENCE_FIELDS,
        **{name: (name.split("_")[0], 1) for name in ("sig", "sig_rope", "img_noisy", "txt_noisy", "sig_noisy")},
    }

    sig: torch.Tensor  # (B, SigLIP tokens, dim)
    sig_rope: torch.Tensor  # complex (B, SigLIP tokens, head_dim / 2)
    temb_clean: torch.Tensor  # (B, adaln_dim): the embedding of timestep 1, for the clean tokens
    img_noisy: torch.Tensor  # (B, tokens, 1) bool per stream: True for the tokens modulated by ``temb``
    txt_noisy: torch.Tensor
    sig_noisy: torch.Tensor

    def per_token(self, *streams: str) -> tuple[torch.Tensor, torch.Tensor]:
        return self.temb_clean, torch.cat([getattr(self, f"{stream}_noisy") for stream in streams], dim=1)


@dataclass(frozen=True)
class OmniInputs:
    """ZImageOmniPipeline's inputs besides the caption features, laid out once per request."""

    latents: tuple[torch.Tensor, ...]  # each condition image's latents (1, C, H, W)
    siglip: tuple[torch.Tensor, ...]  # each condition image's SigLIP features (B, h, w, siglip_feat_dim)
    caption_rows: torch.Tensor  # (B, T): the caption feature each text-stream row holds, -1 for a pad token
    caption_positions: torch.Tensor  # (B, T) the rows' first rotary axis
    caption_noisy: torch.Tensor  # (B, T, 1) bool
    caption_mask: torch.Tensor | None  # (B, T) bool, False past a row's own length; None when none is shorter
    image_starts: torch.Tensor  # (B, images + 1): each condition image's first rotary axis, then the target's

    @classmethod
    def build(
        cls,
        segments: list[list[int]],
        latents: tuple[torch.Tensor, ...],
        siglip: tuple[torch.Tensor, ...],
        device: torch.device,
    ) -> OmniInputs:
        """``segments``: per caption, the token counts of its template's pieces (``template_segments``), each padded
        to 32; those before the target's are clean."""
        rows, positions, noisy, starts = [], [], [], []
        for lengths in segments:
            row, position, noise, start, real, at = [], [], [], [], 0, 1
            for index, n in enumerate(lengths):
                padded = round_up(n)
                row += [*range(real, real + n), *[-1] * (padded - n)]
                # Numbered as the reference numbers them: a segment's positions run on through its pad tokens, then
                # it appends one (0, 0, 0) per pad token, which the next segment's first rows take, and so on.
                position += [*range(at, at + padded), *[0] * (padded - n)]
                noise += [index >= len(latents)] * padded
                real, at = real + n, at + n
                start.append(at)
                at += 2  # the positions of the segment's image: its latents', then its SigLIP features'
            rows.append(row)
            positions.append(position[: len(row)])
            noisy.append(noise)
            starts.append(start[: len(latents) + 1])
        longest = max(len(row) for row in rows)

        def padded(values: list[list], fill) -> torch.Tensor:
            return torch.tensor([value + [fill] * (longest - len(value)) for value in values], device=device)

        mask = padded([[True] * len(row) for row in rows], False)
        return cls(
            latents,
            siglip,
            padded(rows, -1),
            padded(positions, 0),
            padded(noisy, False)[..., None],
            None if bool(mask.all()) else mask,
            torch.tensor(starts, device=device),
        )


class ZImageTransformer(StagedTransformer):
    # A PipeFusion stage may hold refiner blocks, joint blocks or both.
    BLOCK_LISTS: ClassVar[tuple[str, ...]] = ("noise_refiner", "context_refiner", "siglip_refiner", "layers")
    # Step caching watches the joint stack, as diffusers' hooks do (the refiners always run), and its joint stream.
    CACHED_FROM: ClassVar[str] = "layers"
    CACHE_STREAMS: ClassVar[tuple[str, ...]] = ("img", "txt", "sig")

    def __init__(self, config: ZImageConfig) -> None:
        super().__init__(config)
        dim, patch_features = config.dim, config.patch_size**2 * config.in_channels
        if config.head_dim != sum(config.axes_dims):
            raise ValueError(f"head dim {config.head_dim} != sum of rotary axes_dims {config.axes_dims}")
        self.all_x_embedder = nn.ModuleDict({config.patch_key: nn.Linear(patch_features, dim)})
        self.all_final_layer = nn.ModuleDict({config.patch_key: FinalLayer(dim, config.adaln_dim, patch_features)})

        def refiner(modulated: bool, stream: str) -> nn.ModuleList:
            return nn.ModuleList(ZImageBlock(config, modulated, (stream,)) for _ in range(config.n_refiner_layers))

        def embedder(width: int) -> nn.Sequential:
            return nn.Sequential(RMSNorm(width, eps=config.norm_eps), nn.Linear(width, dim))

        self.noise_refiner = refiner(True, "img")
        self.context_refiner = refiner(False, "txt")
        self.t_embedder = TimestepEmbedder(config.adaln_dim)
        self.cap_embedder = embedder(config.cap_feat_dim)
        self.x_pad_token = nn.Parameter(torch.zeros(1, dim))
        self.cap_pad_token = nn.Parameter(torch.zeros(1, dim))
        self.siglip_refiner = nn.ModuleList()
        joint = ("img", "txt")
        if config.siglip_feat_dim is not None:
            self.siglip_embedder = embedder(config.siglip_feat_dim)
            self.siglip_refiner = refiner(False, "sig")
            self.siglip_pad_token = nn.Parameter(torch.zeros(1, dim))
            joint += ("sig",)
        self.layers = nn.ModuleList(ZImageBlock(config, modulated=True, streams=joint) for _ in range(config.n_layers))
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

    def embed_image(self, latents: torch.Tensor) -> torch.Tensor:
        """Latents (B, C, H, W) as tokens (B, H/p * W/p rounded up to 32, dim), the pad tokens last."""
        tokens = self.all_x_embedder[self.config.patch_key](patchify(latents, self.config.patch_size))
        return with_pad_tokens(tokens, self.x_pad_token)

    def embed(
        self,
        hidden_states: torch.Tensor,
        timestep: torch.Tensor,
        encoder_hidden_states: torch.Tensor,
        encoder_attention_mask: torch.Tensor | None = None,
        omni: OmniInputs | None = None,
    ) -> ZImageTokens:
        """``timestep``: (B,) 1 - sigma; captions right-padded where the mask is False; ``omni``'s are its segments."""
        batch, device = hidden_states.shape[0], hidden_states.device
        rows, cols = (side // self.config.patch_size for side in hidden_states.shape[2:])
        temb = self.t_embedder(timestep * self.config.t_scale).to(hidden_states.dtype)
        if omni is not None:
            return self.embed_omni(hidden_states, timestep, temb, encoder_hidden_states, omni)

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
        txt_mask = None if encoder_attention_mask is None else text_index < caption_lens[:, None]
        return ZImageTokens(
            img=self.embed_image(hidden_states),
            txt=txt,
            img_rope=self.rope(image_positions(caption_lens + 1, raster_grid(rows, cols, device))),
            txt_rope=self.rope(nn.functional.pad((text_index + 1)[None, :, None], (0, 2))),
            txt_mask=txt_mask,
            temb=temb,
        )

    def embed_omni(
        self,
        latents: torch.Tensor,
        timestep: torch.Tensor,
        temb: torch.Tensor,
        captions: torch.Tensor,
        omni: OmniInputs,
    ) -> ZImageOmniTokens:
        """Each image sits on the first rotary axis where its caption segment ends, its SigLIP features one further,
        their grid stretched over its latents' (not its tokens') rows and columns, as the reference stretches it."""
        batch, device, patch = latents.shape[0], latents.device, self.config.patch_size
        embedded = self.cap_embedder(captions)
        rows = omni.caption_rows
        txt = embedded.gather(1, rows.clamp(min=0)[..., None].expand(-1, -1, embedded.shape[-1]))
        txt = torch.where(rows[..., None] >= 0, txt, self.cap_pad_token.to(txt.dtype))

        def noisy(stream: list[torch.Tensor], flags: list[bool]) -> torch.Tensor:
            return torch.cat(
                [torch.full((batch, part.shape[1], 1), flag, device=device) for part, flag in zip(stream, flags)], dim=1
            )

        images = (latents, *(image.expand(batch, -1, -1, -1) for image in omni.latents))
        starts = omni.image_starts.roll(1, dims=1)  # the target's first, as its tokens are
        img = [self.embed_image(image) for image in images]
        grids = [raster_grid(image.shape[2] // patch, image.shape[3] // patch, device) for image in images]
        img_positions = [image_positions(starts[:, j], grid) for j, grid in enumerate(grids)]
        sig, sig_positions = [], []
        for j, (features, image) in enumerate(zip(omni.siglip, omni.latents)):
            height, width = features.shape[1:3]
            # The reference's flattening: the (C, h, w) view's elements read as (h * w, C) rows.
            flat = features.permute(0, 3, 1, 2).reshape(batch, height * width, -1)
            sig.append(with_pad_tokens(self.siglip_embedder(flat), self.siglip_pad_token))
            scale = torch.tensor([max(height - 1, 1), max(width - 1, 1)], device=device)
            stretched = raster_grid(height, width, device) / scale * torch.tensor(image.shape[2:], device=device).sub(1)
            sig_positions.append(image_positions(omni.image_starts[:, j] + 1, stretched.long()))
        # The target's SigLIP slot, pad tokens only; without condition images there is no SigLIP stream at all.
        target_slot = SEQUENCE_MULTIPLE if omni.latents else 0
        sig.append(self.siglip_pad_token.to(txt.dtype).expand(batch, target_slot, -1))
        sig_positions.append(torch.zeros(batch, target_slot, 3, dtype=torch.long, device=device))
        clean = [False] * len(omni.latents)
        return ZImageOmniTokens(
            img=torch.cat(img, dim=1),
            txt=txt,
            img_rope=self.rope(torch.cat(img_positions, dim=1)),
            txt_rope=self.rope(nn.functional.pad(omni.caption_positions[..., None], (0, 2))),
            txt_mask=omni.caption_mask,
            temb=temb,
            sig=torch.cat(sig, dim=1),
            sig_rope=self.rope(torch.cat(sig_positions, dim=1)),
            temb_clean=self.t_embedder(torch.ones_like(timestep) * self.config.t_scale).to(latents.dtype),
            img_noisy=noisy(img, [True, *clean]),
            txt_noisy=omni.caption_noisy,
            sig_noisy=noisy(sig, [*clean, True]),
        )

    def run_blocks(self, tokens: ZImageTokens) -> ZImageTokens:
        streams = {"img": tokens.img, "txt": tokens.txt}
        for block in self.noise_refiner:
            streams["img"] = block(streams["img"], tokens.img_rope, None, tokens.temb, tokens.per_token("img"))
        for block in self.context_refiner:
            streams["txt"] = block(streams["txt"], tokens.txt_rope, tokens.txt_mask)
        if isinstance(tokens, ZImageOmniTokens):
            streams["sig"] = tokens.sig
            for block in self.siglip_refiner:
                streams["sig"] = block(streams["sig"], tokens.sig_rope, None)

        batch = tokens.img.shape[0]
        rope = torch.cat([getattr(tokens, f"{name}_rope").expand(batch, -1, -1) for name in streams], dim=1)
        mask = tokens.txt_mask
        if mask is not None:  # only captions are padded to the batch's longest
            mask = torch.cat([mask if name == "txt" else mask.new_ones(x.shape[:2]) for name, x in streams.items()], 1)
        x = torch.cat(list(streams.values()), dim=1)
        per_token = tokens.per_token(*streams)
        for block in self.layers:
            x = block(x, rope, mask, tokens.temb, per_token)
        for name, part in zip(streams, x.split([part.shape[1] for part in streams.values()], dim=1)):
            setattr(tokens, name, part)
        return tokens

    def head(self, tokens: ZImageTokens) -> torch.Tensor:
        return self.all_final_layer[self.config.patch_key](tokens.img, tokens.temb, tokens.per_token("img"))
