"""FLUX.3's transformer, diffusers' ``Flux3Transformer2DModel``: per-mode blocks (image, reference images and text,
each attending to itself only), then joint single blocks over [text, image, references]."""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import nn

from paradit.families.flux2.model import FeedForward
from paradit.layers.attention import AttentionDispatch
from paradit.layers.embeddings import EmbeddingMLP, sinusoidal_embedding
from paradit.layers.modulation import AdaLayerNormOut, Modulation, split_modulation
from paradit.layers.rotary import apply_rope_interleaved, multi_axis_rope
from paradit.layers.stages import HeadsConfig, JointTokens, StagedTransformer


@dataclass(frozen=True)
class Flux3Config(HeadsConfig):
    in_channels: int = 128
    cond_in_channels: int = 128
    out_channels: int | None = None  # not in diffusers' config: the output has ``in_channels``
    num_layers: int = 5
    num_single_layers: int = 28
    attention_head_dim: int = 128
    num_attention_heads: int = 24
    joint_attention_dim: int = 20480
    timestep_channels: int = 256
    mlp_ratio: float = 3.0
    axes_dims_rope: tuple[int, ...] = (32, 32, 32, 32)
    rope_theta: int = 10000
    eps: float = 1e-6
    flow_map: bool = False


# The token modes, by diffusers' module keys, and the stream each one's tokens travel in.
IMAGE, REFERENCE, TEXT = "image", "image_cond", "txt"
STREAMS = {IMAGE: "img", REFERENCE: "cond", TEXT: "txt"}
JOINT_STREAMS = ("txt", "img", "cond")  # the joint blocks' concatenation order, diffusers'


def fp32_rms_norm(norm: nn.RMSNorm, x: torch.Tensor) -> torch.Tensor:
    """The Q/K norms run in float32 whatever the model's dtype: diffusers keeps them in fp32, as BFL's code does."""
    return nn.functional.rms_norm(x.float(), norm.normalized_shape, norm.weight.float(), norm.eps)


class Flux3Attention(AttentionDispatch):
    """Self-attention over the tokens it is given: one mode's, or the joint sequence."""

    def __init__(self, config: Flux3Config, streams: tuple[str, ...]) -> None:
        super().__init__(sequence_streams=streams)
        dim, self.head_dim = config.inner_dim, config.attention_head_dim
        # The tensor plan divides ``heads`` by its degree.
        self.heads = config.num_attention_heads
        self.to_q = nn.Linear(dim, dim, bias=False)
        self.to_k = nn.Linear(dim, dim, bias=False)
        self.to_v = nn.Linear(dim, dim, bias=False)
        self.norm_q = nn.RMSNorm(self.head_dim, eps=config.eps)
        self.norm_k = nn.RMSNorm(self.head_dim, eps=config.eps)
        self.to_out = nn.ModuleList([nn.Linear(dim, dim, bias=False)])

    def forward(
        self,
        x: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        key_mask: torch.Tensor | None = None,
        kept: tuple[int, int] | None = None,
    ) -> torch.Tensor:
        """``kept`` (start, stop): the output of those rows alone (their queries), attending to every row's keys."""
        rows, (cos, sin) = slice(None) if kept is None else slice(*kept), rope
        q = self.to_q(x[:, rows]).unflatten(-1, (-1, self.head_dim))
        k, v = (linear(x).unflatten(-1, (-1, self.head_dim)) for linear in (self.to_k, self.to_v))
        # Rotated in float32 too, then one cast back.
        q = apply_rope_interleaved(fp32_rms_norm(self.norm_q, q), cos[rows], sin[rows])
        k = apply_rope_interleaved(fp32_rms_norm(self.norm_k, k), cos, sin)
        out = self.attend(q.to(v.dtype), k.to(v.dtype), v, key_mask)
        return self.to_out[0](out.flatten(2).to(v.dtype))


class Flux3ModeBlock(nn.Module):
    """Attention and MLP side by side on one modulated input, over one mode's tokens."""

    def __init__(self, config: Flux3Config, stream: str) -> None:
        super().__init__()
        dim, self.stream = config.inner_dim, stream
        self.norm = nn.LayerNorm(dim, elementwise_affine=False, eps=config.eps)
        self.attn = Flux3Attention(config, (stream,))
        self.ff = FeedForward(dim, config.mlp_ratio)

    def forward(
        self,
        x: torch.Tensor,
        mod: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        key_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        ((shift, scale, gate),) = split_modulation(mod, 1)
        normed = (1 + scale) * self.norm(x) + shift
        return x + gate * (self.attn(normed, rope, key_mask) + self.ff(normed))


class ModeBlocks(nn.Module):
    """diffusers' ``mode_blocks`` (a list per image mode, so the checkpoint's names), iterated as one run of blocks:
    the image's, then the references'. Each block knows its stream, so a slice of the run (a step cache's, a PipeFusion
    stage's) still runs each block on its own tokens."""

    def __init__(self, lists: dict[str, nn.ModuleList]) -> None:
        super().__init__()
        for mode, blocks in lists.items():
            self.add_module(mode, blocks)

    def __iter__(self) -> Iterator[Flux3ModeBlock]:
        return itertools.chain.from_iterable(self.children())

    def __len__(self) -> int:
        return sum(len(blocks) for blocks in self.children())

    def __getitem__(self, index: slice) -> nn.ModuleList:
        return nn.ModuleList(list(self)[index])


class Flux3SingleBlock(nn.Module):
    """The same body over the joint sequence, each mode's tokens modulated by its own vector."""

    def __init__(self, config: Flux3Config) -> None:
        super().__init__()
        dim = config.inner_dim
        self.norm = nn.LayerNorm(dim, elementwise_affine=False, eps=config.eps)
        self.attn = Flux3Attention(config, JOINT_STREAMS)
        self.ff = FeedForward(dim, config.mlp_ratio)

    def forward(
        self,
        streams: list[torch.Tensor],
        mods: list[torch.Tensor],
        rope: tuple[torch.Tensor, torch.Tensor],
        key_mask: torch.Tensor | None = None,
        kept_stream: int | None = None,
    ) -> list[torch.Tensor]:
        """``streams`` and ``mods`` in ``JOINT_STREAMS`` order, ``rope`` and ``key_mask`` over their concatenation.
        ``kept_stream``: the next state of that stream alone (the last block's: the others' are dropped after it),
        the others returned as they came; every stream's keys and values are still attended to."""
        triples = [split_modulation(mod, 1)[0] for mod in mods]
        normed = torch.cat([(1 + scale) * self.norm(x) + shift for x, (shift, scale, _) in zip(streams, triples)], 1)
        if kept_stream is not None:
            start = sum(x.shape[1] for x in streams[:kept_stream])
            stop = start + streams[kept_stream].shape[1]
            out = self.attn(normed, rope, key_mask, (start, stop)) + self.ff(normed[:, start:stop])
            gate = triples[kept_stream][2]
            return [x + gate * out if n == kept_stream else x for n, x in enumerate(streams)]
        out = (self.attn(normed, rope, key_mask) + self.ff(normed)).split([x.shape[1] for x in streams], dim=1)
        return [x + gate * part for x, part, (_, _, gate) in zip(streams, out, triples)]


@dataclass
class Flux3Tokens(JointTokens):
    """The three streams (``cond`` empty without references) and each mode's modulation vectors, (B, 3 * dim)."""

    SEQUENCE_FIELDS: ClassVar[dict[str, tuple[str, int]]] = {
        **JointTokens.SEQUENCE_FIELDS,
        "cond": ("cond", 1),
        "cond_rope": ("cond", 0),
        "txt_mask": ("txt", 1),
    }

    cond: torch.Tensor
    cond_rope: tuple[torch.Tensor, torch.Tensor]
    temb: torch.Tensor  # the image tokens' embedding (B, dim), which the output layer reads
    early_mods: dict[str, torch.Tensor]  # stream -> the per-mode blocks' modulation
    single_mods: dict[str, torch.Tensor]  # stream -> the joint blocks' modulation
    # (B, text tokens) False for a shorter prompt's padding in a batch (diffusers runs one prompt a call); None: none.
    txt_mask: torch.Tensor | None = None
    prefixed: bool = False  # the text and references come through their per-mode blocks already (``encode_prefix``)
    # Only the image's prediction is wanted: the last joint block computes its rows alone (the text's and the
    # references' are dropped after it; those streams keep the state they entered it with).
    image_only: bool = False


class Flux3Transformer(StagedTransformer):
    BLOCK_LISTS: ClassVar[tuple[str, ...]] = ("txt_mode_blocks", "mode_blocks", "single_transformer_blocks")
    # Step caching watches the joint stack (the per-mode blocks always run) and every stream leaving it.
    CACHED_FROM: ClassVar[str] = "single_transformer_blocks"
    CACHE_STREAMS: ClassVar[tuple[str, ...]] = JOINT_STREAMS

    def __init__(self, config: Flux3Config) -> None:
        super().__init__(config)
        dim, channels = config.inner_dim, config.timestep_channels
        self.timestep_embedder = EmbeddingMLP(channels, dim, bias=False)
        # A flow map (the step-distilled checkpoints) also embeds the timestep each step jumps to.
        self.target_timestep_embedder = EmbeddingMLP(channels, dim, bias=False) if config.flow_map else None
        modes = (IMAGE, REFERENCE, TEXT)
        self.early_stream_modulations = nn.ModuleDict({mode: Modulation(dim, 1, bias=False) for mode in modes})
        self.single_stream_modulations = nn.ModuleDict({mode: Modulation(dim, 1, bias=False) for mode in modes})
        self.x_embedders = nn.ModuleDict(
            {
                IMAGE: nn.Linear(config.in_channels, dim, bias=False),
                REFERENCE: nn.Linear(config.cond_in_channels, dim, bias=False),
            }
        )
        self.context_embedder = nn.Linear(config.joint_attention_dim, dim, bias=False)

        def mode_blocks(mode: str) -> nn.ModuleList:
            return nn.ModuleList(Flux3ModeBlock(config, STREAMS[mode]) for _ in range(config.num_layers))

        self.mode_blocks = ModeBlocks({IMAGE: mode_blocks(IMAGE), REFERENCE: mode_blocks(REFERENCE)})
        self.txt_mode_blocks = mode_blocks(TEXT)
        self.single_transformer_blocks = nn.ModuleList(
            Flux3SingleBlock(config) for _ in range(config.num_single_layers)
        )
        self.norm_out = AdaLayerNormOut(dim, dim, eps=config.eps, bias=False)
        self.proj_out = nn.Linear(dim, config.in_channels, bias=False)

    def rope(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return multi_axis_rope(ids, self.config.axes_dims_rope, self.config.rope_theta)

    def time_embedding(self, embedder: EmbeddingMLP, sigma: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """``sigma`` (B,) in [0, 1], scaled to [0, 1000] in the model's dtype before its features, as diffusers does."""
        features = sinusoidal_embedding(sigma.to(dtype) * 1000, self.config.timestep_channels)
        return embedder(features.to(dtype))

    def embed(
        self,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor,
        timestep: torch.Tensor,
        img_ids: torch.Tensor,
        txt_ids: torch.Tensor,
        image_cond_hidden_states: torch.Tensor | None = None,
        image_cond_ids: torch.Tensor | None = None,
        target_timestep: torch.Tensor | None = None,
        encoder_attention_mask: torch.Tensor | None = None,
        prefixed: bool = False,
        image_only: bool = False,
    ) -> Flux3Tokens:
        """diffusers' forward arguments. The image tokens sit at ``timestep``, the text and the references at 0; a flow
        map adds the embedding of ``target_timestep`` (the step's destination) to every mode's. The mask (not
        diffusers') hides the padding of the shorter prompts in a batch, which then equal their own calls.
        ``prefixed``: the text and references given are ``encode_prefix``'s, their per-mode blocks run already.
        ``image_only``: only the image's prediction is wanted (the last joint block computes no other rows)."""
        if (target_timestep is not None) != self.config.flow_map:
            raise ValueError("target_timestep is what a flow-map transformer, and only one, takes")
        batch, dtype = hidden_states.shape[0], hidden_states.dtype
        image_temb = self.time_embedding(self.timestep_embedder, timestep, dtype)
        clean_temb = self.time_embedding(self.timestep_embedder, timestep.new_zeros(batch), dtype)
        if target_timestep is not None:
            target_temb = self.time_embedding(self.target_timestep_embedder, target_timestep, dtype)
            image_temb, clean_temb = image_temb + target_temb, clean_temb + target_temb
        tembs = {IMAGE: image_temb, REFERENCE: clean_temb, TEXT: clean_temb}
        if prefixed:
            txt, cond = encoder_hidden_states, image_cond_hidden_states
            if cond is None:
                cond = hidden_states.new_zeros(batch, 0, self.config.inner_dim)
        else:
            txt, cond = self.embed_clean(encoder_hidden_states, image_cond_hidden_states)
        if image_cond_ids is None:  # an empty reference stream: every plan sees the same three streams
            image_cond_ids = img_ids.new_zeros(0, img_ids.shape[-1])
        return Flux3Tokens(
            img=self.x_embedders[IMAGE](hidden_states),
            txt=txt,
            img_rope=self.rope(img_ids),
            txt_rope=self.rope(txt_ids),
            cond=cond.expand(batch, -1, -1),
            cond_rope=self.rope(image_cond_ids),
            temb=image_temb,
            early_mods={STREAMS[m]: self.early_stream_modulations[m](temb) for m, temb in tembs.items()},
            single_mods={STREAMS[m]: self.single_stream_modulations[m](temb) for m, temb in tembs.items()},
            txt_mask=encoder_attention_mask,
            prefixed=prefixed,
            image_only=image_only,
        )

    def embed_clean(
        self, encoder_hidden_states: torch.Tensor, image_cond_hidden_states: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The text and the references (an empty stream without any) projected to the model's width."""
        if image_cond_hidden_states is None:
            image_cond_hidden_states = encoder_hidden_states.new_zeros(1, 0, self.config.cond_in_channels)
        return self.context_embedder(encoder_hidden_states), self.x_embedders[REFERENCE](image_cond_hidden_states)

    def encode_prefix(
        self,
        encoder_hidden_states: torch.Tensor,
        txt_ids: torch.Tensor,
        image_cond_hidden_states: torch.Tensor | None = None,
        image_cond_ids: torch.Tensor | None = None,
        encoder_attention_mask: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The text and the references through their per-mode blocks, for ``embed(..., prefixed=True)``. Without a
        flow map they are modulated at t = 0 whatever the step and attend to themselves only: what every step of a
        request would compute again. The references' rows (one) stand for every sample's."""
        if self.config.flow_map:
            raise ValueError("a flow map's text and references are modulated by each step's target: no prefix")
        txt, cond = self.embed_clean(encoder_hidden_states, image_cond_hidden_states)
        if image_cond_ids is None:
            image_cond_ids = txt_ids.new_zeros(0, txt_ids.shape[-1])
        clean_temb = self.time_embedding(self.timestep_embedder, txt.new_zeros(txt.shape[0]), txt.dtype)
        txt_mod, txt_rope = self.early_stream_modulations[TEXT](clean_temb), self.rope(txt_ids)
        for block in self.txt_mode_blocks:
            txt = block(txt, txt_mod, txt_rope, encoder_attention_mask)
        cond_mod, cond_rope = self.early_stream_modulations[REFERENCE](clean_temb[:1]), self.rope(image_cond_ids)
        for block in getattr(self.mode_blocks, REFERENCE):
            cond = block(cond, cond_mod, cond_rope)
        return txt, cond

    def run_blocks(self, tokens: Flux3Tokens) -> Flux3Tokens:
        for block in itertools.chain(self.txt_mode_blocks, self.mode_blocks):
            stream = block.stream
            if tokens.prefixed and stream != "img":
                continue
            x, rope = getattr(tokens, stream), getattr(tokens, f"{stream}_rope")
            setattr(
                tokens, stream, block(x, tokens.early_mods[stream], rope, tokens.txt_mask if stream == "txt" else None)
            )
        streams = [getattr(tokens, name) for name in JOINT_STREAMS]
        mods = [tokens.single_mods[name] for name in JOINT_STREAMS]
        ropes = [getattr(tokens, f"{name}_rope") for name in JOINT_STREAMS]
        rope = tuple(torch.cat(tables, dim=0) for tables in zip(*ropes))
        mask = tokens.txt_mask
        if mask is not None:  # built once per forward: the parallel runtime gathers it once per tensor it sees
            mask = torch.cat([mask, *(mask.new_ones(x.shape[:2]) for x in streams[1:])], dim=1)
        blocks, image = self.single_transformer_blocks, JOINT_STREAMS.index("img")
        for index, block in enumerate(blocks):
            kept = image if tokens.image_only and index == len(blocks) - 1 else None
            streams = block(streams, mods, rope, mask, kept)
        tokens.txt, tokens.img, tokens.cond = streams
        return tokens
