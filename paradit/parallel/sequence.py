"""Sequence parallelism: the token streams split after ``embed``, attention across the ranks by Ulysses (all-to-all
over heads), Ring (K/V blocks passed round, merged by log-sum-exp) or both (USP: Ulysses innermost).

A cached prefix (``layers/prefix_attention.py``) is not exchanged at each step: each rank keeps, of every layer's
prefix, the heads its Ulysses rank attends and its Ring rank's share of the tokens, which travels round the ring
ahead of that rank's own keys. Under Ring alone the prefix encode is split too: each rank runs its share, the
block-causal mask applied tile by tile round the ring, fully masked tiles skipped."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import Iterator
from contextvars import ContextVar

import torch
from torch import nn

from paradit.layers.attention import (
    AttentionDispatch,
    AttentionFn,
    FP8Attention,
    accumulation_precision,
    attention_with_lse,
    sdpa_attention,
)
from paradit.layers.prefix_attention import CachedPrefix, PrefixCaching, masked_sdpa
from paradit.parallel.comm import (
    RingExchange,
    all_gather_uneven,
    all_reduce_sum,
    split_sizes,
    start_all_to_all_uneven,
)
from paradit.parallel.mesh import ParallelContext
from paradit.parallel.transport import decode_fp8_rows, encode_fp8_rows

# Ulysses' heads travel in this many chunks, each attended while its neighbours' exchanges are in flight; more chunks
# hide more of the exchange but send smaller messages and run smaller attention calls.
ULYSSES_CHUNKS = 2


# The forward in flight's layout (stream -> tokens per sequence rank), set around the blocks by whoever splits the
# tokens. A context variable, not an attribute: no state outlives its forward, and concurrent ones never mix.
_LAYOUT: ContextVar[dict[str, list[int]]] = ContextVar("paradit_sequence_layout")


@contextlib.contextmanager
def scoped(var: ContextVar, value) -> Iterator[None]:
    token = var.set(value)
    try:
        yield
    finally:
        var.reset(token)


def sequence_layout(sizes: dict[str, list[int]]) -> contextlib.AbstractContextManager[None]:
    return scoped(_LAYOUT, sizes)


# While a prefix encode runs split over the ring: the prefix tokens each ring rank runs, in ring order.
_PREFIX_SHARES: ContextVar[tuple[int, ...]] = ContextVar("paradit_prefix_shares")


def merge_partials(
    out_acc: torch.Tensor | None, lse_acc: torch.Tensor | None, out: torch.Tensor, lse: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``out`` (B, L, H, D) and ``lse`` (B, H, L) of a new key block merged into the running fp32 or fp64 (``out_acc``,
    ``lse_acc`` (B, L, H, 1); None for the first block)."""
    lse = lse.transpose(1, 2).unsqueeze(-1)  # (B, L, H, 1), aligned with out
    out = accumulation_precision(out)
    if out_acc is None:
        return out, lse
    merged = torch.logaddexp(lse_acc, lse)
    # A query with every key masked so far has lse -inf on both sides; its weights stay 0, not NaN.
    merged_safe = torch.where(torch.isinf(merged), torch.zeros_like(merged), merged)
    return out_acc * torch.exp(lse_acc - merged_safe) + out * torch.exp(lse - merged_safe), merged


def blockwise(local: AttentionFn) -> bool:
    """Whether ``local`` attends whatever keys it is given, so that Ring feeds it one block at a time and Ulysses a
    chunk of heads; PipeFusion's buffer attention needs the whole sequence at once."""
    return local is sdpa_attention or isinstance(local, FP8Attention) or getattr(local, "blockwise", False)


def aligned_split_sizes(total: int, parts: int, alignment: int) -> list[int]:
    """``split_sizes`` in whole units of ``alignment`` tokens (the last rank's ends with the sequence's remainder), so
    that every rank's tokens start at a unit: block-sparse attention's tiles."""
    units = split_sizes(-(-total // alignment), parts)
    sizes = [count * alignment for count in units]
    last = max((rank for rank, count in enumerate(units) if count), default=0)
    sizes[last] -= sum(sizes) - total
    return sizes


class SequenceParallelAttention:
    """A call's streams (its module's ``sequence_streams``; None: all) and the forward's ``sequence_layout`` give
    every rank's token count without communication."""

    def __init__(self, context: ParallelContext) -> None:
        self.context, self.ulysses, self.ring = context, context.config.ulysses, context.config.ring
        self.ulysses_group = context.group("ulysses")
        self.ring_exchange = RingExchange(context.group("ring"), context.stats) if self.ring > 1 else None
        self.fp8_transport = context.config.comm_dtype == "fp8"
        self.local_lengths: list[int] = []  # tokens per sequence rank in this call, in chunk order
        self._mask_cache: tuple[torch.Tensor, torch.Tensor] | None = None  # (mask passed, mask gathered)
        self._tile_cache: tuple[torch.Tensor, list[tuple[bool, bool]]] | None = None  # (mask, each tile's kind)

    def _ulysses_lengths(self) -> list[int]:
        row = self.context.local_rank("ring") * self.ulysses
        return self.local_lengths[row : row + self.ulysses]

    def _ring_lengths(self, prefix: CachedPrefix | None = None) -> list[int]:
        """Keys each ring rank's block holds: its ranks' tokens, after its share of a ``prefix``."""
        shares = [0] * self.ring if prefix is None else prefix.lengths
        return [
            shares[r] + sum(self.local_lengths[r * self.ulysses : (r + 1) * self.ulysses]) for r in range(self.ring)
        ]

    def keep_prefix(self, key: torch.Tensor, value: torch.Tensor, key_mask: torch.Tensor | None) -> CachedPrefix:
        """Of a layer's whole prefix, the heads this Ulysses rank attends and this Ring rank's tokens (the padding
        mask, a bit a token, stays whole: every rank of the ring reads each share's). A split encode's keys and
        values are this rank's share already."""
        shares = _PREFIX_SHARES.get(None)
        if shares is not None:
            return CachedPrefix(key, value, key_mask, shares)
        lengths = split_sizes(key.shape[1], self.ring)
        ring_rank = self.context.local_rank("ring")
        start = sum(lengths[:ring_rank])
        first, count = self._head_ranges(key.shape[2])[self.context.local_rank("ulysses")]
        # Copies, so that the whole prefix is freed once every layer has kept its share.
        key, value = (t[:, start : start + lengths[ring_rank], first : first + count].clone() for t in (key, value))
        return CachedPrefix(key, value, key_mask, tuple(lengths))

    def _head_ranges(self, heads: int, chunk: int = 0, chunks: int = 1) -> list[tuple[int, int]]:
        """(first head, count) each Ulysses rank attends in chunk ``chunk``."""
        owned = split_sizes(heads, self.ulysses)
        parts = [split_sizes(count, chunks) for count in owned]
        return [(sum(owned[:rank]) + sum(share[:chunk]), share[chunk]) for rank, share in enumerate(parts)]

    def _post_heads_to_sequence(self, x: torch.Tensor, ranges: list[tuple[int, int]]):
        """Posts the exchange giving Ulysses rank j heads ``ranges[j]``; its wait returns (B, L_group, ours, D)."""
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
        """The reverse exchange; its wait writes rank j's heads ``ranges[j]`` into ``into`` (B, L_me, H, D)."""
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

    def ulysses_attention(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        key_mask: torch.Tensor | None,
        local: AttentionFn,
        prefix: CachedPrefix | None = None,
    ) -> torch.Tensor:
        """Without Ring, ``blockwise`` attention runs in overlapped head chunks: exact, heads being independent. A
        ``prefix`` holds this rank's heads: each chunk's go before the gathered keys."""
        heads, dtype = q.shape[2], q.dtype
        me = self.context.local_rank("ulysses")
        order = None
        if hasattr(local, "head_order"):  # sparse attention keeps a different share of tiles per head
            sizes = split_sizes(heads, self.ulysses)
            order = local.head_order(q, sum(self._ulysses_lengths()), sizes, me, self._add_up)
        if order is not None:
            q, k, v = (t[:, :, order] for t in (q, k, v))
        count = ULYSSES_CHUNKS if self.ring == 1 and blockwise(local) else 1
        chunks = [self._head_ranges(heads, c, count) for c in range(count)]
        chunks = [ranges for ranges in chunks if any(n for _, n in ranges)]
        key_mask = None if key_mask is None else self.gather_key_mask(key_mask)
        owned_first = self._head_ranges(heads)[me][0]
        wire = [self._to_wire(t) for t in (q, k, v)]
        batch, length, _, width = wire[0].shape
        into = wire[0].new_empty(batch, length, heads, width)  # the output, in the wire's form
        pending, returning = [self._post_heads_to_sequence(t, chunks[0]) for t in wire], []
        for index, ranges in enumerate(chunks):
            gathered = [self._from_wire(finish(), dtype) for finish in pending]
            if index + 1 < len(chunks):
                pending = [self._post_heads_to_sequence(t, chunks[index + 1]) for t in wire]
            placed = local
            if hasattr(local, "for_heads"):  # a kernel whose mask is per head learns which of the model's it has
                first, mine = ranges[me]
                placed = local.for_heads((order or range(heads))[first : first + mine])
            chunk_prefix = None
            if prefix is not None:
                first, count = ranges[me]
                chunk_prefix = narrow_heads(prefix, first - owned_first, count)
            out = self._to_wire(self._attend(*gathered, key_mask, placed, chunk_prefix))
            returning.append(self._post_sequence_to_heads(out, ranges, into))
        for finish in returning:
            finish()
        out = self._from_wire(into, dtype)
        return out if order is None else out[:, :, torch.tensor(order, device=out.device).argsort()]

    def _add_up(self, tensor: torch.Tensor) -> torch.Tensor:
        return all_reduce_sum(tensor, self.ulysses_group, self.context.stats)

    def _attend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        key_mask: torch.Tensor | None,
        local: AttentionFn,
        prefix: CachedPrefix | None = None,
    ) -> torch.Tensor:
        """A local attention not ``blockwise`` gets the ring's K/V all-gathered: the same bytes, without the overlap.
        ``prefix``: this rank's share, in its heads, attended before ``k``."""
        if prefix is not None:
            k, v = torch.cat([prefix.key, k], dim=1), torch.cat([prefix.value, v], dim=1)
        if self.ring == 1:
            return local(q, k, v, self._block_masks(key_mask, prefix, [k.shape[1]], q)[0])
        if blockwise(local):
            return self.ring_attention(q, k, v, key_mask, getattr(local, "with_lse", attention_with_lse), prefix)
        lengths, group = self._ring_lengths(prefix), self.context.group("ring")
        gathered = [all_gather_uneven(self._to_wire(t), 1, lengths, group, self.context.stats) for t in (k, v)]
        masks = self._block_masks(key_mask, prefix, lengths, q)
        key_mask = None if masks[0] is None else torch.cat(masks, dim=1)
        return local(q, *(self._from_wire(t, k.dtype) for t in gathered), key_mask)

    def _block_masks(
        self, key_mask: torch.Tensor | None, prefix: CachedPrefix | None, lengths: list[int], q: torch.Tensor
    ) -> list[torch.Tensor | None]:
        """Each ring rank's keys' mask ([its prefix share | its tokens], ``lengths`` long; None: nothing padded);
        ``key_mask`` is Ulysses-gathered (the ring's are gathered here)."""
        shares = [0] * len(lengths) if prefix is None else list(prefix.lengths)
        own = [length - share for length, share in zip(lengths, shares)]
        prefix_mask = None if prefix is None else prefix.key_mask
        if key_mask is None and prefix_mask is None:
            return [None] * len(lengths)
        if key_mask is not None and self.ring > 1:
            key_mask = self._gather_mask(key_mask, own, self.context.group("ring"))
        ones = functools.partial(torch.ones, dtype=torch.bool, device=q.device)
        prefix_parts = (prefix_mask if prefix_mask is not None else ones(q.shape[0], sum(shares))).split(shares, dim=1)
        own_parts = (key_mask if key_mask is not None else ones(q.shape[0], sum(own))).split(own, dim=1)
        return [torch.cat(pair, dim=1) for pair in zip(prefix_parts, own_parts)]

    def ring_attention(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        key_mask: torch.Tensor | None,
        with_lse,
        prefix: CachedPrefix | None = None,
    ) -> torch.Tensor:
        """Each K/V block attended as it arrives; ``key_mask`` is Ulysses-gathered. With a ``prefix``, each rank's
        block is [its prefix share | its tokens]."""
        lengths = self._ring_lengths(prefix)
        masks = self._block_masks(key_mask, prefix, lengths, q)
        if getattr(with_lse, "takes_offsets", False):  # a block-sparse kernel's mask is by token position
            starts, me = [sum(lengths[:rank]) for rank in range(self.ring)], self.context.local_rank("ring")

            def attend(source: int, *kv: torch.Tensor):
                return with_lse(q, *kv, masks[source], query_start=starts[me], key_start=starts[source])

            return self._around_the_ring(q, k, v, lengths, attend)
        return self._around_the_ring(q, k, v, lengths, lambda source, *kv: with_lse(q, *kv, masks[source]))

    def prefix_tile_attention(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor
    ) -> torch.Tensor:
        """A prefix encode's attention under its (batch or 1, 1, queries, keys) mask: split over the ring (``mask``:
        this rank's query rows, every key), each source's tile attended unmasked where all of it is seen, masked
        where some is, and not at all where none is; whole on this rank otherwise."""
        shares = _PREFIX_SHARES.get(None)
        if shares is None:
            return masked_sdpa(q, k, v, mask)
        tiles = mask.split(shares, dim=-1)
        if self._tile_cache is None or self._tile_cache[0] is not mask:  # every layer passes the same mask
            self._tile_cache = mask, [(bool(tile.any()), bool(tile.all())) for tile in tiles]
        kinds = self._tile_cache[1]

        def attend(source: int, key: torch.Tensor, value: torch.Tensor):
            seen, whole = kinds[source]
            if not seen:
                return None
            return attention_with_lse(q, key, value, None if whole else tiles[source])

        return self._around_the_ring(q, k, v, list(shares), attend)

    def _around_the_ring(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lengths: list[int], attend):
        """``attend(source, key, value)`` (its output and lse, or None: nothing seen) for each ring rank's block
        ``lengths[source]`` long, merged as the blocks arrive."""
        me = self.context.local_rank("ring")
        kv = [k, v]
        # A rank's own block is used as computed; only the copies that cross the wire are quantised.
        wire = [self._to_wire(t) for t in kv]
        out_acc = lse_acc = None
        for step in range(self.ring):
            source = (me - step) % self.ring
            if step + 1 < self.ring:
                length = lengths[(source - 1) % self.ring]
                shapes = [(t.shape[0], length, *t.shape[2:]) for t in wire]
                next_wire, pending = self.ring_exchange.start(wire, shapes)
            # A tile-aligned split may leave a short sequence's rank no tokens: CPU kernels fault on none.
            attended = attend(source, *kv) if lengths[source] and q.shape[1] else None
            if attended is not None:
                out_acc, lse_acc = merge_partials(out_acc, lse_acc, *attended)
            if step + 1 < self.ring:
                for work in pending:
                    work.wait()
                wire = next_wire
                kv = [self._from_wire(t, k.dtype) for t in wire]
        return torch.zeros_like(q) if out_acc is None else out_acc.to(q.dtype)

    def _to_wire(self, tensor: torch.Tensor) -> torch.Tensor:
        return encode_fp8_rows(tensor) if self.fp8_transport else tensor

    def _from_wire(self, wire: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return decode_fp8_rows(wire, dtype) if self.fp8_transport else wire

    def _gather_mask(self, key_mask: torch.Tensor, lengths: list[int], group) -> torch.Tensor:
        # As bytes: gloo carries no bool.
        return all_gather_uneven(key_mask.to(torch.uint8), 1, lengths, group, self.context.stats).bool()

    def gather_key_mask(self, key_mask: torch.Tensor) -> torch.Tensor:
        """Gathered once per forward, as every layer passes the same tensor."""
        if self._mask_cache is None or self._mask_cache[0] is not key_mask:
            self._mask_cache = key_mask, self._gather_mask(key_mask, self._ulysses_lengths(), self.ulysses_group)
        return self._mask_cache[1]

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
        prefix: CachedPrefix | None = None,
    ) -> torch.Tensor:
        """``prefix``: this rank's share of a cached prefix, attended before the keys (which are then unpadded)."""
        layout = _LAYOUT.get()
        sizes = [layout[name] for name in (streams or layout)]
        self.local_lengths = [sum(column) for column in zip(*sizes)]
        if not any(self.local_lengths):  # no rank holds a token of these streams (PipeFusion's text-less patches)
            return query
        if self.ulysses > 1:
            return self.ulysses_attention(query, key, value, key_mask, local, prefix)
        return self._attend(query, key, value, key_mask, local, prefix)


def narrow_heads(prefix: CachedPrefix, first: int, count: int) -> CachedPrefix:
    key, value = (t.narrow(2, first, count) for t in (prefix.key, prefix.value))
    return dataclasses.replace(prefix, key=key, value=value)


def _narrow(value, dim: int, start: int, length: int):
    if value is None:  # an optional per-token field (a text mask when nothing is padded)
        return None
    if isinstance(value, tuple):
        return tuple(_narrow(part, dim, start, length) for part in value)
    return value.narrow(dim, start, length)


def stream_lengths(tokens) -> dict[str, int]:
    """Of the ``SEQUENCE_FIELDS`` that are their own stream."""
    fields = type(tokens).SEQUENCE_FIELDS.items()
    return {name: getattr(tokens, name).shape[dim] for name, (stream, dim) in fields if name == stream}


def narrow_streams(tokens, ranges: dict[str, tuple[int, int]]):
    """Every per-token field (stream, rotary rows, mask columns) narrowed to its stream's range."""
    changes = {}
    for name, (stream, dim) in type(tokens).SEQUENCE_FIELDS.items():
        start, stop = ranges[stream]
        changes[name] = _narrow(getattr(tokens, name), dim, start, stop - start)
    return dataclasses.replace(tokens, **changes)


class SequenceParallel(nn.Module):
    """A staged model with its streams split across the sequence group, the output gathered after ``head``."""

    def __init__(self, model: nn.Module, context: ParallelContext) -> None:
        super().__init__()
        self.model, self.context = model, context
        self.attention = SequenceParallelAttention(context)
        self.kernels = []  # each split attention's own kernel, asked per forward for the alignment it needs
        for module in model.modules():
            if isinstance(module, AttentionDispatch) and module.sequence_streams != ():
                self.set_local_attention(module, module.kernel)
                self.kernels.append(module.kernel)

    @property
    def config(self):
        return self.model.config

    def set_local_attention(self, module: AttentionDispatch, local: AttentionFn) -> None:
        module.set_attention_fn(functools.partial(self.attention, streams=module.sequence_streams, local=local))
        if isinstance(module, PrefixCaching):
            module.keep_prefix = self.attention.keep_prefix
            module.prefix_attention_fn = module.attention_fn
            module.masked_attention_fn = self.attention.prefix_tile_attention

    def split(self, tokens):
        """This rank's chunk of each stream, and {stream: per-rank sizes} for ``sequence_layout``."""
        degree, me = self.context.config.sequence_degree, self.context.sequence_rank
        alignment = max((getattr(kernel, "token_alignment", 1) for kernel in self.kernels), default=1)
        sizes = {
            stream: aligned_split_sizes(length, degree, alignment) for stream, length in stream_lengths(tokens).items()
        }
        ranges = {stream: (sum(s[:me]), sum(s[: me + 1])) for stream, s in sizes.items()}
        return narrow_streams(tokens, ranges), sizes

    def encode_prefix(self, *args, **kwargs):
        """A prefix-caching model's prefix, once per request; each layer keeps its share. Under Ring alone each rank
        runs its share of the tokens; with Ulysses every rank runs it whole (a split encode would need its heads
        exchanged twice a layer, for keys each rank then throws most of away)."""
        if self.context.config.ulysses > 1:
            return self.model.encode_prefix(*args, **kwargs)
        tokens = self.model.embed_prefix(*args, **kwargs)
        (stream, length), *_ = stream_lengths(tokens).items()
        shares = split_sizes(length, self.context.config.ring)
        start = sum(shares[: self.context.local_rank("ring")])
        tokens = narrow_streams(tokens, {stream: (start, start + shares[self.context.local_rank("ring")])})
        with scoped(_PREFIX_SHARES, tuple(shares)):
            tokens = self.model.run_prefix_blocks(tokens)
        return self.model.cached_prefix(tokens)

    def gather(self, out: torch.Tensor, sizes: list[int]) -> torch.Tensor:
        return all_gather_uneven(out, 1, sizes, self.context.sequence_group, self.context.stats)

    def forward(self, *args, **kwargs) -> torch.Tensor:
        tokens, sizes = self.split(self.model.embed(*args, **kwargs))
        with sequence_layout(sizes):
            out = self.model.run_stack(tokens)
        return self.gather(out, sizes[type(tokens).OUTPUT_STREAM])
