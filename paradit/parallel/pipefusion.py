"""PipeFusion: the blocks split into pipeline stages, image row bands (the text with band 0) flowing through them, each
attention layer attending to its K/V buffer: this step's rows where written, the previous step's elsewhere. A cached
prefix (``layers/prefix_attention.py``) runs through the stages once per request, each stage keeping its own blocks'
keys and values, which lead its buffers."""

from __future__ import annotations

import itertools
from collections import deque
from contextvars import ContextVar
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from paradit.compile import model_blocks
from paradit.errors import InvalidRequest
from paradit.layers.attention import AttentionDispatch, AttentionFn, sdpa_attention
from paradit.layers.prefix_attention import CachedPrefix, PrefixCaching, with_prefix_mask
from paradit.parallel.comm import broadcast, split_sizes
from paradit.parallel.mesh import ParallelContext, new_subgroup
from paradit.parallel.sequence import SequenceParallel, narrow_streams, scoped, sequence_layout, stream_lengths


@dataclass
class Window:
    """Per stream: its first row in flight, the rows each sequence rank holds from there, its whole length."""

    starts: dict[str, int]
    sizes: dict[str, list[int]]
    lengths: dict[str, int]
    _copies: dict[tuple[str, ...], list[tuple[int, int, int]]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.whole = all(sum(self.sizes[s]) == self.lengths[s] for s in self.lengths)

    def copies(self, streams: tuple[str, ...]) -> list[tuple[int, int, int]]:
        """(row in the call, row in the buffer, count) runs for a module concatenating ``streams`` in that order."""
        if streams not in self._copies:
            offsets = dict(zip(streams, itertools.accumulate((self.lengths[s] for s in streams), initial=0)))
            runs, source = [], 0
            for rank in range(len(self.sizes[streams[0]])):
                for stream in streams:
                    count = self.sizes[stream][rank]
                    target = offsets[stream] + self.starts[stream] + sum(self.sizes[stream][:rank])
                    if runs and runs[-1][0] + runs[-1][2] == source and runs[-1][1] + runs[-1][2] == target:
                        runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + count)  # contiguous: one copy
                    elif count:
                        runs.append((source, target, count))
                    source += count
            self._copies[streams] = runs
        return self._copies[streams]


# The patch in flight's window, read by the StaleKVAttention in its blocks: it travels with the tokens, like the layout.
_WINDOW: ContextVar[Window] = ContextVar("paradit_pipefusion_window")


class StaleKVAttention:
    """A K/V buffer over the streams' whole sequence: the tokens in flight write their rows, then attend to all."""

    def __init__(self, streams: tuple[str, ...], kernel: AttentionFn = sdpa_attention) -> None:
        self.streams, self.kernel = streams, kernel
        self.key: torch.Tensor | None = None
        self.value: torch.Tensor | None = None
        self.mask: torch.Tensor | None = None

    # Compiled blocks break their graph here: the rows written change every patch and would recompile the block.
    @torch.compiler.disable
    def __call__(
        self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, key_mask: torch.Tensor | None = None
    ) -> torch.Tensor:
        if key.shape[1] == 0:  # a patch without tokens of these streams: nothing to write or attend
            return query
        self._write(key, value, key_mask, None)
        return self.kernel(query, self.key, self.value, self.mask)

    @torch.compiler.disable
    def attend_after_prefix(
        self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, prefix: CachedPrefix
    ) -> torch.Tensor:
        """The buffer's first rows hold the prefix, copied in at a request's whole steps; its own keys are unpadded."""
        if key.shape[1] == 0:
            return query
        self._write(key, value, None, prefix)
        return self.kernel(query, self.key, self.value, self.mask)

    def _write(
        self, key: torch.Tensor, value: torch.Tensor, key_mask: torch.Tensor | None, prefix: CachedPrefix | None
    ) -> None:
        window = _WINDOW.get()
        lead = 0 if prefix is None else prefix.key.shape[1]
        own = sum(window.lengths[s] for s in self.streams)
        shape = (key.shape[0], lead + own, *key.shape[2:])
        if window.whole:
            if self.key is None or self.key.shape != shape:
                self.key, self.value = key.new_empty(shape), value.new_empty(shape)
            # A whole-sequence step sets the mask for the request: None (nothing padded) or every row rewritten.
            self.mask = None if key_mask is None else key_mask.new_ones(shape[:2])
            if prefix is not None:
                self.key[:, :lead], self.value[:, :lead] = prefix.key, prefix.value
                self.mask = with_prefix_mask(prefix.key_mask, own)
        elif self.key is None or self.key.shape != shape:
            raise RuntimeError("PipeFusion patched step without a filled K/V buffer; run a warm-up step first")
        for source, target, count in window.copies(self.streams):
            self.key[:, lead + target : lead + target + count] = key[:, source : source + count]
            self.value[:, lead + target : lead + target + count] = value[:, source : source + count]
            if key_mask is not None and self.mask is not None:
                self.mask[:, lead + target : lead + target + count] = key_mask[:, source : source + count]


def band_rows(length: int, band: int, bands: int, lead: int = 0) -> tuple[int, int]:
    """(first, end) output-stream rows. Band 0 also carries ``lead`` tokens of the other streams, so it gets that many
    fewer rows: a patch costs in proportion to its tokens, the slowest pacing."""
    if bands == 1:
        return 0, length
    first = split_sizes(length, bands)[0]
    if length >= bands:  # every band keeps at least one row
        first = min(max((length + lead) // bands - lead, 1), length - (bands - 1))
    if band == 0:
        return 0, first
    sizes = split_sizes(length - first, bands - 1)
    start = first + sum(sizes[: band - 1])
    return start, start + sizes[band - 1]


def stage_range(blocks: int, stages: int, stage: int) -> range:
    sizes = split_sizes(blocks, stages)
    start = sum(sizes[:stage])
    return range(start, start + sizes[stage])


@dataclass(frozen=True)
class PatchItem:
    """Band ``patch`` of ``patches`` (one: the whole step) at denoise step ``step``."""

    step: int
    patch: int
    patches: int


@dataclass
class InFlight:
    """A submitted item whose prediction (``work``: its broadcast) is on its way from the last stage."""

    item: PatchItem
    rows: tuple[int, int]
    local_sizes: list[int]
    prediction: torch.Tensor
    work: dist.Work


class PipeFusion(nn.Module):
    """A plain model as this rank's pipeline stage. A call is one whole step; the patch loop calls ``run``, which
    submits and collects patches separately, so that the pipeline never drains between steps."""

    def __init__(self, model: nn.Module, context: ParallelContext, sequence: SequenceParallel | None = None) -> None:
        super().__init__()
        config = context.config
        self.sequence, self.model, self.context = sequence, model, context
        self.group = context.group("pipefusion")
        # A communicator (NCCL stream) of its own: predictions flowing back must not queue behind activations.
        self.prediction_group = new_subgroup(config, ("pipefusion",))
        self.stages = config.pipefusion
        self.stage = context.local_rank("pipefusion")
        ranks = dist.get_process_group_ranks(self.group)
        self.prev_rank = ranks[self.stage - 1] if self.stage > 0 else None
        self.next_rank = ranks[self.stage + 1] if self.stage + 1 < self.stages else None
        self.last_rank = ranks[-1]
        self.patches = config.patches
        self.warmup_steps = config.warmup_steps
        self.step = 0
        self._out_channels: int | None = None
        self._in_flight: deque[InFlight] = deque()
        self._sends: list[tuple[dist.Work, torch.Tensor]] = []
        self.output_length = 0
        self._lead = 0
        self._image: torch.Tensor | None = None  # the last submitted step's embedded output stream

        mine = stage_range(len(model_blocks(model)), self.stages, self.stage)  # check_plan: no more stages than blocks
        position = itertools.count()  # of each block in the run order
        for name in type(model).BLOCK_LISTS:
            # The other stages' blocks are dropped, so their weights are freed.
            setattr(model, name, nn.ModuleList([block for block in getattr(model, name) if next(position) in mine]))

        for module in self.model.modules():
            # Keys from no split stream (Wan's text) are whole and fresh on every stage: no stale K/V to buffer.
            if isinstance(module, AttentionDispatch) and module.sequence_streams != ():
                if module.sequence_streams is None:
                    raise InvalidRequest(f"pipefusion needs {type(module).__name__} to name its streams in order")
                stale = StaleKVAttention(module.sequence_streams, module.kernel)
                if self.sequence is not None:
                    self.sequence.set_local_attention(module, stale)
                else:
                    module.set_attention_fn(stale)
                if isinstance(module, PrefixCaching):
                    if self.sequence is not None:  # the family's check_run refuses it first
                        raise InvalidRequest("pipefusion with a sequence group cannot attend a cached prefix yet")
                    module.prefix_attention_fn = stale.attend_after_prefix

    @property
    def config(self):
        return self.model.config

    def encode_prefix(self, *args, **kwargs):
        """A prefix-caching model's prefix, stage after stage (once per request): each stage runs its blocks on the
        previous stage's hidden states and keeps its own blocks' keys and values."""
        tokens = self.model.embed_prefix(*args, **kwargs)
        if self.prev_rank is not None:
            received = torch.empty_like(tokens.hidden)
            dist.recv(received, self.prev_rank, group=self.group)
            tokens.hidden = received
        tokens = self.model.run_prefix_blocks(tokens)
        if self.next_rank is not None:
            hidden = tokens.hidden.contiguous()
            dist.send(hidden, self.next_rank, group=self.group)
            self.context.stats.add(hidden.nbytes)
        return self.model.cached_prefix(tokens)

    def begin_request(self) -> None:
        self.step = 0
        self._in_flight.clear()

    @property
    def in_flight(self) -> list[PatchItem]:
        return [pending.item for pending in self._in_flight]

    def patches_at(self, step: int) -> int:
        return 1 if step < self.warmup_steps else self.patches

    def band(self, band: int, bands: int) -> tuple[int, int]:
        return band_rows(self.output_length, band, bands, self._lead)

    def forward(self, *args, **kwargs) -> torch.Tensor:
        patches = self.patches_at(self.step)
        self.step += 1
        submits = [PatchItem(self.step - 1, m, patches) for m in range(patches)]
        return self.run(submits, len(self._in_flight) + patches, *args, **kwargs)[0]

    def run(self, submits: list[PatchItem], collect: int, *args, **kwargs) -> tuple[torch.Tensor, list[InFlight]]:
        """Submit ``submits``, then collect the ``collect`` oldest items in flight: a prediction of the whole output
        stream, valid on their rows only, and those items."""
        if submits:
            tokens = self.model.embed(*args, **kwargs)
            for item in submits:
                self._submit(tokens, item)
        return self._collect(collect)

    def _submit(self, tokens, item: PatchItem) -> None:
        output = type(tokens).OUTPUT_STREAM
        lengths = stream_lengths(tokens)
        streams = list(lengths)
        self.output_length = lengths[output]
        self._lead = sum(length for s, length in lengths.items() if s != output)  # rides with patch 0
        start, stop = self.band(item.patch, item.patches)
        ranges = {s: (start, stop) if s == output else (0, lengths[s] if item.patch == 0 else 0) for s in streams}
        patch = narrow_streams(tokens, ranges)
        if self.sequence is not None:
            patch, sizes = self.sequence.split(patch)
        else:
            sizes = {s: [stop - begin] for s, (begin, stop) in ranges.items()}
        window = Window({s: ranges[s][0] for s in streams}, sizes, lengths)
        if self.prev_rank is not None:  # the previous stage's activations for the rows this rank holds
            for s in streams:
                received = torch.empty_like(getattr(patch, s))
                if received.numel():
                    dist.irecv(received, self.prev_rank, group=self.group).wait()
                setattr(patch, s, received)
        with sequence_layout(sizes), scoped(_WINDOW, window):
            patch = self.model.run_blocks(patch)
        if self.next_rank is not None:
            self._send([getattr(patch, s) for s in streams])
        # The last stage broadcasts this rank's rows of the prediction at once; the others post the receive.
        prediction = self.model.head(patch).contiguous() if self.next_rank is None else None
        image = self._image = getattr(tokens, output)
        if self._out_channels is None:  # the head's width, learnt once: only the last stage has run it
            width = torch.tensor([prediction.shape[-1] if prediction is not None else 0], device=image.device)
            width = broadcast(width, self.last_rank, self.prediction_group, self.context.stats)
            self._out_channels = int(width.item())
        if prediction is None:
            me = self.context.sequence_rank if self.sequence is not None else 0
            prediction = image.new_empty(image.shape[0], sizes[output][me], self._out_channels)
        else:
            self.context.stats.add(prediction.nbytes * (self.stages - 1))
        work = dist.broadcast(prediction, self.last_rank, group=self.prediction_group, async_op=True)
        self._in_flight.append(InFlight(item, (start, stop), sizes[output], prediction, work))

    def _collect(self, count: int) -> tuple[torch.Tensor, list[InFlight]]:
        out = self._image.new_zeros(self._image.shape[0], self.output_length, self._out_channels)
        collected = [self._in_flight.popleft() for _ in range(count)]
        for done in collected:
            done.work.wait()
            rows = done.prediction
            if self.sequence is not None:  # each stage rank holds its chunk of the band: gather them in rank order
                rows = self.sequence.gather(rows, done.local_sizes)
            out[:, done.rows[0] : done.rows[1]] = rows
        if not self._in_flight:
            self._wait_for_sends()
        return out, collected

    def _send(self, tensors: list[torch.Tensor]) -> None:
        # The previous patch's sends finished long ago (the next stage needed them); waiting only frees their buffers.
        self._wait_for_sends()
        # Empty streams (the text of later patches) are not sent; the receiver knows their shapes.
        for tensor in (t.contiguous() for t in tensors if t.numel()):
            self._sends.append((dist.isend(tensor, self.next_rank, group=self.group), tensor))
            self.context.stats.add(tensor.nbytes)

    def _wait_for_sends(self) -> None:
        for work, _ in self._sends:
            work.wait()
        self._sends = []
