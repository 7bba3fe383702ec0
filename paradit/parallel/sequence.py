"""Sequence parallelism: split the token streams after ``embed``, attend across ranks, gather before the output.

Every rank holds a contiguous chunk of each token stream (``torch.tensor_split`` sizes, so any length works) and
runs the model's blocks on it unchanged. Only attention needs the whole sequence; the model's attention modules get
a ``SequenceParallelAttention`` in place of local SDPA:

- **Ulysses**: one all-to-all trades the sequence split for a head split (heads need not divide the degree: ranks
  take ``tensor_split`` shares), full attention on those heads, one all-to-all back. The heads travel in chunks so
  that each chunk's attention runs while the next chunk's Q/K/V and the last chunk's output are in flight.
- **Ring**: K/V blocks travel round the ring; each rank attends its queries to every block as it arrives, merging
  partial results by log-sum-exp, with the next transfer in flight during the current block's attention.
- **USP**: Ulysses inside groups of neighbouring ranks, Ring across the groups.

Uneven splits are carried as per-rank sizes rather than padding, so no attention mask is needed and no byte is
sent for padding. Attention is order-invariant over keys and the all-to-alls return every query to its own rank,
so the chunk order seen inside attention does not matter.

An attention module whose ``sequence_streams`` is empty takes its keys from no split stream: every rank holds them
whole (Wan's cross-attention to the text), so each rank's query chunk attends to them with its plain local attention
and nothing is exchanged; such modules are left as they are.

Each attention module's *local* attention, run on this rank's heads over the gathered sequence, is plain SDPA;
PipeFusion, applied over this wrapper, makes it its stale-K/V attention (``set_local_attention``) and uses
``split`` and ``gather`` to split each patch across a stage's sequence group.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import Iterator
from contextvars import ContextVar

import torch
from torch import nn

from paradit.layers.attention import AttentionDispatch, AttentionFn, attention_with_lse, sdpa_attention
from paradit.parallel.comm import RingExchange, all_gather_uneven, split_sizes, start_all_to_all_uneven
from paradit.parallel.mesh import ParallelContext
from paradit.parallel.transport import decode_fp8_rows, encode_fp8_rows

# Ulysses' exchanges overlap its attention: the heads travel in this many chunks, so that while one chunk is attended
# the next chunk's Q/K/V and the previous chunk's output are in flight. More chunks hide more of the exchange behind
# attention but send smaller messages and run smaller attention calls.
ULYSSES_CHUNKS = 2


# The layout of the forward in flight: stream -> tokens per sequence rank. It travels with the tokens: whoever splits
# them (``SequenceParallel.forward``, PipeFusion for each patch) runs the blocks inside ``sequence_layout(sizes)``,
# and the attention calls within read it. A context variable rather than an attribute, so that no state outlives its
# forward and two forwards in flight (threads, tasks) never see each other's.
_LAYOUT: ContextVar[dict[str, list[int]]] = ContextVar("paradit_sequence_layout")


@contextlib.contextmanager
def sequence_layout(sizes: dict[str, list[int]]) -> Iterator[None]:
    """Attention calls inside see ``sizes`` (stream -> tokens per sequence rank) as their forward's layout."""
    token = _LAYOUT.set(sizes)
    try:
        yield
    finally:
        _LAYOUT.reset(token)


class SequenceParallelAttention:
    """Attention over a sequence split across the group.

    Each call names the streams its tokens are made of (an attention module's ``sequence_streams``; None: all of
    them); with the forward's layout (``sequence_layout``) that gives every rank's token count for the call without
    any communication.
    """

    def __init__(self, context: ParallelContext) -> None:
        self.context = context
        self.ulysses = context.config.ulysses
        self.ring = context.config.ring
        self.ulysses_group = context.group("ulysses")
        self.ring_exchange = RingExchange(context.group("ring"), context.stats) if self.ring > 1 else None
        self.fp8_transport = context.config.comm_dtype == "fp8"
        self.local_lengths: list[int] = []  # tokens per sequence rank in this call, in chunk order
        self._mask_seen: torch.Tensor | None = None
        self._mask_gathered: torch.Tensor | None = None

    def _ulysses_lengths(self) -> list[int]:
        row = self.context.local_rank("ring") * self.ulysses
        return self.local_lengths[row : row + self.ulysses]

    def _ring_lengths(self) -> list[int]:
        return [sum(self.local_lengths[r * self.ulysses : (r + 1) * self.ulysses]) for r in range(self.ring)]

    def heads_to_sequence(self, x: torch.Tensor) -> torch.Tensor:
        """(B, L_me, H, D) -> (B, L_group, H_me, D): gather this Ulysses group's tokens, keep a share of the heads."""
        if not self.fp8_transport:
            return self._heads_to_sequence(x)
        return decode_fp8_rows(self._heads_to_sequence(encode_fp8_rows(x)), x.dtype)

    def sequence_to_heads(self, out: torch.Tensor, heads: int) -> torch.Tensor:
        """(B, L_group, H_me, D) -> (B, L_me, H, D): the inverse of ``heads_to_sequence``."""
        if not self.fp8_transport:
            return self._sequence_to_heads(out, heads)
        return decode_fp8_rows(self._sequence_to_heads(encode_fp8_rows(out), heads), out.dtype)

    def _head_ranges(self, heads: int, chunk: int = 0, chunks: int = 1) -> list[tuple[int, int]]:
        """(first head, count) that each Ulysses rank attends, in rank order: its ``tensor_split`` share of ``heads``,
        or the ``chunk``-th of ``chunks`` parts of that share."""
        owned = split_sizes(heads, self.ulysses)
        ranges = []
        for rank, count in enumerate(owned):
            parts = split_sizes(count, chunks)
            ranges.append((sum(owned[:rank]) + sum(parts[:chunk]), parts[chunk]))
        return ranges

    def _heads_to_sequence(self, x: torch.Tensor) -> torch.Tensor:
        return self._post_heads_to_sequence(x, self._head_ranges(x.shape[2]))()

    def _sequence_to_heads(self, out: torch.Tensor, heads: int) -> torch.Tensor:
        batch, _, _, dim = out.shape
        me = self.context.local_rank("ulysses")
        into = out.new_empty(batch, self._ulysses_lengths()[me], heads, dim)
        self._post_sequence_to_heads(out, self._head_ranges(heads), into)()
        return into

    def _post_heads_to_sequence(self, x: torch.Tensor, ranges: list[tuple[int, int]]):
        """Post the exchange that gives Ulysses rank j the heads ``ranges[j]`` of the group's tokens; returns the
        function that waits for it and gives (B, L_group, this rank's count, D). One copy lays the send buffer out by
        destination; with batch 1 the receive buffer already is the result."""
        batch, length, _, dim = x.shape
        me = self.context.local_rank("ulysses")
        lengths = self._ulysses_lengths()
        send_numels = [batch * length * count * dim for _, count in ranges]
        send = x.new_empty(sum(send_numels))
        for chunk, (first, count) in zip(send.split(send_numels), ranges):
            chunk.view(batch, length, count, dim).copy_(x[:, :, first : first + count])
        mine = ranges[me][1]
        recv_numels = [batch * n * mine * dim for n in lengths]
        recv, work = start_all_to_all_uneven(send, send_numels, recv_numels, self.ulysses_group, self.context.stats)

        def finish() -> torch.Tensor:
            work.wait()
            if batch == 1:
                return recv.view(1, sum(lengths), mine, dim)
            parts = [part.view(batch, n, mine, dim) for part, n in zip(recv.split(recv_numels), lengths)]
            return torch.cat(parts, dim=1)

        return finish

    def _post_sequence_to_heads(self, out: torch.Tensor, ranges: list[tuple[int, int]], into: torch.Tensor):
        """Post the exchange that returns ``out`` (B, L_group, heads ``ranges[me]``, D) to the ranks its tokens came
        from; returns the function that waits for it and writes every rank's heads ``ranges[j]`` of this rank's
        tokens into ``into`` (B, L_me, H, D)."""
        batch, _, local_heads, dim = out.shape
        me = self.context.local_rank("ulysses")
        lengths = self._ulysses_lengths()
        if batch == 1:  # the chunks for each destination are already consecutive
            send = out.contiguous().view(-1)
        else:
            send = torch.cat([part.reshape(-1) for part in out.split(lengths, dim=1)])
        send_numels = [batch * n * local_heads * dim for n in lengths]
        recv_numels = [batch * lengths[me] * count * dim for _, count in ranges]
        recv, work = start_all_to_all_uneven(send, send_numels, recv_numels, self.ulysses_group, self.context.stats)

        def finish() -> None:
            work.wait()
            for part, (first, count) in zip(recv.split(recv_numels), ranges):
                into[:, :, first : first + count] = part.view(batch, lengths[me], count, dim)

        return finish

    def ulysses_overlapped(
        self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, key_mask: torch.Tensor | None
    ) -> torch.Tensor:
        """Ulysses attention (no Ring, plain SDPA) in head chunks: chunk c is attended while chunk c + 1's Q/K/V and
        chunk c - 1's output travel. Exact: attention is independent per head. ``key_mask``: the gathered mask."""
        heads = query.shape[2]
        chunks = [self._head_ranges(heads, c, ULYSSES_CHUNKS) for c in range(ULYSSES_CHUNKS)]
        chunks = [ranges for ranges in chunks if any(count for _, count in ranges)]
        wire = [encode_fp8_rows(t) for t in (query, key, value)] if self.fp8_transport else [query, key, value]
        batch, length, _, width = wire[0].shape
        into = wire[0].new_empty(batch, length, heads, width)  # the output, in the wire's form

        def post(ranges):
            return [self._post_heads_to_sequence(t, ranges) for t in wire]

        pending, returning = post(chunks[0]), []
        for index, ranges in enumerate(chunks):
            q, k, v = (finish() for finish in pending)
            if self.fp8_transport:
                q, k, v = (decode_fp8_rows(t, query.dtype) for t in (q, k, v))
            if index + 1 < len(chunks):
                pending = post(chunks[index + 1])
            out = sdpa_attention(q, k, v, key_mask)
            out = encode_fp8_rows(out) if self.fp8_transport else out
            returning.append(self._post_sequence_to_heads(out, ranges, into))
        for finish in returning:
            finish()
        return decode_fp8_rows(into, query.dtype) if self.fp8_transport else into

    def ring_attention(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_mask: torch.Tensor | None
    ) -> torch.Tensor:
        """Exact attention of local queries over every ring rank's K/V, one block at a time; ``key_mask`` is this
        ring member's (Ulysses-gathered) key mask."""
        lengths = self._ring_lengths()
        me = self.context.local_rank("ring")
        masks = None
        if key_mask is not None:
            ring_group = self.context.group("ring")
            gathered = all_gather_uneven(key_mask.to(torch.uint8), 1, lengths, ring_group, self.context.stats)
            masks = gathered.bool().split(lengths, dim=1)
        kv = [k, v]
        # What travels: K and V themselves, or (with FP8 transport) their FP8 bytes and per-row scales. A rank's
        # own block is always used as computed; only the copies that cross the wire are quantised.
        wire = self._to_wire(kv)
        out_acc = lse_acc = None
        for step in range(self.ring):
            source = (me - step) % self.ring
            if step + 1 < self.ring:
                length = lengths[(source - 1) % self.ring]
                shapes = [(t.shape[0], length, *t.shape[2:]) for t in wire]
                next_wire, pending = self.ring_exchange.start(wire, shapes)
            out, lse = attention_with_lse(q, *kv, masks[source] if masks else None)
            lse = lse.transpose(1, 2).unsqueeze(-1)  # (B, L, H, 1), aligned with out
            if out_acc is None:
                out_acc, lse_acc = out.float(), lse
            else:
                merged = torch.logaddexp(lse_acc, lse)
                # A query with every key masked so far has lse -inf on both sides; its weights stay 0, not NaN.
                merged_safe = torch.where(torch.isinf(merged), torch.zeros_like(merged), merged)
                out_acc = out_acc * torch.exp(lse_acc - merged_safe) + out.float() * torch.exp(lse - merged_safe)
                lse_acc = merged
            if step + 1 < self.ring:
                for work in pending:
                    work.wait()
                wire = next_wire
                kv = self._from_wire(wire, k.dtype)
        return out_acc.to(q.dtype)

    def ring_gather(
        self, k: torch.Tensor, v: torch.Tensor, key_mask: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Every ring member's K/V (and key mask) in ring order: with the Ulysses gather inside each member, the
        whole call's sequence in sequence-rank order, for this rank's heads."""
        lengths, group = self._ring_lengths(), self.context.group("ring")
        gathered = [all_gather_uneven(t, 1, lengths, group, self.context.stats) for t in self._to_wire([k, v])]
        k, v = self._from_wire(gathered, k.dtype)
        if key_mask is not None:
            key_mask = all_gather_uneven(key_mask.to(torch.uint8), 1, lengths, group, self.context.stats).bool()
        return k, v, key_mask

    def _to_wire(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        return [encode_fp8_rows(t) for t in tensors] if self.fp8_transport else tensors

    def _from_wire(self, wire: list[torch.Tensor], dtype: torch.dtype) -> list[torch.Tensor]:
        return [decode_fp8_rows(t, dtype) for t in wire] if self.fp8_transport else wire

    def gather_key_mask(self, key_mask: torch.Tensor) -> torch.Tensor:
        """This Ulysses group's key masks in the order ``heads_to_sequence`` gathers the keys. Every layer of a
        forward passes the same mask tensor, so it is gathered once and reused."""
        if key_mask is not self._mask_seen:
            as_bytes = key_mask.to(torch.uint8)  # gloo carries no bool
            gathered = all_gather_uneven(as_bytes, 1, self._ulysses_lengths(), self.ulysses_group, self.context.stats)
            self._mask_seen, self._mask_gathered = key_mask, gathered.bool()
        return self._mask_gathered

    # Compiled blocks break their graph here: the collectives run eagerly between the compiled halves of a block.
    @torch.compiler.disable
    def __call__(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        key_mask: torch.Tensor | None = None,
        streams: tuple[str, ...] | None = None,
        local: AttentionFn = sdpa_attention,
    ) -> torch.Tensor:
        """``local`` attends this rank's heads over the gathered sequence. With Ring, plain SDPA runs block by block
        as the K/V blocks travel; any other local attention (PipeFusion's K/V buffer) needs every key at once, so the
        ring members' K/V are all-gathered for it instead (the same bytes, without the overlap)."""
        layout = _LAYOUT.get()
        sizes = [layout[name] for name in (streams or layout)]
        self.local_lengths = [sum(column) for column in zip(*sizes)]
        if not any(self.local_lengths):  # no rank holds a token of these streams (PipeFusion's text-less patches)
            return query
        heads = query.shape[2]
        if self.ulysses > 1 and self.ring == 1 and local is sdpa_attention:
            gathered_mask = None if key_mask is None else self.gather_key_mask(key_mask)
            return self.ulysses_overlapped(query, key, value, gathered_mask)
        if self.ulysses > 1:
            query, key, value = (self.heads_to_sequence(t) for t in (query, key, value))
            if key_mask is not None:
                key_mask = self.gather_key_mask(key_mask)
        if self.ring > 1 and local is sdpa_attention:
            out = self.ring_attention(query, key, value, key_mask)
        elif self.ring > 1:
            out = local(query, *self.ring_gather(key, value, key_mask))
        else:
            out = local(query, key, value, key_mask)
        return self.sequence_to_heads(out, heads) if self.ulysses > 1 else out


def _narrow(value, dim: int, start: int, length: int):
    if value is None:  # an optional per-token field (a text mask when nothing is padded)
        return None
    if isinstance(value, tuple):
        return tuple(_narrow(part, dim, start, length) for part in value)
    return value.narrow(dim, start, length)


def token_streams(tokens) -> list[str]:
    """The token streams of a model's token state: the ``SEQUENCE_FIELDS`` that are their own stream."""
    return [name for name, (stream, _) in type(tokens).SEQUENCE_FIELDS.items() if name == stream]


def narrow_streams(tokens, ranges: dict[str, tuple[int, int]]):
    """The token state with every per-token field narrowed to its stream's ``(start, stop)`` rows: the stream
    itself, its rotary rows, its mask columns."""
    changes = {}
    for name, (stream, dim) in type(tokens).SEQUENCE_FIELDS.items():
        start, stop = ranges[stream]
        changes[name] = _narrow(getattr(tokens, name), dim, start, stop - start)
    return dataclasses.replace(tokens, **changes)


class SequenceParallel(nn.Module):
    """Wraps a plain model with ``embed`` / ``run_blocks`` / ``head`` stages: the streams its token state names in
    ``SEQUENCE_FIELDS`` are split across the sequence group, and the output stream is gathered after ``head``."""

    def __init__(self, model: nn.Module, context: ParallelContext) -> None:
        super().__init__()
        self.model = model
        self.context = context
        self.attention = SequenceParallelAttention(context)
        for module in model.modules():
            if isinstance(module, AttentionDispatch) and module.sequence_streams != ():
                self.set_local_attention(module, sdpa_attention)

    @property
    def config(self):
        return self.model.config

    def set_local_attention(self, module: AttentionDispatch, local: AttentionFn) -> None:
        """``module`` attends through the sequence group, running ``local`` on this rank's heads over the gathered
        sequence (after the Ulysses all-to-all). Not for modules whose ``sequence_streams`` is empty: their keys are
        whole on every rank, and they keep their own attention."""
        module.set_attention_fn(functools.partial(self.attention, streams=module.sequence_streams, local=local))

    def split(self, tokens):
        """This rank's contiguous chunk of every stream: (local tokens, {stream: per-rank sizes}); run the blocks on
        them inside ``sequence_layout`` of those sizes."""
        degree, me = self.context.config.sequence_degree, self.context.sequence_rank
        fields = type(tokens).SEQUENCE_FIELDS
        sizes = {
            name: split_sizes(getattr(tokens, name).shape[fields[name][1]], degree) for name in token_streams(tokens)
        }
        ranges = {stream: (sum(s[:me]), sum(s[: me + 1])) for stream, s in sizes.items()}
        return narrow_streams(tokens, ranges), sizes

    def gather(self, out: torch.Tensor, sizes: list[int]) -> torch.Tensor:
        """Every sequence rank's ``out`` (``sizes[r]`` rows on rank r) concatenated along dim 1."""
        return all_gather_uneven(out, 1, sizes, self.context.sequence_group, self.context.stats)

    def forward(self, *args, **kwargs) -> torch.Tensor:
        tokens, sizes = self.split(self.model.embed(*args, **kwargs))
        with sequence_layout(sizes):
            out = self.model.head(self.model.run_blocks(tokens))
        return self.gather(out, sizes[type(tokens).OUTPUT_STREAM])
