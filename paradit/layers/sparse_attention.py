"""Block-sparse self-attention for video (``--sparse-attention radial|svg2``): each video self-attention's kernel
replaced by one that attends only the (query tile, key tile) pairs a block mask keeps, through the Triton kernel
(FP8, or the inputs' precision) that skips the others; on the CPU outside Triton's interpreter, masked SDPA, the
reference. Dense for the first steps and the first blocks. Lossy: the density it ran at is reported.

The parallel runtime places a call (``for_heads``: the heads a Ulysses rank attends, in the model's numbering;
``with_lse``'s token offsets: where a Ring block's queries and keys sit in the sequence) and balances Ulysses' heads
by their kept tiles (``head_order``). Single-device code: nothing here names ``torch.distributed``."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from paradit.layers.attention import AttentionDispatch, FP8Attention, attention_with_lse, sdpa_attention
from paradit.layers.semantic_permutation import (
    SVG2_DENSE_BLOCK_SHARE,
    SVG2_DENSE_STEP_SHARE,
    SVG2_FIRST_ITERATIONS,
    SVG2_ITERATIONS,
    SVG2_KEY_CLUSTERS,
    SVG2_MIN_KEY_SHARE,
    SVG2_QUERY_CLUSTERS,
    SVG2_TOP_P,
    permute_tokens,
    semantic_layout,
    unpermute_tokens,
)
from paradit.layers.sparse_masks import (
    RADIAL_DECAY_FACTOR,
    RADIAL_DENSE_BLOCKS,
    RADIAL_DENSE_STEPS,
    TILE,
    VIDEO_GRID,
    kept_share,
    radial_block_mask,
    radial_kept_share,
    tiles,
    token_mask,
)
from paradit.request_hooks import RequestHook

SPARSE_METHODS = ("radial", "svg2")
# The settings each method reads, as its record names them.
RECORDED = {
    "radial": ("dense_steps", "dense_blocks", "decay_factor"),
    "svg2": (
        "dense_steps",
        "dense_blocks",
        "query_clusters",
        "key_clusters",
        "top_p",
        "min_key_share",
        "first_iterations",
        "iterations",
    ),
}


@dataclass(frozen=True)
class SparseSettings:
    """One run's sparse attention: the method, its dense warm-up (``dense_steps`` None: SVG2's share of each
    request's steps), and its mask's parameters, each default the method's paper's."""

    method: str
    dense_steps: int | None
    dense_blocks: int
    decay_factor: float = RADIAL_DECAY_FACTOR  # radial
    query_clusters: int = SVG2_QUERY_CLUSTERS  # svg2
    key_clusters: int = SVG2_KEY_CLUSTERS
    top_p: float = SVG2_TOP_P
    min_key_share: float = SVG2_MIN_KEY_SHARE
    first_iterations: int = SVG2_FIRST_ITERATIONS
    iterations: int = SVG2_ITERATIONS

    @classmethod
    def of(cls, method: str, blocks: int, **given) -> SparseSettings:
        """``given``: the parameters asked for (``ExecutionOptions.sparse_parameters``); ``blocks``: the model's."""
        if method not in SPARSE_METHODS:
            raise ValueError(f"sparse attention {method!r}: choose one of {', '.join(SPARSE_METHODS)}")
        radial = method == "radial"
        defaults = {
            "dense_steps": RADIAL_DENSE_STEPS if radial else None,
            "dense_blocks": RADIAL_DENSE_BLOCKS if radial else math.ceil(SVG2_DENSE_BLOCK_SHARE * blocks),
        }
        return cls(method, **{**defaults, **given})

    def dense_steps_of(self, steps: int) -> int:
        if self.dense_steps is None:
            return math.ceil(SVG2_DENSE_STEP_SHARE * steps)
        return self.dense_steps


def block_masked_attention_with_lse(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    block_mask: torch.Tensor,
    key_mask: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference: exact attention over the token mask ``block_mask`` (B or 1, H or 1, query tiles, key tiles)
    stands for, in (B, L, H, D) layout; a query left without keys gets 0 and log-sum-exp -inf."""
    q, k, v = query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2)
    allowed = token_mask(block_mask, q.shape[2], k.shape[2])
    if key_mask is not None:
        allowed = allowed & key_mask[:, None, None, :]
    scores = (q.float() @ k.float().transpose(-1, -2)) * q.shape[-1] ** -0.5
    scores = scores.masked_fill(~allowed, float("-inf"))
    lse = scores.logsumexp(dim=-1)
    empty = torch.isneginf(lse)
    weights = torch.softmax(scores.masked_fill(empty[..., None], 0.0), dim=-1).masked_fill(empty[..., None], 0.0)
    return (weights @ v.float()).to(q.dtype).transpose(1, 2), lse


def balanced_head_order(kept: list[float], sizes: list[int]) -> list[int]:
    """Heads in the order that gives Ulysses rank r the ``sizes[r]`` heads after those of the ranks before it, so
    that the ranks' kept tiles are as even as whole heads allow: the heaviest head first to the lightest rank with
    room (longest processing time first)."""
    loads, members = [0.0] * len(sizes), [[] for _ in sizes]
    for head in sorted(range(len(kept)), key=lambda h: (-kept[h], h)):
        rank = min((r for r in range(len(sizes)) if len(members[r]) < sizes[r]), key=lambda r: (loads[r], r))
        loads[rank] += kept[head]
        members[rank].append(head)
    return [head for rank in members for head in sorted(rank)]


@dataclass
class SparseRecord:
    """What a request's sparse attention did, for the closing table, ``--json`` and the files' metadata: the method
    and its settings, the mean share of (query, key) pairs its sparse calls' masks kept (``density``: the whole
    mask's for radial, rank 0's heads' for SVG2 under Ulysses), and that share over every video self-attention call,
    the dense warm-up's counted whole (``attended``)."""

    method: str
    settings: dict
    density: float | None = None
    attended: float | None = None
    kept: float = 0.0  # the sums behind them, over every transformer (a model's two experts add theirs up)
    sparse_calls: int = 0
    dense_calls: int = 0

    def add(self, kept: float, sparse_calls: int, dense_calls: int) -> None:
        self.kept, self.sparse_calls, self.dense_calls = (
            self.kept + kept,
            self.sparse_calls + sparse_calls,
            self.dense_calls + dense_calls,
        )
        calls = self.sparse_calls + self.dense_calls
        self.density = self.kept / self.sparse_calls if self.sparse_calls else None
        self.attended = (self.kept + self.dense_calls) / calls if calls else None

    def line(self) -> str:
        measured = "no sparse call" if self.density is None else f"density {self.density:.2f}"
        return f"sparse attention ({self.method}), {measured}, {self.attended or 1.0:.2f} of all pairs attended"


class SparseRun(RequestHook):
    """The run's shared state: the request's settings (its own ``sparse_attention``, else the run's ``default``;
    None: dense), whether this step is sparse, what the calls kept (``SparseRecord``), and per block what SVG2
    carries from step to step (each head's centroids and kept tiles), reset per request."""

    def __init__(self, default: SparseSettings | None, blocks: int = 0) -> None:
        self.default, self.blocks = default, blocks
        self.settings = default
        self.sparse_now = default is not None and default.dense_steps_of(1) == 0
        self.kept = self.sparse_calls = self.dense_calls = 0.0
        self.per_block: dict[int, dict] = {}
        self.static_rows: dict[tuple, torch.Tensor] = {}  # radial's kernel rows, by grid, place and shape
        self.record_: SparseRecord | None = None

    def begin_request(self, request) -> None:
        own = getattr(request, "sparse_attention", None)
        self.settings = self.default if own is None else SparseSettings.of(own.method, self.blocks, **own.parameters())
        self.sparse_now = self.settings is not None and self.settings.dense_steps_of(1) == 0
        self.kept = self.sparse_calls = self.dense_calls = 0.0
        self.per_block = {}
        self.record_ = None

    def begin_denoise(self, denoise) -> None:
        """One record for the request, which each transformer's run (each expert's) adds its calls to."""
        if self.settings is None:
            return
        settings = {name: getattr(self.settings, name) for name in RECORDED[self.settings.method]}
        settings["dense_steps"] = self.settings.dense_steps_of(len(denoise.timesteps))
        self.record_ = denoise.features.setdefault("sparse_attention", SparseRecord(self.settings.method, settings))

    def at_step(self, done: int, steps: int) -> None:
        self.sparse_now = self.settings is not None and done >= self.settings.dense_steps_of(steps)
        if self.record_ is not None:  # once a step: the shares kept on the device until now, handed to the record
            self.record_.add(float(self.kept), int(self.sparse_calls), int(self.dense_calls))
            self.kept = self.sparse_calls = self.dense_calls = 0.0

    def record(self, block_mask: torch.Tensor, q_length: int, k_length: int) -> None:
        self.record_share(kept_share(block_mask, q_length, k_length))

    def record_share(self, share: torch.Tensor) -> None:
        self.kept = self.kept + share
        self.sparse_calls += 1

    def record_dense(self) -> None:
        self.dense_calls += 1

    @property
    def density(self) -> float | None:
        """The mean share of (query, key) pairs the sparse calls attended (None: none ran sparse)."""
        return self.kept / self.sparse_calls if self.sparse_calls else None

    @property
    def attended(self) -> float | None:
        calls = self.sparse_calls + self.dense_calls
        return (self.kept + self.dense_calls) / calls if calls else None

    def block_state(self, block: int) -> dict:
        return self.per_block.setdefault(block, {"centroids": {}, "kept": {}})


@dataclass(frozen=True)
class SparseSelfAttention:
    """One video self-attention's kernel. ``dense``: the kernel it replaced (SDPA or FP8 attention), which the dense
    steps and blocks run; ``heads``: the model's heads this call's tensors hold (None: all, in order)."""

    run: SparseRun
    block: int
    dense: object
    heads: tuple[int, ...] | None = None
    blockwise: bool = True  # Ring feeds it one key block at a time, Ulysses a chunk of heads

    @property
    def token_alignment(self) -> int:
        """A sparse request's sequence ranks start at whole tiles (a rank's tiles are then the mask's); a dense one's
        split as evenly as any other model's (a tiny video's ranks would otherwise hold no tokens)."""
        return 1 if self.run.settings is None else TILE

    @property
    def active(self) -> bool:
        return self.run.sparse_now and self.block >= self.run.settings.dense_blocks and VIDEO_GRID.get() is not None

    def for_heads(self, heads: list[int]) -> SparseSelfAttention:
        return dataclasses.replace(self, heads=tuple(heads))

    def head_order(
        self,
        query: torch.Tensor,
        length: int,
        sizes: list[int],
        rank: int,
        add_up: Callable[[torch.Tensor], torch.Tensor],
    ) -> list[int] | None:
        """The model's heads in the order that gives each Ulysses rank (``sizes[r]`` heads each, ``rank`` this one)
        about the same kept tiles; None: the plain order. ``query``: this rank's (B, its tokens, every head, D) of a
        sequence of ``length``. Radial keeps the same tiles in every head: the plain order is balanced. SVG2's heads
        keep what their clusters do: its first sparse call runs in the plain order, whose kept tiles (each rank's
        heads', summed over the ranks by ``add_up``) choose the order the request keeps; the heads that move take
        their centroids along, so that each head's k-means goes on from its own, as in one process. Every rank calls
        it once per call, alike."""
        if not self.active or self.run.settings.method == "radial":
            return None
        state = self.run.block_state(self.block)
        state["ulysses_calls"] = state.get("ulysses_calls", 0) + 1
        if "order" in state or state["ulysses_calls"] == 1:
            return state.get("order")
        batch, _, heads, dim = query.shape
        loads = torch.zeros(heads, dtype=torch.float64, device=query.device)
        for head, count in state["kept"].items():
            loads[head] = count
        order = balanced_head_order(add_up(loads).tolist(), sizes)
        settings, tables = self.run.settings, []
        for side, clusters in enumerate((settings.query_clusters, settings.key_clusters)):
            table = torch.zeros(heads, batch, min(clusters, length), dim, device=query.device)
            for head, centroids in state["centroids"].items():
                table[head] = centroids[side]
            tables.append(add_up(table))
        mine = order[sum(sizes[:rank]) : sum(sizes[: rank + 1])]
        state["centroids"] = {head: (tables[0][head], tables[1][head]) for head in mine}
        state["order"] = order
        return order

    def __call__(self, query, key, value, key_mask=None):
        if self.run.settings is None:  # a dense request: compiled blocks trace the kernel, guarding on the settings
            return (self.dense or sdpa_attention)(query, key, value, key_mask)
        return self._sparse_or_warm_up(query, key, value, key_mask)

    # Compiled blocks call it as one opaque step: its masks, tile lists and records are host-side bookkeeping.
    @torch.compiler.disable
    def _sparse_or_warm_up(self, query, key, value, key_mask):
        if not self.active:
            self.run.record_dense()
            return (self.dense or sdpa_attention)(query, key, value, key_mask)
        return self.with_lse(query, key, value, key_mask)[0]

    @torch.compiler.disable
    def with_lse(self, query, key, value, key_mask=None, query_start: int = 0, key_start: int = 0):
        """``query_start``/``key_start``: the tokens' offsets in the sequence (Ring's blocks), whole tiles."""
        if query.numel() == 0:  # a Ulysses rank's empty chunk of heads (CPU kernels fault on none)
            lse = torch.full(query.shape[:1] + query.shape[2:3] + query.shape[1:2], float("-inf"))
            return torch.zeros_like(query), lse.to(query.device)
        if not self.active:
            self.run.record_dense()
            return getattr(self.dense, "with_lse", attention_with_lse)(query, key, value, key_mask)
        if self.run.settings.method == "svg2":
            return self._svg2(query, key, value, key_mask)
        whole = radial_block_mask(VIDEO_GRID.get(), self.run.settings.decay_factor, query.device)
        # The whole mask's share, whichever Ring block this is; made once per grid.
        self.run.record_share(radial_kept_share(VIDEO_GRID.get(), self.run.settings.decay_factor, query.device))
        rows, columns = query_start // TILE, key_start // TILE
        mask = whole[rows : rows + tiles(query.shape[1]), columns : columns + tiles(key.shape[1])]
        # The same tiles at every block and step: their kernel rows made once.
        static = (
            VIDEO_GRID.get(),
            self.run.settings.decay_factor,
            rows,
            columns,
            *query.shape[:3],
            key.shape[1],
            query.device,
        )
        return self._attend(query, key, value, mask[None, None], key_mask, static)

    with_lse.takes_offsets = True

    def _svg2(self, query, key, value, key_mask):
        if key_mask is not None:
            raise ValueError("svg2 sparse attention takes no key mask (video self-attention has no padding)")
        settings, state = self.run.settings, self.run.block_state(self.block)
        heads = self.heads or tuple(range(query.shape[2]))
        warm = None
        if all(head in state["centroids"] for head in heads):
            rows = [state["centroids"][head] for head in heads]
            warm = tuple(torch.stack([row[side] for row in rows], dim=1).flatten(0, 1) for side in (0, 1))
        iterations = settings.first_iterations if warm is None else settings.iterations
        layout, centroids = semantic_layout(
            query,
            key,
            settings.query_clusters,
            settings.key_clusters,
            settings.top_p,
            settings.min_key_share,
            iterations,
            warm,
        )
        batch = query.shape[0]
        per_head = tuple(side.unflatten(0, (batch, -1)) for side in centroids)
        kept = layout.block_mask.sum(dim=(0, 2, 3))  # one reduction; each head's entry a view of it
        for index, head in enumerate(heads):  # each head's own, so that a head keeps them whichever rank it moves to
            state["centroids"][head] = tuple(side[:, index] for side in per_head)
            state["kept"][head] = kept[index]
        self.run.record(layout.block_mask, query.shape[1], key.shape[1])
        q = permute_tokens(query, layout.query_order)
        k, v = permute_tokens(key, layout.key_order), permute_tokens(value, layout.key_order)
        out, lse = self._attend(q, k, v, layout.block_mask, None)
        return unpermute_tokens(out, layout.query_order), torch.empty_like(lse).scatter_(2, layout.query_order, lse)

    def _attend(self, query, key, value, block_mask, key_mask, static: tuple | None = None):
        """``block_mask`` (B or 1, H or 1, tiles, tiles) of this call's tokens and heads: the kernel the run has, or
        the reference on a CPU outside Triton's interpreter. ``static``: a key under which the kernel's rows of kept
        tiles are kept for the next call (None: made anew)."""
        batch, _, heads, _ = query.shape
        kernel = _sparse_kernel(query, self.dense)
        if kernel is None:
            return block_masked_attention_with_lse(query, key, value, block_mask, key_mask)
        from paradit.layers.fp8_attention import kept_tile_rows

        rows = self.run.static_rows.get(static) if static is not None else None
        if rows is None:
            rows = kept_tile_rows(block_mask.expand(batch, heads, -1, -1))
            if static is not None:
                self.run.static_rows[static] = rows
        return kernel(query, key, value, key_mask, rows)


def _sparse_kernel(query: torch.Tensor, dense):
    """The block-sparse kernel for ``query``: FP8 where the run attends in FP8 at this step, else the kernel in the
    inputs' precision; None on a CPU outside Triton's interpreter (the reference runs)."""
    from paradit.layers import fp8_attention

    if query.device.type == "cpu" and not fp8_attention.interpreting():
        return None
    if isinstance(dense, FP8Attention) and dense.fp8_now:
        return fp8_attention.fp8_attention_with_lse
    return fp8_attention.exact_triton_attention_with_lse


def apply_sparse_attention(model: nn.Module, settings: SparseSettings | None) -> SparseRun | None:
    """Every video self-attention (a dispatch whose streams are the video's; one a block) in block order, before
    parallelism wraps each module's kernel and after FP8 attention chose its own; cross-attention to the text stays
    dense. ``settings``: the run's (None: dense unless a request asks); None where the model has no video."""
    attentions = [
        module
        for module in model.modules()
        if isinstance(module, AttentionDispatch) and module.sequence_streams == ("video",)
    ]
    if not attentions:
        return None
    run = SparseRun(settings, len(attentions))
    for block, module in enumerate(attentions):
        module.kernel = module.attention_fn = SparseSelfAttention(run, block, module.kernel)
    return run
